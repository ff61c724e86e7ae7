"""What the flight recorder (torus/recorder.py) costs a collective: all-reduce loops of 64 KiB and 16 MiB
(float32, in place, algorithm auto) on two TorusComms of the same ranks, one recording (``TORUS_RECORDER``, 64
where unset) and one not (capacity 0), in alternating blocks so that both see the same machine load.

    mpiexec -n 2 .venv/bin/python bench/flight_recorder/recorder_cost.py --rounds 15

Per size: the median over rounds of each block's time per call, on and off, and their ratio (rank 0 prints;
each block ends with a barrier-free last call, so the ranks stay in step by the collectives themselves).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from torus import IN_PLACE, TorusComm, knobs

SIZES = {"64 KiB": 64 << 10, "16 MiB": 16 << 20}


def block(tc: TorusComm, buf: np.ndarray, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        tc.allreduce(IN_PLACE, buf)
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=0.3, help="about this long per block")
    args = ap.parse_args()
    if not knobs.read("TORUS_RECORDER"):  # off by default: record the default capacity a user would turn on
        knobs.override("TORUS_RECORDER", "64")
    on, off = TorusComm(), TorusComm()
    off.recorder.capacity = 0
    rank = on.rank
    if rank == 0:
        print(f"# mpiexec -n {on.size} bench/flight_recorder/recorder_cost.py --rounds {args.rounds}; recorder "
              f"capacity {on.recorder.capacity} against 0, {time.strftime('%Y-%m-%d %H:%M')}")
    for name, nbytes in SIZES.items():
        buf = np.ones(nbytes // 4, np.float32)
        per_call = block(on, buf, 20)  # warm-up: windows, buffers, auto's choice
        block(off, buf, 20)
        calls = int(MPI.COMM_WORLD.bcast(max(10, min(20000, args.seconds / per_call))))
        times: dict = {"on": [], "off": []}
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for which in order:
                times[which].append(block(on if which == "on" else off, buf, calls))
        if rank == 0:
            t_on, t_off = statistics.median(times["on"]), statistics.median(times["off"])
            ratios = [a / b for a, b in zip(times["on"], times["off"])]
            print(f"{name:>7}: {calls} calls a block, {args.rounds} rounds; per call on {t_on * 1e6:9.1f} us, "
                  f"off {t_off * 1e6:9.1f} us; on/off median of medians {t_on / t_off:.4f}, per-round ratios "
                  f"median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
