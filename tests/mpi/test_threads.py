"""TorusComm's ``threads="auto"``: the host kernels' OpenMP threads are the machine's CPUs divided by the ranks
that share them, nodes emulated on one machine (``ranks_per_node``, network-namespace hosts) included.

Oracle: every rank of these runs is on one machine (mpiexec here, or tests/cluster's emulated hosts), so the
ranks sharing a machine's CPUs are all of them; skipped where the host names say otherwise.
"""
from __future__ import annotations

import os
import socket

import pytest

import torus
from oracle import SIZE, WORLD
from torus import kernels

pytestmark = pytest.mark.skipif(len(set(WORLD.allgather(socket.gethostname()))) > 1,
                                reason="the ranks span several machines")


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.delenv("TORUS_NUM_THREADS", raising=False)
    before = kernels.get_num_threads()
    yield
    kernels.set_num_threads(before)


@pytest.mark.parametrize("ranks_per_node", [None, 1])
def test_auto_threads_divide_the_machine_cpus(ranks_per_node):
    """One thread per CPU of the machine, split over all its ranks, whatever the node layout: with
    ``ranks_per_node=1`` every rank is a node of its own, and each used to take every CPU (SIZE x
    oversubscribed; across emulated hosts such per-rank threads slowed the 16-bit all-reduce, bench/wire/README.md)."""
    kernels.set_num_threads(64)
    tc = torus.TorusComm(ranks_per_node=ranks_per_node)
    assert kernels.get_num_threads() == max(1, (os.cpu_count() or 1) // SIZE), tc
    tc.Free()


def test_threads_given_or_left_alone():
    tc = torus.TorusComm(threads=3)
    assert kernels.get_num_threads() == 3
    tc.Free()
    kernels.set_num_threads(5)
    tc = torus.TorusComm(threads=None)
    assert kernels.get_num_threads() == 5
    tc.Free()
