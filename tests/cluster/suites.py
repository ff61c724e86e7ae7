"""The cluster suites: the emulated cluster itself and torus-run across it (on clusters of their own), the
collective suites of tests/mpi (and the gradient buckets of overlap) run across emulated hosts, node detection,
faults across hosts and torus-train with --resume across hosts (``python -m tests.cluster test``; ``--quick``:
the cluster, torus-run, node detection and faults only; ``--only hydra`` or ``--only slurm`` selects). The Slurm
suites (tests/cluster/slurm.py's cluster, 2 nodes x 2 ranks, name torussl, 10.231.31.0/24): the collective
suites and node detection under ``srun --mpi=pmi2``, then tests/cluster/cluster_slurm.py; one 'skipped' where
Slurm or munge is not installed.

Layouts: 2 hosts x 2 ranks (links shaped to 2 Gbit/s with tc tbf; rows of torus2d-2x2 inside hosts, columns
across them, 1xN and Nx1 grids across them; hierarchical-nodes on the real nodes; then the same hosts with
the ranks dealt out round robin, tests/cluster/cluster_round_robin.py), then 3 hosts x 1 rank
(unshaped; every step crosses a host link). Every job runs with TORUS_RANKS_PER_NODE unset, so nodes come from
COMM_TYPE_SHARED, that is from the hosts. The faults and training run on the 2-host cluster, from this process.

The collective suites of a layout run as one ``mpiexec`` (rank 0 writes the JUnit report, as tests/run.py
does); the faults and training as one pytest process each; each with a wall-clock limit. The last line is
'N passed, N failed, N skipped'; exit status non-zero if anything failed. Where namespaces cannot be made
(not root, no CAP_NET_ADMIN) it prints why and counts one skipped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.cluster import Cluster, child_env, slurm_step, unavailable
from tests.cluster.slurm import SlurmCluster, slurm_unavailable

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NAME, SUBNET = "torust", 14
MPI_SUITES = ["tests/cluster/cluster_nodes.py", "tests/mpi/test_allreduce.py", "tests/mpi/test_reduce_scatter.py",
              "tests/mpi/test_allgather.py", "tests/mpi/test_properties.py", "tests/mpi/test_threads.py",
              "tests/mpi/test_overlap_stress.py", "tests/mpi/test_keras_overlap.py"]
ROUND_ROBIN_SUITE = "tests/cluster/cluster_round_robin.py"
LAYOUTS = [(2, 2, "2gbit"), (3, 1, None)]
LIMIT_S = 900
SELECTABLE = ("hydra", "slurm")  # test --only: the hydra-launched suites, the Slurm ones (cluster_slurm.py)
SLURM_NAME, SLURM_SUBNET = "torussl", 31
SLURM_MPI_SUITES = ["tests/cluster/cluster_nodes.py", "tests/mpi/test_allreduce.py", "tests/mpi/test_reduce_scatter.py",
                    "tests/mpi/test_allgather.py"]
SLURM_SUITE = "tests/cluster/cluster_slurm.py"


def _counts(xml: Path) -> dict[str, list]:
    """``{test file: [passed, failed, skipped, failed test names]}`` from a JUnit report; {} when there is
    none (the job was aborted before pytest wrote it)."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    files: dict[str, list] = {}
    for case in root.iter("testcase"):
        name = (case.get("classname") or "").rsplit(".", 1)[-1]
        row = files.setdefault(name, [0, 0, 0, []])
        if case.find("failure") is not None or case.find("error") is not None:
            row[1] += 1
            row[3].append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            row[2] += 1
        else:
            row[0] += 1
    return files


class Tally:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.failures: list[str] = []

    def run(self, label: str, cmd: list[str], xml: Path, env: dict, srun_step: bool = False) -> None:
        """``srun_step``: a Slurm job step, started again once after a pmi2 misread (tests/cluster/slurm_step.py);
        its output is shown when it ends."""
        print(f"+ [{label}] {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        if srun_step:
            status, out, err = slurm_step.run(cmd, env, ROOT, LIMIT_S)
            print(out + err, end="", flush=True)
            rc = 124 if status is None else status
            if status is None:
                print(f"TIMEOUT after {LIMIT_S} s", flush=True)
        else:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=LIMIT_S, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                print(f"TIMEOUT after {LIMIT_S} s", flush=True)
        files = _counts(xml)
        if rc not in (0, 5) and not any(row[1] for row in files.values()):
            files["(job)"] = [0, 1, 0, [f"exit status {rc} (see the log above)"]]
        for name, (p, f, s, names) in files.items():
            print(f"[{label}] {name}: {p} passed, {f} failed, {s} skipped", flush=True)
            self.passed, self.failed, self.skipped = self.passed + p, self.failed + f, self.skipped + s
            self.failures += [f"[{label}] {n}" for n in names]
        print(f"[{label}] took {time.monotonic() - t0:.0f} s", flush=True)


def main(quick: bool = False, only: list[str] | None = None) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="torus-cluster-"))
    try:
        return _main(quick, tmp, set(only or SELECTABLE))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _main(quick: bool, tmp: Path, only: set[str]) -> int:
    why = unavailable()
    if why:
        print(f"cluster suites skipped: {why}")
        print("0 passed, 0 failed, 1 skipped")
        return 0
    tally = Tally()
    py = sys.executable
    common = ["-m", "pytest", "-p", "no:cacheprovider", "-o", "timeout_method=thread"]
    t0 = time.monotonic()
    if "hydra" in only:
        _hydra(quick, tmp, tally, py, common)
    if "slurm" in only:
        _slurm(tmp, tally, py, common)
    for line in tally.failures:
        print("FAILED", line)
    print(f"cluster suites took {time.monotonic() - t0:.0f} s")
    print(f"{tally.passed} passed, {tally.failed} failed, {tally.skipped} skipped")
    return 1 if tally.failed else 0


def _slurm(tmp: Path, tally: Tally, py: str, common: list[str]) -> None:
    """The collective suites and node detection under ``srun --mpi=pmi2`` (2 nodes x 2 ranks), then
    tests/cluster/cluster_slurm.py; one 'skipped' where Slurm or munge is not installed."""
    why = slurm_unavailable()
    if why:
        print(f"slurm suites skipped: {why}")
        tally.skipped += 1
        return
    with SlurmCluster(2, None, SLURM_NAME, SLURM_SUBNET) as cluster:
        env = cluster.job_env(TORUS_CLUSTER=SLURM_NAME, TORUS_CLUSTER_LAYOUT="2x2")
        xml = tmp / "slurm-2x2.xml"
        # srun starts one command line on every task: task 0 writes the report (tests/run.py's rule)
        report = (f'if [ "$SLURM_PROCID" = 0 ]; then exec "$@" --junitxml={xml}; '
                  'else exec "$@" -p no:terminal; fi')
        cmd = cluster.command("srun", "--mpi=pmi2", "--nodes=2", "--ntasks=4", "--distribution=block",
                              "--kill-on-bad-exit=1", "sh", "-c", report, "sh", py, *common, *SLURM_MPI_SUITES)
        tally.run("slurm 2x2 collectives", cmd, xml, env, srun_step=True)
        xml = tmp / "slurm.xml"
        tally.run("slurm 2x2", [py, *common, "-s", SLURM_SUITE, f"--junitxml={xml}"], xml, env)


def _hydra(quick: bool, tmp: Path, tally: Tally, py: str, common: list[str]) -> None:
    xml = tmp / "unit.xml"
    tally.run("cluster", [py, *common, "tests/cluster/cluster_unit.py", "tests/cluster/cluster_supervise.py",
                          f"--junitxml={xml}"], xml, child_env())
    for hosts, ppn, rate in LAYOUTS:
        layout = f"{hosts}x{ppn}"
        with Cluster(hosts, rate, NAME, SUBNET) as cluster:
            env = child_env(TORUS_CLUSTER=NAME)
            base = [py, *common, *(MPI_SUITES[:1] if quick else MPI_SUITES)]
            xml = tmp / f"{layout}.xml"
            # one job per layout (start-up and imports once); rank 0 reports, as in tests/run.py
            cmd = cluster.mpiexec(ppn) + ["-genv", "TORUS_CLUSTER_LAYOUT", layout,
                                          "-n", "1", *base, f"--junitxml={xml}",
                                          ":", "-n", str(hosts * ppn - 1), *base, "-p", "no:terminal"]
            tally.run(f"{layout} collectives", cmd, xml, env)
            if ppn > 1:  # the same hosts with the ranks dealt out round robin (hydra -hosts h1,h2)
                rr = [py, *common, ROUND_ROBIN_SUITE]
                xml = tmp / f"{layout}-round-robin.xml"
                cmd = cluster.mpiexec(ppn, round_robin=True) + [
                    "-genv", "TORUS_CLUSTER_LAYOUT", layout, "-n", "1", *rr, f"--junitxml={xml}",
                    ":", "-n", str(hosts * ppn - 1), *rr, "-p", "no:terminal"]
                tally.run(f"{layout} round robin", cmd, xml, env)
            if hosts == 2:
                local = ["tests/cluster/cluster_faults.py"] + ([] if quick else ["tests/cluster/cluster_train.py"])
                for suite in local:
                    xml = tmp / f"{layout}-{Path(suite).stem}.xml"
                    tally.run(f"{layout} {Path(suite).stem}", [py, *common, "-s", suite, f"--junitxml={xml}"],
                              xml, env)


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main("--quick" in sys.argv, [a for a in SELECTABLE if a in sys.argv[1:]] or None))
