"""The rank program of tests/cluster/cluster_slurm.py, under ``srun`` or hydra inside an allocation:
``python slurm_worker.py OUT``.

Writes ``OUT/rank<R>.json`` (a file, not stdout: hydra can join two ranks' lines into one) with its MPI rank
and world size, what Slurm told it (``SLURM_PROCID``, ``SLURM_NODEID``, ``SLURMD_NODENAME``), its host name
and network namespace (the inode of /proc/self/ns/net), and what TorusComm made of the nodes. Then all-reduces
``rank_data(rank)`` and writes the result to ``OUT/rank<R>.npy``; the test checks it against numpy.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

import torus

COUNT = 100_003  # odd: the ring's and torus2d's uneven chunks


def rank_data(rank: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(COUNT).astype(np.float32)


def main(out: str) -> None:
    world = MPI.COMM_WORLD
    tc = torus.TorusComm()
    row = json.dumps({
        "rank": world.Get_rank(), "size": world.Get_size(), "procid": os.environ.get("SLURM_PROCID"),
        "nodeid": os.environ.get("SLURM_NODEID"), "slurmd_node": os.environ.get("SLURMD_NODENAME"),
        "host": socket.gethostname(), "netns": os.stat("/proc/self/ns/net").st_ino,
        "nodes": tc.nodes, "node": tc.node, "local_rank": tc.local_rank, "local_size": tc.local_size})
    with open(os.path.join(out, f"rank{tc.rank}.json"), "w") as f:
        f.write(row)
    result = tc.allreduce(rank_data(tc.rank), algorithm="auto")
    np.save(os.path.join(out, f"rank{tc.rank}.npy"), result)
    tc.Free()


if __name__ == "__main__":
    main(sys.argv[1])
