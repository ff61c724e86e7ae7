"""The speed of the links between nodes, for ``algorithm="auto"`` across nodes: told, or measured once.

Told: ``TorusComm(link_gbits=...)`` or ``TORUS_LINK_GBITS`` (Gbit/s of one node's link, one direction).
Measured: when a TorusComm is made on several real nodes, the leaders (local rank 0) of nodes 0 and 1
exchange ``PROBE_BYTES`` both ways at once, ``PROBE_REPS`` times after one untimed exchange; the fastest
exchange gives the rate, which node 0's leader broadcasts so that every rank chooses alike. It measures what
the collectives get from the link through MPI (TCP and the MPI library's protocol included), not the wire's
nominal rate, and one flow of it. Collective over the TorusComm; about ``(PROBE_REPS + 1) * PROBE_BYTES``
each way at the link's speed, once per TorusComm. Waits poll under the TorusComm's stall timeout
(torus.errors.TimeoutError). A link that passes bursts above its rate reads fast (docs/clusters.md, "The
emulated cluster"); auto only uses the figure for its native threshold (select.NATIVE_LINK_SECONDS), which
such an error moves by the same factor.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from torus import faults, knobs

PROBE_BYTES = 2 << 20
PROBE_REPS = 2


def told(link_gbits: float | None = None) -> float | None:
    """The link speed given by argument or ``TORUS_LINK_GBITS`` (Gbit/s), or None. Raises ValueError when it
    is not a positive number."""
    if link_gbits is None:
        text = knobs.read("TORUS_LINK_GBITS")
        if not text:
            return None
        try:
            link_gbits = float(text)
        except ValueError:
            raise ValueError(f"TORUS_LINK_GBITS={text!r}: expected Gbit/s, a positive number") from None
    if not link_gbits > 0:
        raise ValueError(f"link_gbits {link_gbits!r}: expected Gbit/s, a positive number")
    return float(link_gbits)


def measure(comm: MPI.Comm, rank: int, leaders: tuple, timeout: float | None) -> float:
    """Gbit/s between world ranks ``leaders[0]`` and ``leaders[1]`` of ``comm`` (see the module docstring);
    every rank of ``comm`` calls it and gets the same value."""
    def stall():
        return f"auto on rank {rank}: no progress for {timeout:g} s measuring the link between nodes"

    gbits = np.zeros(1)
    if rank in leaders:
        peer = leaders[1] if rank == leaders[0] else leaders[0]
        out, into = np.ones(PROBE_BYTES, np.uint8), np.empty(PROBE_BYTES, np.uint8)
        best = float("inf")
        for i in range(PROBE_REPS + 1):
            t0 = time.perf_counter()
            reqs = [comm.Irecv(into, peer, 32766), comm.Isend(out, peer, 32766)]
            for req in reqs:
                faults.wait(req, timeout, stall)
            if i:
                best = min(best, time.perf_counter() - t0)
        gbits[0] = PROBE_BYTES * 8 / best / 1e9
    req = comm.Ibcast(gbits, root=leaders[0])
    faults.wait(req, timeout, stall)
    return float(gbits[0])


def for_nodes(comm: MPI.Comm, topology, told: float | None, timeout: float | None) -> float:
    """The link speed ``auto`` uses across real nodes: ``told``, else measured between the leaders of nodes 0
    and 1. Called where every rank is known to take part (TorusComm's constructor): at the first auto call a
    rank that failed its local checks would leave the others waiting in the measurement. Collective."""
    if told is not None:
        return told
    return measure(comm, topology.rank, (0, topology.node_of.index(1)), timeout)
