"""Run across hosts by tests/cluster/suites.py (under mpiexec): TorusComm finds the hosts as its nodes.

The oracle is independent of MPI: each rank's network namespace (the inode of /proc/self/ns/net) says which
emulated host it runs on, and the launcher was told HOSTS hosts of PPN consecutive ranks each
(TORUS_CLUSTER_LAYOUT=HOSTSxPPN).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import torus
from torus import select

WORLD = MPI.COMM_WORLD
LAYOUT = os.environ.get("TORUS_CLUSTER_LAYOUT", "")
pytestmark = pytest.mark.skipif(not LAYOUT, reason="runs on an emulated cluster (python -m tests.cluster test)")


def test_nodes_and_ranks_per_node_follow_the_hosts():
    hosts, ppn = (int(v) for v in LAYOUT.split("x"))
    assert "TORUS_RANKS_PER_NODE" not in os.environ
    assert WORLD.Get_size() == hosts * ppn
    netns = WORLD.allgather(os.stat("/proc/self/ns/net").st_ino)
    host_of = {ino: i for i, ino in enumerate(dict.fromkeys(netns))}  # in rank order: host index
    assert len(host_of) == hosts, f"{len(host_of)} network namespaces among the ranks, expected {hosts}"
    rank = WORLD.Get_rank()
    tc = torus.TorusComm()
    assert (tc.nodes, tc.local_size) == (hosts, ppn)
    assert tc.node == host_of[netns[rank]] == rank // ppn
    assert tc.local_rank == rank % ppn
    tc.Free()


def test_default_grid_follows_the_hosts_and_auto_measures_the_link():
    # the default grid puts one axis along the hosts (rows of PPN ranks); TorusComm measures the link once,
    # every rank gets the same figure, and auto's choice is the multi-node rule's on that figure
    hosts, ppn = (int(v) for v in LAYOUT.split("x"))
    os.environ.pop("TORUS_LINK_GBITS", None)
    tc = torus.TorusComm()
    if ppn > 1:
        assert tc.dims == (ppn, hosts) and tc.topology.node_axis == "row"
    x = np.random.default_rng(tc.rank).standard_normal(1 << 18).astype(np.float32)
    got = tc.allreduce(x, algorithm="auto")
    want = np.empty_like(x)
    WORLD.Allreduce(x, want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    gbits = tc.link_gbits
    assert gbits is not None and gbits > 0
    assert WORLD.allgather(gbits) == [gbits] * WORLD.Get_size()
    across = select.Nodes(hosts, ppn, tc.topology.node_axis, gbits)
    for nbytes in (4, 1 << 16, 1 << 20, 1 << 26):
        assert tc.auto_choice("allreduce", nbytes) == select.across_nodes("allreduce", nbytes, tc.dims, across)
    tc.Free()
    told = torus.TorusComm(link_gbits=3.5)
    assert told.link_gbits == 3.5
    told.Free()
