"""The step interpreter with device memory (``torus/runtime/memory.py``, ``TorusComm(gpu_reduce=True)``)
gives the bits of the host policy for random plans whose regions are sent, reduced or scaled on the device,
and sent again: the staging marks ``Executor.compile`` puts on each send (which regions changed on the device
since they were last copied to the host mirror) are what this checks; the real schedules' patterns rarely
send a region twice, so tests/mpi/test_device.py alone would not notice a missing mark.

Device arrays are numba's CUDA simulator's (turned on here unless numba.cuda was imported already), plans
talk to rank 0 of ``MPI.COMM_SELF`` as in test_executor_out_of_place.py.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

_set_here = "numba.cuda" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ
if _set_here:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
from numba import cuda  # noqa: E402

if _set_here:
    del os.environ["NUMBA_ENABLE_CUDASIM"]
if not cuda.to_device.__module__.startswith("numba.cuda.simulator") and not cuda.is_available():
    pytest.skip("numba.cuda was imported for real hardware and there is no GPU", allow_module_level=True)

from test_executor_out_of_place import _random_plan  # noqa: E402
from torus.runtime.executor import Executor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("seed", range(30))
def test_staged_equals_host(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 48))
    ex = Executor({"world": MPI.COMM_SELF}, 0, int(rng.integers(1, 6)) * 4, 10.0)
    plan = ex.compile(_random_plan(rng, count, int(rng.integers(2, 10))), 4, count)
    x = rng.integers(-50, 50, count).astype(np.float32)
    host = x.copy()
    ex.run("test", plan, host, "sum", 0.5)
    dev = cuda.to_device(x)
    ex.run_device("test", plan, dev, "sum", 0.5)
    np.testing.assert_array_equal(dev.copy_to_host().view(np.uint32), host.view(np.uint32))
