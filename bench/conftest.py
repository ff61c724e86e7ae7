"""pytest set-up for the benchmark suites in bench/ (pytest-benchmark).

Run them explicitly, e.g. ``python -m pytest bench/ --benchmark-columns=median,ops``; pyproject's
``testpaths = ["tests"]`` and tests/run.py (which names tests/ only) never collect them.
"""
from __future__ import annotations

import pytest

import torus.kernels


@pytest.fixture
def num_threads(request):
    """Set ``torus.kernels.set_num_threads(request.param)`` for one benchmark and restore it afterwards;
    use with ``@pytest.mark.parametrize("num_threads", [...], indirect=True)``."""
    before = torus.kernels.get_num_threads()
    torus.kernels.set_num_threads(request.param)
    yield request.param
    torus.kernels.set_num_threads(before)
