"""Worker of tests/cluster/faults.py (run under mpiexec on a cluster): all-reduces in a loop until killed."""
import sys
import time

import numpy as np

import torus
from torus import faults

faults.abort_on_exception()
tc = torus.TorusComm()
x = np.ones(1 << 18, np.float32)
for i in range(100000):
    tc.allreduce(x, algorithm="ring")
    if i == 3:
        print(f"rank {tc.rank} ready", flush=True)
    time.sleep(0.01)
