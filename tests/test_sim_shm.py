"""torus-sim's row for the shared-memory transport (torus/sim/shm.py): the per-rank replay of its steps against
the closed forms, a case computed by hand, uneven counts, and the refusal across nodes. Single process."""
from __future__ import annotations

import numpy as np
import pytest

from torus.partition import chunks
from torus.sim import shm
from torus.sim.cli import main
from torus.sim.model import Cost, Layout, SimulationError
from torus.sim.plans import COLLECTIVES
from torus.sim.simulate import simulate

# flags slower than a step's copy (the max() in the all-reduce takes the flag), and the other way round
FLAG_BOUND = Cost(gamma=7e-11, copy_beta=9e-11, flag_alpha=4e-6, call_alpha=3e-5, segment_bytes=4096)
COPY_BOUND = Cost(gamma=2e-10, copy_beta=3e-10, flag_alpha=1e-7, call_alpha=0.0, segment_bytes=64 << 10)


def _count(collective: str, P: int, cost: Cost, steps: int, itemsize: int) -> int:
    """Elements that give every chunk exactly ``steps`` whole steps."""
    slot = shm.slot_bytes(cost, P)
    per_step = slot if collective == "allgather" else slot // P
    assert per_step % itemsize == 0
    return P * steps * per_step // itemsize


@pytest.mark.parametrize("P", [2, 3, 4, 6])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("cost", [FLAG_BOUND, COPY_BOUND], ids=["flag-bound", "copy-bound"])
def test_replay_matches_closed_form(P, collective, cost):
    for dtype, itemsize in (("float32", 4), ("float64", 8)):
        count = _count(collective, P, cost, 5, itemsize)
        r = simulate("shm", collective, Layout(1, P, P), count, dtype, cost)
        M = count * itemsize
        assert r.time == pytest.approx(shm.closed_form(collective, M, P, cost), rel=1e-12)
        assert r.steps == 5 * (2 if collective == "allreduce" else 1)
        assert r.sent_mean == pytest.approx(M / P if collective == "allgather" else (P - 1) / P * M)
        assert r.reduced_mean == pytest.approx(0.0 if collective == "allgather" else (P - 1) / P * M)
        assert (r.inter_node_max, r.method) == (0.0, "shm")


def test_a_case_by_hand():
    """2 ranks, 128 float32 (two chunks of 256 B), 256-byte slots (512 B is over one slot: no one-step path):
    2 steps of 128 B per chunk. Before the loop: copy in 128 B (0.128 us). Step 1: the peer's copied flag
    (1 us), reduce 128 B (0.256 us) and copy our chunk out as it is reduced (0.128 us), then copy in step 2
    (0.128 us) while the peer's reduced flag arrives (1 us), the peer's chunk out (0.128 us). Step 2: the
    same without the copy in: 1 + 0.256 + 0.128 + max(1, 0) + 0.128. Plus the call."""
    cost = Cost(gamma=2e-9, copy_beta=1e-9, flag_alpha=1e-6, call_alpha=5e-6, segment_bytes=256)
    r = simulate("shm", "allreduce", Layout(1, 2, 2), 128, "float32", cost)
    step = (1 + 0.256 + 0.128 + 1 + 0.128) * 1e-6
    assert r.time == pytest.approx(5e-6 + 0.128e-6 + 2 * step, rel=1e-12)
    assert (r.steps, r.msgs_max, r.sent_max, r.reduced_max) == (4, 4, 256, 256)


def test_the_one_step_path_by_hand():
    """3 ranks, 1000 float32 (4000 B, under WHOLE_MAX_BYTES and the slot): copy all in (4 us), the peers'
    copied flag (1 us), reduce all 4000 B from the 3 slots (2 x 8 us); plus the call; closed form the same."""
    cost = Cost(gamma=2e-9, copy_beta=1e-9, flag_alpha=1e-6, call_alpha=5e-6)
    r = simulate("shm", "allreduce", Layout(1, 3, 3), 1000, "float32", cost)
    assert r.time == pytest.approx((5 + 4 + 1 + 16) * 1e-6, rel=1e-12)
    assert r.time == pytest.approx(shm.closed_form("allreduce", 4000, 3, cost), rel=1e-12)
    assert (r.steps, r.sent_max, r.reduced_max) == (1, 4000, 8000)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_uneven_counts(collective):
    """Counts not divisible by the ranks or the slot: bytes stay exact, and time grows with the count."""
    P, cost, times = 3, COPY_BOUND, []
    for count in (0, 1, 2, 1000, 50_001, 123_457):
        r = simulate("shm", collective, Layout(1, P, P), count, "float32", cost)
        sizes = np.asarray(chunks(count, P)[0]) * 4
        own = sizes if collective == "allgather" else sizes.sum() - sizes
        if collective == "allreduce" and 0 < count * 4 <= shm.WHOLE_MAX_BYTES:
            own = np.full(P, count * 4)  # the one-step path copies the whole buffer in
        assert r.sent_mean == pytest.approx(own.mean())
        times.append(r.time)
    assert times[0] == 0.0 and times == sorted(times)


def test_more_ranks_than_one_node_is_refused():
    with pytest.raises(SimulationError, match="shared memory serves one node; this layout has 2"):
        simulate("shm", "allreduce", Layout(2, 2, 2), 1000, "float32", COPY_BOUND)


def test_cli_row(capsys):
    assert main(["--algo", "shm", "--ranks", "4", "--ranks-per-node", "4", "--nbytes", "1M",
                 "--copy-beta", "1e-10", "--flag-alpha", "5e-7", "--call-alpha", "2e-5"]) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    cost = Cost(copy_beta=1e-10, flag_alpha=5e-7, call_alpha=2e-5)
    assert line[:5] == ["shm", "allreduce", "4", "2x2", "1M"]
    assert float(line[-2]) == pytest.approx(1e3 * shm.closed_form("allreduce", 1 << 20, 4, cost), rel=1e-4)
