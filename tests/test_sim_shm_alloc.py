"""torus-sim's row for the shared-memory transport's in-place all-reduce of ``TorusComm.alloc`` buffers
(``run_window``, torus/sim/shm.py): the per-rank replay against its closed form, cases computed by hand, uneven
counts against one-term closed forms, and the CLI's --alloc. Single process."""
from __future__ import annotations

import json

import numpy as np
import pytest

from torus.partition import chunks
from torus.sim import shm
from torus.sim.cli import main
from torus.sim.model import Cost, Layout, SimulationError
from torus.sim.simulate import simulate

# flags slower than the bytes, and the other way round; copy_beta differs from window_beta so that a replay
# pricing the copies with the wrong constant fails
FLAG_BOUND = Cost(gamma=7e-11, copy_beta=1e-7, window_beta=9e-11, flag_alpha=4e-6, call_alpha=3e-5)
COPY_BOUND = Cost(gamma=2e-10, copy_beta=1e-7, window_beta=3e-10, flag_alpha=1e-7, call_alpha=0.0)


def _alloc(P: int, count: int, cost: Cost, dtype: str = "float32"):
    return simulate("shm", "allreduce", Layout(1, P, P), count, dtype, cost, alloc=True)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("cost", [FLAG_BOUND, COPY_BOUND], ids=["flag-bound", "copy-bound"])
def test_replay_matches_closed_form(P, cost):
    rng = np.random.default_rng(P)
    for dtype, itemsize in (("float32", 4), ("float64", 8)):
        for count in (0, P, P * int(rng.integers(1, 5000)), P * (1 << 20)):
            r = _alloc(P, count, cost, dtype)
            M = count * itemsize
            assert r.time == pytest.approx(shm.closed_form_window(M, P, cost), rel=1e-12)
            assert r.sent_mean == pytest.approx((P - 1) / P * M)
            assert r.reduced_mean == pytest.approx((P - 1) / P * M)
            assert (r.steps, r.msgs_max, r.inter_node_max, r.method) == (3 if P > 1 else 0, 3, 0.0, "alloc")


def test_a_case_by_hand():
    """3 ranks, 10 float32: chunks of 16, 12, 12 B (partition.chunks gives 4, 3, 3 elements). 10 ns per byte
    reduced and per byte copied, flags 100 ns, the call 5 us; times in ns from the call's start.
    Join at 5100 on every rank. Reduce (2 peers' passes): rank 0 2·16·10 = 320 -> 5420; ranks 1, 2 240 -> 5340.
    Copies (16 B 160 ns, 12 B 120 ns), each after max(now, that owner's reduced + 100):
    rank 0: chunk 1 at max(5420, 5440) + 120 = 5560, chunk 2 at max(5560, 5440) + 120 = 5680;
    rank 1: chunk 2 at max(5340, 5440) + 120 = 5560, chunk 0 at max(5560, 5520) + 160 = 5720;
    rank 2: chunk 0 at max(5340, 5520) + 160 = 5680, chunk 1 at max(5680, 5440) + 120 = 5800.
    Closing copied: rank 0 max(5680, 5800 + 100) = 5900, rank 1 5900, rank 2 max(5800, 5720 + 100) = 5820.
    Copied per rank 24, 28, 28 B; reduced 32, 24, 24 B."""
    cost = Cost(gamma=1e-8, copy_beta=5e-9, window_beta=1e-8, flag_alpha=1e-7, call_alpha=5e-6)
    r = _alloc(3, 10, cost)
    assert r.time == pytest.approx(5900e-9, rel=1e-12)
    assert (r.sent_max, r.sent_mean, r.reduced_max, r.reduced_mean) == pytest.approx((28, 80 / 3, 32, 80 / 3))
    # window_beta unset: the copies are priced at copy_beta (here the same 10 ns per byte)
    assert _alloc(3, 10, Cost(gamma=1e-8, copy_beta=1e-8, flag_alpha=1e-7, call_alpha=5e-6)).time == r.time


def test_fewer_elements_than_ranks_by_hand():
    """3 ranks, 2 float32: chunks of 4, 4, 0 B; 10 ns per byte, flags 100 ns, no call cost. Join at 100;
    reduced: ranks 0, 1 at 100 + 2·4·10 = 180, rank 2 (nothing to reduce) at 100. Copies (4 B: 40 ns):
    rank 0: chunk 1 max(180, 280) + 40 = 320, chunk 2 (empty, still waited for) max(320, 200) = 320;
    rank 1: chunk 2 max(180, 200) = 200, chunk 0 max(200, 280) + 40 = 320;
    rank 2: chunk 0 max(100, 280) + 40 = 320, chunk 1 max(320, 280) + 40 = 360.
    Closing copied: ranks 0 and 1 at 360 + 100 = 460, rank 2 at max(360, 320 + 100) = 420."""
    cost = Cost(gamma=1e-8, window_beta=1e-8, flag_alpha=1e-7)
    r = _alloc(3, 2, cost)
    assert r.time == pytest.approx(460e-9, rel=1e-12)
    assert (r.sent_max, r.reduced_max, r.steps) == (8, 8, 3)


@pytest.mark.parametrize("P", [2, 3, 5, 6])
def test_uneven_counts_against_one_term_closed_forms(P):
    """Counts that P does not divide, and fewer than P. With only the copies priced (γ = 0) every rank's
    reduced is out at call + a, each copies ``M - n_r`` bytes from call + 2a, and the closing flags wait for the
    rank with the smallest chunk: ``call + 3a + w·(M - min n)``. With only the reduction priced (w = 0) the
    largest chunk's owner publishes last: ``call + 3a + (P-1)·γ·max n``. Both priced: between the larger of
    the two and their sum."""
    a, call, g, w = 3e-7, 2e-6, 2e-10, 3e-10
    rng = np.random.default_rng(P)
    for count in (1, P - 1, P + 1, int(rng.integers(P, 10**6)) * P + int(rng.integers(1, P)), 123_457):
        n = np.asarray(chunks(count, P)[0]) * 4
        M = count * 4
        copy = _alloc(P, count, Cost(gamma=0.0, window_beta=w, flag_alpha=a, call_alpha=call)).time
        red = _alloc(P, count, Cost(gamma=g, window_beta=0.0, flag_alpha=a, call_alpha=call)).time
        assert copy == pytest.approx(call + 3 * a + w * (M - n.min()), rel=1e-12)
        assert red == pytest.approx(call + 3 * a + (P - 1) * g * n.max(), rel=1e-12)
        r = _alloc(P, count, Cost(gamma=g, window_beta=w, flag_alpha=a, call_alpha=call))
        assert max(copy, red) <= r.time <= (copy + red - call - 3 * a) * (1 + 1e-12)  # 2 ranks: the sum
        assert r.sent_mean == pytest.approx((M - n).mean()) and r.sent_max == pytest.approx(M - n.min())
        assert r.reduced_max == pytest.approx((P - 1) * n.max())


def test_other_algorithms_and_collectives():
    """An alloc buffer is any other array to the schedules; the row is an all-reduce's only; one node only."""
    layout = Layout(1, 4, 4)
    for algo in ("ring", "torus2d"):
        assert simulate(algo, "allreduce", layout, 1000, alloc=True) == simulate(algo, "allreduce", layout, 1000)
    with pytest.raises(ValueError, match="alloc buffers serve in-place all-reduces, not reduce_scatter"):
        simulate("shm", "reduce_scatter", layout, 1000, alloc=True)
    with pytest.raises(SimulationError, match="shared memory serves one node; this layout has 2"):
        simulate("shm", "allreduce", Layout(2, 2, 2), 1000, alloc=True)


def test_cli_row(capsys, tmp_path):
    args = ["--algo", "shm", "--alloc", "--ranks", "4", "--ranks-per-node", "4", "--nbytes", "64M",
            "--window-beta", "2e-10", "--flag-alpha", "5e-7", "--call-alpha", "2e-5", "--gamma", "1e-10"]
    assert main(args) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    cost = Cost(gamma=1e-10, window_beta=2e-10, flag_alpha=5e-7, call_alpha=2e-5)
    assert line[:5] == ["shm", "allreduce", "4", "2x2", "64M"] and line[-1] == "alloc"
    assert float(line[-2]) == pytest.approx(1e3 * shm.closed_form_window(64 << 20, 4, cost), abs=5e-5)
    # window_beta from a --fit JSON, as the other constants
    params = tmp_path / "fit.json"
    params.write_text(json.dumps({"gamma": 1e-10, "window_beta": 4e-10, "flag_alpha": 5e-7, "call_alpha": 2e-5}))
    assert main(["--algo", "shm", "--alloc", "--ranks", "2", "--ranks-per-node", "2", "--nbytes", "1M",
                 "--params", str(params)]) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    cost = Cost(gamma=1e-10, window_beta=4e-10, flag_alpha=5e-7, call_alpha=2e-5)
    assert float(line[-2]) == pytest.approx(1e3 * shm.closed_form_window(1 << 20, 2, cost), abs=5e-5)  # 4 places


@pytest.mark.parametrize("args, message", [
    (["--algo", "ring,torus2d", "--alloc"], "--alloc prices the shm transport's in-place all-reduce of "
                                            "TorusComm.alloc buffers: it needs --algo shm"),
    (["--algo", "shm", "--alloc", "--collective", "allreduce,allgather"], "--alloc is for allreduce"),
    (["--paper", "--alloc"], "not with --paper or --fit"),
    (["--fit", "--alloc"], "not with --paper or --fit"),
])
def test_cli_alloc_errors(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("torus-sim: error: ") and message in err[0]
