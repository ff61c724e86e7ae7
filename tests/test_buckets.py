"""``buckets.plan``: every gradient in exactly one bucket, one dtype per bucket, reverse order, the size caps
(the first bucket closes at ``first_cap``, the k-th opened at ``first_cap * growth**k``, none above ``cap``;
``growth=inf`` is PyTorch DDP's rule), checked against a bucket-by-bucket oracle written from that rule on
random layouts."""
import math

import numpy as np
import pytest

pytest.importorskip("tensorflow")
from torus.integrations.keras.collectives.buckets import plan  # noqa: E402


def oracle(sizes, dtypes, cap, first_cap, growth=math.inf):
    """Per dtype, a running bucket filled walking backwards; a bucket is closed when it reaches its cap."""
    out, open_, next_cap = [], {}, first_cap
    for i in range(len(sizes) - 1, -1, -1):
        if dtypes[i] not in open_:
            open_[dtypes[i]] = (len(out), min(next_cap, cap))
            next_cap *= growth
            out.append([])
        k, limit = open_[dtypes[i]]
        out[k].append(i)
        if sum(sizes[j] for j in out[k]) >= limit:
            del open_[dtypes[i]]
    return out


def test_one_dtype_reverse_order_and_caps_ddp_rule():
    sizes = [400, 100, 300, 200, 50, 2000, 10]
    got = plan(sizes, ["f"] * 7, cap=500, first_cap=100, growth=math.inf)
    # first bucket: 10, then 2000 reaches 100; then 50+200+300 = 550 >= 500; then 100+400
    assert got == [[6, 5], [4, 3, 2], [1, 0]]


def test_the_ramp_doubles_each_cap_up_to_the_cap():
    # caps 10, 20, 40, 80, 100, 100: ten elements of 10 close buckets of 1, 2, 4, then the 3 left
    got = plan([10] * 10, ["f"] * 10, cap=100, first_cap=10, growth=2)
    assert got == [[9], [8, 7], [6, 5, 4, 3], [2, 1, 0]]
    assert plan([10] * 10, ["f"] * 10, cap=30, first_cap=10, growth=2) == [[9], [8, 7], [6, 5, 4], [3, 2, 1],
                                                                         [0]]


def test_the_default_ramps_from_one_mib_by_doubling():
    mib = 1 << 20
    got = plan([mib] * 12, ["f"] * 12, cap=4 * mib)
    assert [len(b) for b in got] == [1, 2, 4, 4, 1]


def test_thousands_of_buckets_keep_the_cap():
    # growth ** k alone overflows a float past about 1,000 buckets
    got = plan([3] * 3000, ["f"] * 3000, cap=6, first_cap=1, growth=2)
    assert [len(b) for b in got[:3]] == [1, 1, 2] and all(len(b) == 2 for b in got[2:])
    assert sorted(i for b in got for i in b) == list(range(3000))


def test_dtypes_never_share_a_bucket():
    got = plan([8, 8, 8, 8], ["a", "b", "a", "b"], cap=100)
    assert got == [[3, 1], [2, 0]]


def test_first_cap_larger_than_cap_uses_cap():
    assert plan([5, 5, 5], ["f"] * 3, cap=5, first_cap=100) == [[2], [1], [0]]


@pytest.mark.parametrize("growth", [0.5, 0, -1, math.nan])
def test_growth_below_one_is_refused(growth):
    with pytest.raises(ValueError, match="buckets.plan: growth="):
        plan([1, 2], ["f"] * 2, cap=10, growth=growth)


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts_match_the_oracle(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    sizes = [int(s) for s in rng.integers(0, 5000, n)]
    dtypes = [str(d) for d in rng.choice(["float32", "float16", "float64"], n, p=[0.7, 0.2, 0.1])]
    cap, first = int(rng.integers(1, 20000)), int(rng.integers(1, 5000))
    growth = [1.0, 1.5, 2.0, 3.0, math.inf][seed % 5]
    got = plan(sizes, dtypes, cap, first, growth)
    assert sorted(i for b in got for i in b) == list(range(n))
    assert all(len({dtypes[i] for i in b}) == 1 for b in got)
    assert all(b == sorted(b, reverse=True) for b in got)
    assert got == oracle(sizes, dtypes, cap, first, growth)
