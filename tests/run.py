#!/usr/bin/env python
"""Runs every suite: tests/ in one process, then tests/mpi/ under ``mpiexec -n K`` for each K.

Usage: python tests/run.py [--ranks 1,2,3,4,5,6] [--skip-single] [pytest args...]

Rank 0 prints pytest's report; other ranks print only failures (tests/conftest.py aborts the whole job on
any failing rank, so nothing deadlocks). Each mpiexec run has a wall-clock limit. The last line is the
total, 'N passed, N failed', and the exit status is non-zero if anything failed or timed out. pytest's exit
5 (nothing collected) counts as an empty pass.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _counts(xml_path: Path) -> tuple[int, int, int]:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):  # the job was aborted before pytest wrote its report
        return 0, 0, 0
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests - bad - skipped, bad, skipped


def _run(cmd, timeout: int, env) -> int:
    print("+", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        print(f"TIMEOUT after {timeout} s: {' '.join(cmd)}", flush=True)
        return 124


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,3,4,5,6", help="comma-separated rank counts for tests/mpi")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per mpiexec run")
    ap.add_argument("--skip-single", action="store_true", help="only the multi-rank suites")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    py = sys.executable
    mpiexec = shutil.which("mpiexec", path=str(Path(py).parent)) or shutil.which("mpiexec")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TF_CPP_MIN_LOG_LEVEL="2")
    tmp = Path(tempfile.mkdtemp(prefix="torus-tests-"))
    passed = failed = skipped = 0
    status = 0
    common = ["-p", "no:cacheprovider", *args.pytest_args]
    t0 = time.time()
    if not args.skip_single:
        xml = tmp / "single.xml"
        rc = _run([py, "-m", "pytest", "tests", "--ignore=tests/mpi", f"--junitxml={xml}", *common],
                  args.timeout, env)
        p, f, s = _counts(xml)
        passed, failed, skipped = passed + p, failed + f, skipped + s
        if rc not in (0, 5):
            status, failed = 1, failed or 1
    for k in [int(r) for r in args.ranks.split(",") if r]:
        xml = tmp / f"mpi{k}.xml"
        base = [py, "-m", "pytest", "tests/mpi", "-o", "timeout_method=thread", *common]
        cmd = [mpiexec, "-n", "1", *base, f"--junitxml={xml}"]
        if k > 1:
            cmd += [":", "-n", str(k - 1), *base, "-p", "no:terminal"]
        rc = _run(cmd, args.timeout, env)
        p, f, s = _counts(xml)
        passed, failed, skipped = passed + p, failed + f, skipped + s
        if rc not in (0, 5):
            print(f"mpiexec -n {k}: exit status {rc}", flush=True)
            status, failed = 1, failed or 1
    print(f"all suites took {time.time() - t0:.0f} s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main())
