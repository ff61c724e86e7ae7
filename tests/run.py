#!/usr/bin/env python
"""Runs every suite: tests/ in one process, tests/mpi/ under ``mpiexec -n K`` for each K, then the suites across
emulated hosts (``python -m tests.cluster test``: network namespaces, as root; one 'skipped' line where refused;
``--no-cluster`` leaves them out, and so do test paths).

Usage: python tests/run.py [--ranks 1,2,3,4,5,6] [--skip-single] [-- pytest args...]

Test files or folders among the pytest arguments narrow the run to them: those under tests/mpi run under
mpiexec, the others in one process, and a part with none of them is left out
(``python tests/run.py --ranks 1,2 -- tests/mpi/test_bench.py`` runs that file at 1 and 2 ranks only).

Rank 0 prints pytest's report; other ranks print only failures (tests/conftest.py aborts the whole job on
any failing rank, so nothing deadlocks). Each mpiexec run has a wall-clock limit. The last line is the
total, 'N passed, N failed', and the exit status is non-zero if anything failed or timed out. pytest's exit
5 (nothing collected) counts as an empty pass. Before it come the names of the failed tests, from each suite's
JUnit report, and one line per reason for the skipped tests ('skipped 1200: a 2x3 grid does not fit 4 ranks
(and 5 similar)'), so the tail of the log says what failed and what did not run. The JUnit reports live in a
temporary folder that is removed at the end.

A suite whose process is killed by a signal (SIGSEGV, SIGBUS: a crash, not a failed assertion, which exits 1)
is reported as a crash ('CRASH mpiexec -n 3: killed by SIGSEGV') and fails the run. Only with
``--rerun-crashed`` (or ``TORUS_TESTS_RERUN_CRASHED=1``) is it run once more, whole, and the rerun's result
counts; the crash is still reported. CI (.ci/run) never sets either: a crash is a bug until shown otherwise
(the one seen in CI, a segfault inside TensorFlow 2.21 while Keras dropped a freshly started iterator, was TF's
MultiDeviceIterator freeing itself under its own background thread; TorusStrategy no longer creates one, see
integrations/keras/strategy.py).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
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


CRASH = {-11: "SIGSEGV", 11: "SIGSEGV", 139: "SIGSEGV", -7: "SIGBUS", 7: "SIGBUS", 135: "SIGBUS"}


def _failures(xml_path: Path) -> list[str]:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or "").splitlines()[:1]
            out.append(f"{case.get('classname')}::{case.get('name')}: {msg[0][:160] if msg else ''}")
    return out


def _skips(xml_path: Path) -> list[str]:
    """The reason of every skipped test in the report, one entry per test."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return []
    return [" ".join((skip.get("message") or "no reason given").split()) for case in root.iter("testcase")
            for skip in case.findall("skipped")]


def skip_lines(reasons: list[str]) -> list[str]:
    """One line per reason, most frequent first; reasons that differ only in their numbers are one reason."""
    groups: dict[str, Counter] = {}
    for reason in reasons:
        groups.setdefault(re.sub(r"\d+", "#", reason), Counter())[reason] += 1
    lines = []
    for variants in sorted(groups.values(), key=lambda c: -sum(c.values())):
        example, _ = variants.most_common(1)[0]
        similar = f" (and {len(variants) - 1} similar)" if len(variants) > 1 else ""
        lines.append(f"skipped {sum(variants.values())}: {example}{similar}")
    return lines


def _run(cmd, timeout: int, env) -> int:
    print("+", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=timeout, env=env, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"TIMEOUT after {timeout} s: {' '.join(cmd)}", flush=True)
        return 124


def _cluster_suites(py: str, env: dict, totals: dict, failures: list) -> None:
    """``python -m tests.cluster test``, its closing line added to ``totals`` (its own log goes to stdout)."""
    cmd = [py, "-m", "tests.cluster", "test"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stdout:
        print(line, end="", flush=True)
        last = line.strip() or last
    rc = proc.wait()
    match = re.fullmatch(r"(\d+) passed, (\d+) failed, (\d+) skipped", last)
    if match is None or rc != 0:
        failures.append(f"tests/cluster: exit status {rc}, last line {last!r} (see the log above)")
        totals["failed"] += 1 if match is None else 0
    if match is not None:
        for key, value in zip(("passed", "failed", "skipped"), match.groups()):
            totals[key] += int(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,3,4,5,6", help="comma-separated rank counts for tests/mpi")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per mpiexec run")
    ap.add_argument("--skip-single", action="store_true", help="only the multi-rank suites")
    ap.add_argument("--rerun-crashed", action="store_true",
                    default=os.environ.get("TORUS_TESTS_RERUN_CRASHED") == "1",
                    help="run a suite killed by SIGSEGV/SIGBUS once more and count the rerun (never in CI; "
                    "also TORUS_TESTS_RERUN_CRASHED=1)")
    ap.add_argument("--no-cluster", action="store_true",
                    help="leave out the suites across emulated hosts (tests/cluster; they run after tests/mpi "
                    "when no test paths are given, and skip with one line where network namespaces are refused)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="torus-tests-") as tmp:
        return _all_suites(args, Path(tmp))


# Options of pytest's terminal plugin, which the ranks other than 0 run without (so that one rank reports):
# given to them, pytest stops at its usage message and rank 0 waits for them forever.
_TERMINAL_FLAGS = re.compile(r"-[qv]+|--(quiet|verbose|no-header|no-summary|showlocals)|-l")
_TERMINAL_VALUED = ("--tb", "-r", "--durations", "--durations-min", "--color", "--code-highlight")


def _without_terminal_options(args: list) -> list:
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif _TERMINAL_FLAGS.fullmatch(a):
            continue
        elif a in _TERMINAL_VALUED:
            skip = True
        elif not any(a.startswith(v + "=") or (v == "-r" and a.startswith("-r")) for v in _TERMINAL_VALUED):
            kept.append(a)
    return kept


def _all_suites(args, tmp: Path) -> int:
    py = sys.executable
    mpiexec = shutil.which("mpiexec", path=str(Path(py).parent)) or shutil.which("mpiexec")
    # the flight records that the suites' stall tests dump go to the run's own folder, not the checkout
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TF_CPP_MIN_LOG_LEVEL="2", TORUS_TRACE_DIR=os.environ.get("TORUS_TRACE_DIR", str(tmp / "traces")))
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    crashes: list[str] = []
    skipped: list[str] = []
    status = 0
    paths = [a for a in args.pytest_args if not a.startswith("-") and (ROOT / a.split("::")[0]).exists()]
    options = [a for a in args.pytest_args if a not in paths]
    mpi_paths = [a for a in paths if Path(a).resolve().is_relative_to(ROOT / "tests" / "mpi")]
    single_paths = [a for a in paths if a not in mpi_paths]
    common = ["-p", "no:cacheprovider", *options]

    def suite(name: str, cmd: list, xml: Path, rerun: bool = args.rerun_crashed) -> None:
        nonlocal status
        rc = _run(cmd, args.timeout, env)
        if rc in CRASH:
            crashes.append(f"CRASH {name}: killed by {CRASH[rc]}" + ("; rerun, the rerun's result counts"
                                                                     if rerun else ""))
            print(crashes[-1], flush=True)
            if rerun:
                return suite(name, cmd, xml, rerun=False)
        p, f, s = _counts(xml)
        failures.extend(f"{name}: {line}" for line in _failures(xml))
        skipped.extend(_skips(xml))
        if rc not in (0, 5):
            print(f"{name}: exit status {rc}", flush=True)
            status, f = 1, f or 1
            if not _failures(xml):
                failures.append(f"{name}: exit status {rc} {CRASH.get(rc, '')} (see the log above)".rstrip())
        totals["passed"] += p
        totals["failed"] += f
        totals["skipped"] += s

    t0 = time.time()
    if not args.skip_single and (single_paths or not paths):
        xml = tmp / "single.xml"
        where = single_paths or ["tests", "--ignore=tests/mpi"]
        suite("tests", [py, "-m", "pytest", *where, f"--junitxml={xml}", *common], xml)
    for k in [int(r) for r in args.ranks.split(",") if r and (mpi_paths or not paths)]:
        xml = tmp / f"mpi{k}.xml"
        base = [py, "-m", "pytest", *(mpi_paths or ["tests/mpi"]), "-o", "timeout_method=thread", *common]
        cmd = [mpiexec, "-n", "1", *base, f"--junitxml={xml}"]
        if k > 1:
            cmd += [":", "-n", str(k - 1), *_without_terminal_options(base), "-p", "no:terminal"]
        suite(f"mpiexec -n {k}", cmd, xml)
    if not paths and not args.no_cluster:
        _cluster_suites(py, env, totals, failures)
        status |= 1 if any(line.startswith("tests/cluster") for line in failures) else 0
    for line in skip_lines(skipped):
        print(line)
    for line in failures:
        print("FAILED", line)
    for line in crashes:
        print(line)
    print(f"all suites took {time.time() - t0:.0f} s")
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return status


if __name__ == "__main__":
    sys.exit(main())
