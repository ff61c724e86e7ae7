"""Run across hosts by tests/cluster/suites.py (under mpiexec, ranks dealt out round robin: hydra's ``-hosts
h1,h2`` without slots, rank ``r`` on host ``r % HOSTS``): the nodes, the grid and the ring's node-major order
follow that placement, every algorithm stays exact, and the ring crosses each host's link once each way.

Oracles independent of torus: each rank's network namespace (the inode of /proc/self/ns/net) says which host
it runs on; MPI's own collectives give the results; each host's eth0 byte counter (/proc/self/net/dev, read
in its namespace) gives the bytes that really left the host during one all-reduce.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import torus

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
LAYOUT = os.environ.get("TORUS_CLUSTER_LAYOUT", "")
pytestmark = pytest.mark.skipif(os.environ.get("TORUS_CLUSTER_PLACEMENT") != "round_robin" or not LAYOUT,
                                reason="runs on an emulated cluster, ranks round robin (python -m tests.cluster test)")
ALGOS = ["ring", "torus2d", "hierarchical", "native", "auto"]


@pytest.fixture(scope="module")
def tc():
    comm = torus.TorusComm()
    yield comm
    comm.Free()


def _hosts():
    hosts, ppn = (int(v) for v in LAYOUT.split("x"))
    return hosts, ppn


def test_nodes_grid_and_ring_order_follow_the_round_robin_placement(tc):
    hosts, ppn = _hosts()
    netns = WORLD.allgather(os.stat("/proc/self/ns/net").st_ino)
    host_of = {ino: i for i, ino in enumerate(dict.fromkeys(netns))}
    assert [host_of[n] for n in netns] == [r % hosts for r in range(SIZE)]
    assert (tc.nodes, tc.local_size, tc.node, tc.local_rank) == (hosts, ppn, RANK % hosts, RANK // hosts)
    assert tc.dims == (hosts, ppn) and tc.topology.columns_first  # columns are the hosts
    # node by node: host 0's ranks 0, H, 2H, ..., then host 1's
    assert tc.topology.ring_order == tuple(r for h in range(hosts) for r in range(h, SIZE, hosts))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("count", [1, 1003, 300_001])
def test_every_collective_matches_mpi(tc, algo, count):
    rng = np.random.default_rng(1000 * RANK + count)
    exact = rng.integers(-1000, 1000, count).astype(np.float64)  # every summation order is exact
    noisy = rng.standard_normal(count).astype(np.float32)
    for x, check in ((exact, np.testing.assert_array_equal),
                     (noisy, lambda a, b, err_msg: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                                                              err_msg=err_msg))):
        what = f"allreduce({algo}, {x.dtype}, count {count}) on rank {RANK}"
        got = tc.allreduce(x, algorithm=algo)
        want = np.empty_like(x)
        WORLD.Allreduce(x, want)
        check(got, want, err_msg=what)
        assert WORLD.allgather(got.tobytes()) == [got.tobytes()] * SIZE, f"{what}: ranks differ"
    counts = [count // SIZE + (r < count % SIZE) for r in range(SIZE)]
    got = tc.reduce_scatter(exact, recvcounts=counts, algorithm=algo)
    want = np.empty(counts[RANK])
    WORLD.Reduce_scatter(exact, want, recvcounts=counts)
    np.testing.assert_array_equal(got, want, err_msg=f"reduce_scatter({algo}) on rank {RANK}")
    mine = exact[: counts[RANK]].copy()
    got = tc.allgather(mine, recvcounts=counts, algorithm=algo)
    want = np.empty(count)
    WORLD.Allgatherv(mine, [want, counts])
    np.testing.assert_array_equal(got, want, err_msg=f"allgather({algo}) on rank {RANK}")


def _tx_bytes() -> int:
    """Bytes sent so far through this host's eth0 (its namespace's counter)."""
    with open("/proc/self/net/dev") as f:
        line = next(x for x in f if x.strip().startswith("eth0:"))
    return int(line.split(":", 1)[1].split()[8])


@pytest.mark.parametrize("algo, per_host", [("ring", lambda n, c: 2 * (n - 1) / n),
                                            ("torus2d", lambda n, c: 2 * (c - 1) / c)])
def test_bytes_leaving_each_host(tc, algo, per_host):
    # ring in node-major order: one rank per host sends across, 2(N-1)/N of the buffer (the rank order sent
    # that from every rank: L times as much); the 2D torus, columns first: 2(C-1)/C (its closed form)
    hosts, ppn = _hosts()
    nbytes = 8 << 20
    x = np.ones(nbytes // 4, np.float32)
    tc.allreduce(x, algorithm=algo)  # warm: connections, buffers
    WORLD.Barrier()
    before = _tx_bytes()
    WORLD.Barrier()
    tc.allreduce(x, algorithm=algo)
    WORLD.Barrier()
    sent = _tx_bytes() - before
    WORLD.Barrier()
    want = per_host(SIZE, hosts) * nbytes
    # TCP/IP headers and the barriers add a few per cent; the rank order (or rows first) would be L times
    assert want <= sent <= 1.15 * want, f"{algo} on rank {RANK}: {sent} bytes left host {tc.node}, expected ~{want:.0f}"
