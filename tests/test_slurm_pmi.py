"""A PMI mismatch under Slurm (issue 43): ``srun -n 4`` whose MPI does not connect to Slurm's PMI starts four
worlds of one rank each (Open MPI 5 under ``--mpi=pmi2``, ompi#13523); each would train alone. ``TorusComm``
refuses at once, in one line that names the task count and the fix, before any communication. Stood in for
here by Slurm's step variables in this one-rank process (no Slurm needed).
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

import torus

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="a world of one rank stands in")


def test_srun_tasks_that_mpi_sees_as_worlds_of_one_are_refused(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    with pytest.raises(RuntimeError) as info:
        torus.TorusComm()
    message = str(info.value)
    assert message.startswith("TorusComm: srun started 4 tasks, but MPI sees a world of 1 rank in task 2: ")
    assert "mpiexec -n 4" in message and "srun --mpi=list" in message and "\n" not in message


@pytest.mark.parametrize("tasks", ["1", "", "x"])
def test_one_task_or_no_slurm_step_is_fine(monkeypatch, tasks):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", tasks)
    tc = torus.TorusComm()
    assert tc.size == 1
    tc.Free()
