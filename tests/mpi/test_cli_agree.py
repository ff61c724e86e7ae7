"""torus.cli.agree: a failure on some ranks becomes one line, the same on every rank, naming exactly the
failing ranks and each distinct error once; success returns each rank's own result."""
from __future__ import annotations

import pytest

from torus.cli import JobError, agree


def test_success_returns_own_result(world):
    assert agree(world, "step", lambda: world.Get_rank() * 10) == world.Get_rank() * 10


def test_failure_on_some_ranks_names_them(world):
    size = world.Get_size()
    failing = set(range(0, size, 2))  # 0, 2, 4: rank 0 always fails, rank 1 never does

    def step():
        if world.Get_rank() in failing:
            raise ValueError(f"bad input on rank {world.Get_rank()}")
        return "ok"
    with pytest.raises(JobError) as info:
        agree(world, "reading", step)
    line = str(info.value)
    assert "\n" not in line
    assert line == world.bcast(line, root=0)  # every rank holds the same text
    names = ", ".join(map(str, sorted(failing)))
    who = "every rank" if size > 1 and len(failing) == size else f"rank{'s' if len(failing) > 1 else ''} {names}"
    assert line == f"reading failed on {who}: ValueError: bad input on rank N"


def test_distinct_errors_are_each_listed(world):
    rank, size = world.Get_rank(), world.Get_size()

    def step():
        raise OSError(f"file-{rank % 2}.jpg unreadable")
    with pytest.raises(JobError) as info:
        agree(world, "reading", step)
    line = str(info.value)
    for r in range(min(size, 2)):
        assert f"file-{r}.jpg unreadable" in line
    assert line.count("unreadable") == min(size, 2)
