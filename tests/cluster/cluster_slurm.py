"""torus launched by Slurm on an emulated Slurm cluster (run by tests/cluster/suites.py, TORUS_CLUSTER=name of a
running :class:`tests.cluster.slurm.SlurmCluster`, 2 nodes; SLURM_CONF set).

- ``srun --mpi=pmi2``: one world of 4 ranks, rank = SLURM_PROCID, 2 per node in blocks; each rank's host name
  and network namespace (compared with /run/netns/<node>, not with anything MPI says) match the node Slurm
  names, TorusComm sees 2 nodes x 2 ranks, and the all-reduce equals numpy's sum of every rank's data.
- hydra inside an allocation (``salloc`` + ``mpiexec -launcher slurm``): the same.
- ``srun --mpi=none``: every task is a world of one, and TorusComm refuses in every task with its one line
  (options.launched_alone), the line that docs/clusters.md quotes.
- ``torus-train --epochs 1`` (tiny-nobn, which trains the same at any rank count) under ``srun --mpi=pmi2``, and
  the two sbatch scripts of docs/clusters.md (srun; torus-run) run as written: the same loss and accuracy as one
  process here.
- ``torus-run`` inside ``salloc --no-kill`` (tests/cluster/supervise_worker.py): a rank killed (SIGKILL) is
  relaunched on the same nodes; with node 2's link cut, Slurm marks it down, the probe fails there and the
  relaunch runs 2 ranks on node 1 (torus-run passes srun ``--overlap``: see the test). Each relaunch
  all-reduces correctly.

Budget: four TensorFlow jobs of 4 ranks and one of 1 (their start-up dominates), and four short MPI jobs.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.cluster import from_state, slurm_step
from tests.cluster.slurm import SlurmCluster
from tests.cluster.slurm_worker import rank_data

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DOCS = ROOT / "docs" / "clusters.md"
LIMIT_S = 300
TRAIN = ["--model", "tiny-nobn", "--image-size", "8", "--epochs", "1", "--batch-schedule", "0:64", "--threads", "1",
         "--verbose", "0"]


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    name = os.environ.get("TORUS_CLUSTER")
    if not name:
        pytest.skip("needs a running Slurm cluster (python -m tests.cluster test)")
    found = from_state(name)
    if not isinstance(found, SlurmCluster):
        pytest.skip(f"cluster {name} runs no Slurm")
    return found


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory) -> dict:
    # torus-train and torus-run on PATH, as in an activated environment; the digits cached once for every job
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    if not Path(sys.executable).with_name("torus-run").exists():  # an environment installed before torus-run was
        shims = tmp_path_factory.mktemp("bin")
        (shims / "torus-run").write_text(f'#!/bin/sh\nexec {sys.executable} -m torus.supervise.cli "$@"\n')
        (shims / "torus-run").chmod(0o755)
        path.insert(0, str(shims))
    return cluster.job_env(PATH=os.pathsep.join(path), TORUS_CACHE=str(tmp_path_factory.mktemp("cache")),
                           TORUS_TIMEOUT="60")


def _run(cmd: list[str], env: dict, cwd: Path = ROOT, limit_s: float = LIMIT_S) -> subprocess.CompletedProcess:
    status, out, err = slurm_step.run(cmd, env, cwd, limit_s)  # again once after a pmi2 misread (its docstring)
    if status is None:
        pytest.fail(f"{' '.join(cmd[:6])} ... still ran after {limit_s} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, status, out, err)


def _check_world(cluster: SlurmCluster, done: subprocess.CompletedProcess, out: Path) -> list[dict]:
    """4 ranks, 2 per node in blocks, each where Slurm says, nodes seen by TorusComm; all-reduce vs numpy."""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = sorted((json.loads(path.read_text()) for path in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], done.stdout
    netns = {cluster.node(h): os.stat(f"/run/netns/{cluster.namespace(h)}").st_ino for h in (1, 2)}
    for r in rows:
        node = cluster.node(r["rank"] // 2 + 1)
        assert r["size"] == 4
        assert (r["host"], r["netns"]) == (node, netns[node]), r
        assert (r["nodes"], r["node"], r["local_rank"], r["local_size"]) == (2, r["rank"] // 2, r["rank"] % 2, 2), r
    want = np.sum([rank_data(r).astype(np.float64) for r in range(4)], axis=0)
    for r in range(4):
        np.testing.assert_allclose(np.load(out / f"rank{r}.npy"), want, rtol=1e-5, atol=1e-5)
    return rows


def test_srun_pmi2_is_one_world_of_two_nodes(cluster, env, tmp_path):
    done = _run(cluster.command("srun", "--mpi=pmi2", "--nodes=2", "--ntasks=4", "--distribution=block",
                                sys.executable, str(HERE / "slurm_worker.py"), str(tmp_path)), env)
    rows = _check_world(cluster, done, tmp_path)
    for r in rows:  # Slurm's own view agrees: task = MPI rank, on the node it names
        assert (r["procid"], r["nodeid"], r["slurmd_node"]) == (str(r["rank"]), str(r["rank"] // 2), r["host"])


def test_mpiexec_inside_salloc_is_one_world_of_two_nodes(cluster, env, tmp_path):
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    # -iface: the proxies call back to this host by the bridge's address, not by its host name
    done = _run(cluster.command("salloc", "--nodes=2", "--ntasks=4", mpiexec, "-launcher", "slurm", "-iface",
                                cluster.bridge, "-n", "4", sys.executable, str(HERE / "slurm_worker.py"),
                                str(tmp_path)), env)
    _check_world(cluster, done, tmp_path)


def test_srun_without_pmi_is_refused_in_one_line(cluster, env):
    done = _run(cluster.command("srun", "--mpi=none", "--nodes=2", "--ntasks=4", sys.executable, "-c",
                                "import torus; torus.TorusComm()"), env)
    assert done.returncode != 0
    # found anywhere in the text: a launcher may join two tasks' lines into one
    tasks = sorted(int(t) for t in re.findall(r"RuntimeError: TorusComm: srun started 4 tasks, but MPI sees a world "
                                              r"of 1 rank in task (\d+):", done.stderr))
    assert tasks == [0, 1, 2, 3], done.stderr[-3000:]
    lines = [line[line.index("RuntimeError: TorusComm"):] for line in done.stderr.splitlines()
             if "RuntimeError: TorusComm: srun started" in line]
    first = next(line for line in lines if "in task 0:" in line)
    assert first.startswith("RuntimeError: TorusComm: srun started 4 tasks, but MPI sees a world of 1 rank in "
                            "task 0: this MPI library did not connect to Slurm's PMI")
    assert "mpiexec -n 4" in first and "srun --mpi=list" in first
    assert first.removeprefix("RuntimeError: ") in DOCS.read_text(), "docs/clusters.md quotes another message"


@pytest.fixture(scope="module")
def alone(env, tmp_path_factory) -> dict:
    """torus-train's summary of the same epoch in one process here, without any launcher (the oracle)."""
    summary = tmp_path_factory.mktemp("alone") / "summary.json"
    local = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PMI_"))}
    done = _run([sys.executable, "-m", "torus.integrations.keras.app.cli", *TRAIN, "--summary", str(summary)],
                local)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(summary.read_text())


def _same_training(summary: Path, alone: dict) -> None:
    got = json.loads(summary.read_text())
    assert (got["world_size"], got["grid"]) == (4, [2, 2])
    one, four = alone["history"][0], got["history"][0]
    assert (four["steps"], four["global_batch"]) == (one["steps"], one["global_batch"])
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-4)
    assert four["val_top1"] == pytest.approx(one["val_top1"], abs=0.01)


def test_torus_train_under_srun(cluster, env, alone, tmp_path):
    done = _run(cluster.command("srun", "--mpi=pmi2", "--nodes=2", "--ntasks=4", "torus-train", *TRAIN,
                                "--summary", str(tmp_path / "summary.json")), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 ranks (grid 2x2" in done.stdout + done.stderr
    _same_training(tmp_path / "summary.json", alone)


def _docs_script(name: str) -> str:
    """The script between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in docs/clusters.md, without its fence."""
    found = re.search(rf"<!-- {name} -->\n```\w*\n(.*?)```\n<!-- /{name} -->", DOCS.read_text(), re.S)
    assert found, f"docs/clusters.md has no script between <!-- {name} --> markers"
    return found.group(1)


@pytest.mark.parametrize("name", ["sbatch", "sbatch-torus-run"])
def test_sbatch_script_of_the_docs(cluster, env, alone, tmp_path, name):
    script = tmp_path / "train.sbatch"
    script.write_text(_docs_script(name))
    done = _run(cluster.command("sbatch", "--wait", script.name, *TRAIN, "--summary", str(tmp_path / "s.json")),
                env, cwd=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("torus-*.out"))
    assert done.returncode == 0, done.stderr + logs[-3000:]
    assert "4 ranks (grid 2x2" in logs
    if name == "sbatch-torus-run":
        assert "torus-run: summary: no restart; exit status 0" in logs
    _same_training(tmp_path / "s.json", alone)


def _supervise(cluster: SlurmCluster, env: dict, srun_args: str, fault) -> str:
    """torus-run inside ``salloc --no-kill`` (a lost node does not end the allocation) over the 2 nodes, running
    supervise_worker.py; ``fault()`` once every rank of launch 0 is ready. Returns the output; asserts exit 0."""
    cmd = cluster.command("salloc", "--nodes=2", "--ntasks=4", "--no-kill", sys.executable, "-m",
                          "torus.supervise.cli", f"--mpiexec-args={srun_args}", "--probe-timeout", "60", "--",
                          sys.executable, str(HERE / "supervise_worker.py"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env, TORUS_TIMEOUT="3", TORUS_ABORT_TIMEOUT="5"), start_new_session=True)
    lines: list[str] = []
    stream = proc.stdout
    assert stream is not None
    reader = threading.Thread(target=lambda: lines.extend(stream), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while sum(f"launch 0 rank {r} ready" in "".join(lines) for r in range(4)) < 4:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"launch 0 never got ready:\n{''.join(lines)[-3000:]}")
            time.sleep(0.1)
        fault()
        proc.wait(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    return text


def test_torus_run_in_salloc_relaunches_a_killed_rank(cluster, env):
    def kill_one():
        victims = [pid for pid in cluster.pids(cluster.namespace(2)) if "supervise_worker" in _cmdline(pid)]
        assert len(victims) == 2, victims  # ranks 2 and 3
        os.kill(max(victims), signal.SIGKILL)

    text = _supervise(cluster, env, "--mpi=pmi2", kill_one)
    n1, n2 = cluster.node(1), cluster.node(2)
    assert re.search(rf"torus-run: restart 1/3: rank [23] on {n2} ended: Killed; relaunching 4 ranks on {n1},{n2}",
                     text), text[-3000:]
    for r in range(4):
        assert f"launch 1 rank {r} of 4 on {cluster.namespace(r // 2 + 1)}" in text
        assert f"launch 1 rank {r} sum ok" in text
    assert "torus-run: summary: 1 restart, hosts lost: none" in text


def test_torus_run_in_salloc_leaves_out_a_cut_node(cluster, env):
    # torus-run's own --overlap: the step of launch 0 stays on record (holding the CPUs of node 1 too) until the
    # cut node's slurmd reports it ended, which it cannot; without it the probe and the relaunch would wait
    try:
        text = _supervise(cluster, env, "--mpi=pmi2", lambda: cluster.cut(2))
    finally:
        cluster.restore(2)
    n1, n2 = cluster.node(1), cluster.node(2)
    assert re.search(rf"torus-run: restart 1/3: exit status 75; {n2} unreachable \(the probe failed .*\); {n2} left "
                     rf"out; relaunching 2 ranks on {n1}\n", text), text[-3000:]
    for r in range(2):
        assert f"launch 1 rank {r} of 2 on {cluster.namespace(1)}" in text
        assert f"launch 1 rank {r} sum ok" in text
    assert f"torus-run: summary: 1 restart, hosts lost: {n2}," in text


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
