"""The job of tests/cluster/cluster_faults.py (under mpiexec on a cluster): all-reduces in a loop, as a training
loop would, with torus.faults.abort_on_exception installed; prints 'rank R ready' after a few calls.

``python fault_worker.py loop``: runs until something ends it. ``stuck R``: rank R, once ready, sleeps inside
its next all-reduce (in the wait for its first message), as a rank stuck in a collective does."""
from __future__ import annotations

import sys
import time

import numpy as np

import torus
from torus import faults


def main(mode: str, stuck_rank: int) -> None:
    faults.abort_on_exception()
    tc = torus.TorusComm()
    x = np.ones(1 << 18, np.float32)  # 1 MiB: several segments per step, across the host links
    for i in range(1_000_000):
        tc.allreduce(x, algorithm="ring")
        if i == 3:
            print(f"rank {tc.rank} ready", flush=True)
            if mode == "stuck" and tc.rank == stuck_rank:
                faults.wait = lambda *args: time.sleep(3600)
        time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1)
