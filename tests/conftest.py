"""Shared pytest set-up. Under mpiexec (size > 1) a failing test on any rank aborts the whole job, so the other
ranks never wait forever in a collective the failed rank will not reach; tests/run.py launches the suites."""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest


def _world():
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ \
            and "PMIX_RANK" not in os.environ:
        return None
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def world():
    """``MPI.COMM_WORLD`` (imported lazily so single-process tests never need MPI started)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared(world):
    """One folder for every rank (rank 0's, broadcast: the ranks of one host share it), removed at the end."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(world.bcast(tempfile.mkdtemp(prefix="torus-shared-") if world.rank == 0 else None))
    yield folder
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def rng(request, world):
    """A generator seeded by the test name and the rank: fresh data that differs between ranks."""
    seed = zlib.crc32(request.node.nodeid.encode())  # stable across processes, unlike hash()
    return np.random.default_rng([seed, world.Get_rank()])


def pytest_runtest_logreport(report):
    comm = _world()
    if comm is None or comm.Get_size() == 1 or not report.failed:
        return
    sys.stderr.write(f"\n[rank {comm.Get_rank()}] FAILED {report.nodeid} ({report.when})\n"
                     f"{report.longreprtext}\n[rank {comm.Get_rank()}] aborting the job\n")
    sys.stderr.flush()
    comm.Abort(1)
