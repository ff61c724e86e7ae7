"""The job of tests/cluster/cluster_supervise.py, run by torus-run across emulated hosts: all-reduces in a loop
with torus.faults.abort_on_exception installed, as a training loop would.

Prints ``launch L rank R of N on NAMESPACE`` at start and ``launch L rank R ready`` after a few calls. In the
first launch (TORUS_RESTART=0) it runs until something ends it; in a relaunch it checks 20 all-reduces of
``rank + 1`` against N(N+1)/2, prints ``launch L rank R sum ok`` and ends."""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np

import torus
from torus import faults


def main() -> None:
    faults.abort_on_exception()
    tc = torus.TorusComm()
    launch = int(os.environ["TORUS_RESTART"])
    where = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True,
                           check=False).stdout.strip() or "?"
    print(f"launch {launch} rank {tc.rank} of {tc.size} on {where}", flush=True)
    x = np.empty(1 << 16, np.float32)  # 256 KiB: one segment per step across the host links
    for i in range(1_000_000):
        x.fill(tc.rank + 1)
        tc.allreduce(torus.IN_PLACE, x, algorithm="ring")
        if i == 3:
            print(f"launch {launch} rank {tc.rank} ready", flush=True)
        if launch > 0 and i == 19:
            expected = tc.size * (tc.size + 1) / 2
            assert np.all(x == expected), f"rank {tc.rank}: {x[:4]} != {expected}"
            print(f"launch {launch} rank {tc.rank} sum ok", flush=True)
            return
        time.sleep(0.005)


if __name__ == "__main__":
    main()
