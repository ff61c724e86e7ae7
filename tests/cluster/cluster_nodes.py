"""Run across hosts by tests/cluster/suites.py (under mpiexec): TorusComm finds the hosts as its nodes.

The oracle is independent of MPI: each rank's network namespace (the inode of /proc/self/ns/net) says which
emulated host it runs on, and the launcher was told HOSTS hosts of PPN consecutive ranks each
(TORUS_CLUSTER_LAYOUT=HOSTSxPPN).
"""
from __future__ import annotations

import os

import pytest
from mpi4py import MPI

import torus

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
