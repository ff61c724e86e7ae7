#!/usr/bin/env python
"""Traffic patterns between hosts, side by side: is a link full duplex, and does a host pair exchanging both ways
cost more than a ring's one direction per pair?

    python -m tests.cluster up 4 --rate 4gbit
    python -m tests.cluster run -- -n 4 python bench/across_hosts/link_patterns.py --nbytes 16M --json out.jsonl

One rank per host. Patterns, each ``MPI_Isend``/``MPI_Irecv`` of ``--nbytes`` per flow (what a plan's step posts),
alternated in rounds; idle ranks wait asleep in a non-blocking barrier (a spinning wait takes the CPU the
others' TCP needs on shared cores):

- ``one-way``: rank 0 sends to rank 1, nothing else;
- ``exchange``: ranks 0 and 1 send to each other (both directions of one host pair);
- ``pairs``: 0 <-> 1 and 2 <-> 3 at once (the pairwise exchanges of a recursive-halving or Swing step);
- ``ring``: every rank sends to the next and receives from the previous (one direction per host pair);
- ``ring-both``: a ring in both directions at once (every host sends two flows, receives two).

``--segment S`` posts each flow as ``nbytes / S`` messages at once (a plan's pipelined segments). Prints per
pattern the median time over ``--rounds`` and the rate per flow (GB/s, nbytes / time); rank 0
appends one JSON line to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from torus.bench.sweep import parse_size


def flows(pattern: str, size: int) -> list[tuple[int, int]]:
    """(source, destination) rank pairs of ``pattern`` among ``size`` ranks."""
    if pattern == "one-way":
        return [(0, 1)]
    if pattern == "exchange":
        return [(0, 1), (1, 0)]
    if pattern == "pairs":
        return [(r, r ^ 1) for r in range(size - size % 2)]
    if pattern == "ring":
        return [(r, (r + 1) % size) for r in range(size)]
    if pattern == "ring-both":  # at 2 ranks both directions are the same flow: the exchange
        return list(dict.fromkeys((r, (r + d) % size) for r in range(size) for d in (1, size - 1)))
    raise ValueError(f"unknown pattern {pattern!r}")


def sleep_wait(requests) -> None:
    while not MPI.Request.Testall(requests):
        time.sleep(50e-6)


def run(comm, pattern: str, send: np.ndarray, recv: dict, segment: int) -> float:
    rank = comm.Get_rank()
    mine = flows(pattern, comm.Get_size())
    cuts = range(0, send.size, segment)
    sleep_wait([comm.Ibarrier()])
    t0 = time.perf_counter()
    requests = [comm.Irecv(recv[src][lo:lo + segment], source=src, tag=7) for src, dst in mine if dst == rank
                for lo in cuts]
    requests += [comm.Isend(send[lo:lo + segment], dest=dst, tag=7) for src, dst in mine if src == rank
                 for lo in cuts]
    sleep_wait(requests)
    elapsed = time.perf_counter() - t0
    times = comm.allgather(elapsed if requests else 0.0)
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", default="16M")
    ap.add_argument("--segment", default="0", help="post each flow as messages of this size at once (0: one)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--patterns", default="one-way,exchange,pairs,ring,ring-both")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise SystemExit("link_patterns: needs at least 2 ranks (one per host)")
    nbytes = parse_size(args.nbytes)
    segment = parse_size(args.segment) or nbytes
    send = np.ones(nbytes, np.uint8)
    recv = {r: np.empty(nbytes, np.uint8) for r in range(comm.Get_size())}
    patterns = args.patterns.split(",")
    times: dict = {p: [] for p in patterns}
    for p in patterns:  # warm-up: connections, pages
        run(comm, p, send, recv, segment)
    for _ in range(args.rounds):
        for p in patterns:
            times[p].append(run(comm, p, send, recv, segment))
    result = {"nbytes": nbytes, "segment": segment, "env": {k: v for k, v in os.environ.items()
                                                            if k.startswith(("UCX_", "MPIR_CVAR_"))},
              "ranks": comm.Get_size(), "rounds": args.rounds,
              "load_avg_1min": os.getloadavg()[0],
              "patterns": {p: {"median_s": float(np.median(t)), "gbytes_per_s_per_flow": nbytes / np.median(t) / 1e9,
                               "all_s": t} for p, t in times.items()}}
    if comm.Get_rank() == 0:
        for p, r in result["patterns"].items():
            print(f"{p:10s} {r['median_s'] * 1e3:8.1f} ms  {r['gbytes_per_s_per_flow']:.3f} GB/s per flow")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
