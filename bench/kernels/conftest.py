"""pytest set-up for the benchmark suite in bench/kernels/ (pytest-benchmark).

Run it explicitly, e.g. ``python -m pytest bench/kernels/ --benchmark-columns=median,ops``; pyproject's
``testpaths = ["tests"]`` and tests/run.py (which names tests/ only) never collect it.

A benchmark that sets ``benchmark.extra_info["bytes"]`` (memory traffic of one call) also gets a line in a
throughput table printed at the end: GB/s = bytes / median seconds, per group, with the ratio to the
group's numpy entry.
"""
from __future__ import annotations

from collections import defaultdict

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


def _label(bench) -> str:
    """'torus 2t', 'numpy', 'numpy copyto': the implementation half of a test name, plus its variant."""
    impl = bench.name.split("[")[0].rsplit("_", 1)[-1]
    params = bench.params or {}
    if "num_threads" in params:
        return f"{impl} {params['num_threads']}t"
    return f"{impl} {params['how']}" if "how" in params else impl


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)  # pytest-benchmark's, absent with -p no:benchmark
    groups = defaultdict(dict)
    for bench in getattr(session, "benchmarks", []):
        if bench and "bytes" in bench.extra_info:
            groups[bench.group][_label(bench)] = bench.extra_info["bytes"] / bench.stats.median / 1e9
    if not groups:
        return
    terminalreporter.section("throughput: GB/s = bytes moved per call / median time (x = ratio to numpy)")
    for group, rates in groups.items():
        base = rates.get("numpy", rates.get("numpy astype"))
        cells = [f"{label} {gbps:.2f}" + (f" (x{gbps / base:.2f})" if base and label.startswith("torus") else "")
                 for label, gbps in sorted(rates.items())]
        terminalreporter.write_line(f"{group:32s} " + ", ".join(cells))
