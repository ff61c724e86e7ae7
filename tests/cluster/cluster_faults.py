"""Faults across hosts (run by tests/cluster/suites.py on a running cluster of 2 hosts, TORUS_CLUSTER=name):
each case starts a 2 hosts x 2 ranks job of fault_worker.py, waits until every rank has all-reduced a few
times, injects the fault, and then requires ``mpiexec`` to exit non-zero and every process of the job, in
every namespace (hydra_pmi_proxy, its shell, the ranks), to be gone within BOUND_S of the fault.

- link cut: host 2 loses its link. Hosts 1's ranks time out (TORUS_TIMEOUT=3) and abort; mpiexec ends them.
  Host 2's ranks time out too, but their MPI_Abort cannot reach mpiexec: torus.faults.abort leaves with
  os._exit when MPI_Abort returns (its watchdog, TORUS_ABORT_TIMEOUT=5, would end them otherwise); the proxy
  then exits by itself.
- ranks killed: both ranks of host 2 get SIGKILL; hydra ends the job.
- rank stuck: rank 3 sleeps inside an all-reduce; the others time out and abort; mpiexec ends the sleeper.

Not covered (tried by hand): a rank stuck outside MPI (asleep) on the host whose link is cut stays alive, with
that host's proxy: no torus code runs in it, and hydra's proxy does not end its own ranks when one of them
aborts; only mpiexec does, which it cannot reach.

BOUND_S = stall timeout 3 + abort delay 0.5 + watchdog 5 + 6 s for a loaded 2-core machine. Each case prints
one line (exit status, seconds to mpiexec's exit, seconds until the namespaces were empty) for the record.
Budget: 3 jobs of about 10 s each.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import child_env, from_state

BOUND_S = 15
START_S = 120  # start-up of 4 Python ranks with numpy and mpi4py on a loaded machine
WORKER = Path(__file__).with_name("fault_worker.py")


@pytest.fixture(scope="module")
def cluster():
    name = os.environ.get("TORUS_CLUSTER")
    if not name:
        pytest.skip("needs a running cluster (python -m tests.cluster test)")
    c = from_state(name)
    assert c.hosts == 2
    return c


@pytest.fixture
def job(cluster):
    """Start fault_worker.py with the given arguments; yields a starter. Afterwards the link is restored
    and anything left in the namespaces killed, so one case's failure does not spill into the next."""
    started = []

    def start(*args: str):
        cmd = cluster.mpiexec(ppn=2) + ["-n", "4", sys.executable, str(WORKER), *args]
        env = child_env(TORUS_TIMEOUT="3", TORUS_ABORT_TIMEOUT="5", TORUS_RECORDER="64")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        started.append(proc)
        deadline = time.monotonic() + START_S
        while sum(f"rank {r} ready" in "".join(lines) for r in range(4)) < 4:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job never got ready:\n{''.join(lines)[-3000:]}")
            time.sleep(0.05)
        return proc, lines, reader

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    cluster.restore(2)
    for h in (1, 2):
        cluster.kill_all(cluster.namespace(h))


def _ends(cluster, proc, lines, reader, what: str) -> tuple[int, float, float]:
    """Wait for mpiexec and for empty namespaces; return (status, seconds to exit, seconds to empty)."""
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: mpiexec still ran {BOUND_S} s after the fault: {cluster.processes()}\n"
                    f"{''.join(lines)[-3000:]}")
    exited = time.monotonic() - t0
    while any(cluster.processes().values()):
        if time.monotonic() - t0 > BOUND_S:
            pytest.fail(f"{what}: processes left {BOUND_S} s after the fault: {cluster.processes()}")
        time.sleep(0.1)
    empty = time.monotonic() - t0
    reader.join(timeout=5)
    print(f"\n{what}: mpiexec exit status {rc} after {exited:.1f} s; no process left in any namespace after "
          f"{empty:.1f} s")
    return rc, exited, empty


def test_a_cut_link_ends_every_process_on_both_hosts(cluster, job):
    proc, lines, reader = job("loop")
    cluster.cut(2)
    rc, _, _ = _ends(cluster, proc, lines, reader, "link of host 2 cut")
    out = "".join(lines)
    assert rc != 0, out[-3000:]
    # host 1's ranks said why; host 2's output could not reach mpiexec any more
    assert "uncaught TimeoutError" in out and "no progress for 3 s" in out, out[-3000:]
    # and host 1's first rank to time out printed the flight recorder's diagnosis (torus/recorder.py)
    diagnosis = out[out.find("torus doctor: communicator "):]
    assert "torus doctor: communicator " in out, out[-3000:]
    print("the diagnosis as printed:\n" + "\n".join(diagnosis.splitlines()[:8]))  # the log shows it (-s)
    assert re.search(r"- rank [01] timed out (at step \d+/\d+ waiting on rank [23]|in the argument check)",
                     diagnosis), diagnosis[:3000]


def test_killed_ranks_end_the_job(cluster, job):
    proc, lines, reader = job("loop")
    ranks = [pid for pid, cmd in cluster.processes()[cluster.namespace(2)] if str(WORKER) in cmd
             and "hydra" not in cmd and not cmd.startswith("sh ")]
    assert len(ranks) == 2, cluster.processes()
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    rc, _, _ = _ends(cluster, proc, lines, reader, "ranks of host 2 killed")
    assert rc != 0, "".join(lines)[-3000:]


def test_a_stuck_rank_is_ended_with_the_job(cluster, job):
    proc, lines, reader = job("stuck", "3")
    rc, _, _ = _ends(cluster, proc, lines, reader, "rank 3 stuck in an all-reduce")
    out = "".join(lines)
    assert rc != 0, out[-3000:]
    survivors = [r for r in range(3) if f"on rank {r}: no progress for 3 s" in out]
    assert survivors and "uncaught TimeoutError" in out, out[-3000:]
    assert "torus doctor: communicator " in out and "- rank 3 left no record" in out, out[-3000:]
