"""torus-run end to end on this host: real ``mpiexec -n 2`` launches of a tiny rank script (no MPI inside, so
each launch takes a fraction of a second), and a stand-in ``srun``/``scontrol`` on PATH for the Slurm path.

Every rank appends ``launch R rank r job J ...`` to a file before it does anything else, so the tests count
launches and ranks and compare job ids from what the ranks saw, not from what torus-run says. Cases: a rank
killed in the first launch is relaunched once and the job ends 0; an exception on every rank, or a bad argument,
is not relaunched; the stall timeout's status 75 is; --max-restarts stops; a host failing twice in a row cools
down; a discovery script that shrinks changes the rank count; srun gets the hosts left and the rank count;
SIGTERM to torus-run ends the job without a relaunch. Budget: about 10 s in all (the SIGTERM case runs
``python -m torus.supervise.cli``, about 3 s of imports).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torus.supervise import cli

RANK = r'''
import os, signal, sys, time
rank = int(os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "-1")))
launch = int(os.environ["TORUS_RESTART"])
mode, log = sys.argv[1], sys.argv[2]
with open(log, "a") as f:
    f.write(f"launch {launch} rank {rank} job {os.environ['TORUS_JOB_ID']} pid {os.getpid()}\n")
if launch == 0 and rank == 0:
    print("torus-run: at step 139\ntorus-run: at step 140", flush=True)
time.sleep(0.3)  # every rank has started before one fails
if mode == "kill-once" and launch == 0 and rank == 1 or mode == "kill-always" and rank == 1 \
        or mode == "slurm" and launch == 0 and rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "raise":
    raise RuntimeError(f"rank {rank} fails on purpose")
if mode == "usage":
    print("job: error: --epochs x: not a number", file=sys.stderr)
    sys.exit(2)
if mode == "peer-lost-once" and launch == 0 and rank == 0:
    os._exit(75)  # the status of torus.faults' abort after a stall timeout (the peer ends by itself here)
if mode == "sleep":
    time.sleep(60)
if launch == 0 and mode != "peer-lost-once":
    time.sleep(5)  # the failing rank's peers wait (hydra ends them)
if launch > 0 and rank == 0 and mode != "kill-always":
    print("torus-run: resumed at step 100", flush=True)
'''


@pytest.fixture
def job(tmp_path):
    """(command for torus-run after --, the ranks' log)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    log = tmp_path / "ranks.log"

    def command(mode: str) -> list[str]:
        return [sys.executable, str(script), mode, str(log)]

    return command, log


def _launches(log: Path) -> dict[int, list[int]]:
    """{launch: sorted ranks that started in it} from the ranks' own log."""
    seen: dict[int, list[int]] = {}
    for line in log.read_text().splitlines():
        launch, rank = re.match(r"launch (\d+) rank (-?\d+) ", line).groups()
        seen.setdefault(int(launch), []).append(int(rank))
    return {k: sorted(v) for k, v in sorted(seen.items())}


def _jobs(log: Path) -> set[str]:
    return {line.split(" job ")[1].split()[0] for line in log.read_text().splitlines()}


def _ours(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("torus-run: ")]


HOST = os.uname().nodename


def test_a_rank_killed_in_the_first_launch_is_relaunched_once(job, capfd):
    command, log = job
    status = cli.main(["-n", "2", "--", *command("kill-once")])
    out, err = capfd.readouterr()
    assert status == 0, err
    assert _launches(log) == {0: [0, 1], 1: [0, 1]}
    (job_id,) = _jobs(log)  # one id for both launches
    assert re.fullmatch(r"[0-9a-f]{32}", job_id)
    assert "BAD TERMINATION" in out and "resumed at step 100" in out  # the job's output passes through
    assert "at step 14" not in out  # the progress markers are torus-run's, not shown
    lines = _ours(err)
    assert lines[0] == (f"torus-run: restart 1/3: a rank on {HOST} (ranks 0-1) killed by signal 9 (Killed); "
                        f"relaunching 2 ranks on {HOST}"), err
    assert re.fullmatch(r"torus-run: summary: 1 restart, hosts lost: none, [0-9.]+ s lost \(from detecting the "
                        r"failure to the relaunch\), 40 steps redone; exit status 0", lines[1]), err
    assert len(lines) == 2, err


def test_an_exception_on_every_rank_is_not_relaunched(job, capfd):
    command, log = job
    status = cli.main(["-n", "2", "--", *command("raise")])
    err = capfd.readouterr().err
    assert status == 1 and _launches(log) == {0: [0, 1]}, err
    assert "rank 1 fails on purpose" in err
    assert _ours(err) == ["torus-run: not relaunching: exit status 1 (an error on the ranks or the program's own "
                          "status)", "torus-run: summary: no restart; exit status 1"], err


def test_a_bad_argument_is_not_relaunched(job, capfd):
    command, log = job
    status = cli.main(["-n", "2", "--", *command("usage")])
    err = capfd.readouterr().err
    assert status == 2 and _launches(log) == {0: [0, 1]}, err
    assert _ours(err)[0] == "torus-run: not relaunching: exit status 2 (a bad argument)", err


def test_the_stall_timeouts_status_relaunches(job, capfd):
    command, log = job
    status = cli.main(["-n", "2", "--job-id", "run-7", "--", *command("peer-lost-once")])
    err = capfd.readouterr().err
    assert status == 0 and _launches(log) == {0: [0, 1], 1: [0, 1]} and _jobs(log) == {"run-7"}, err
    assert _ours(err)[0] == ("torus-run: restart 1/3: exit status 75 (the ranks lost a peer: a stall timeout); "
                             f"relaunching 2 ranks on {HOST}"), err


def test_max_restarts_stops_the_relaunches(job, capfd):
    command, log = job
    # --cooldown 0: this host stays in however often it fails, so only --max-restarts ends the run
    status = cli.main(["-n", "2", "--max-restarts", "2", "--cooldown", "0", "--", *command("kill-always")])
    err = capfd.readouterr().err
    assert status == 9 and _launches(log) == {0: [0, 1], 1: [0, 1], 2: [0, 1]}, err
    lines = _ours(err)
    assert [line.split(":")[1] for line in lines[:2]] == [" restart 1/2", " restart 2/2"], err
    assert lines[2] == (f"torus-run: giving up: a rank on {HOST} (ranks 0-1) killed by signal 9 (Killed); "
                        "--max-restarts 2 used up"), err
    assert lines[3].startswith("torus-run: summary: 2 restarts, hosts lost: none, ") and \
        lines[3].endswith("steps redone not reported by the job; exit status 9"), err


def test_a_host_failing_in_two_launches_in_a_row_cools_down(job, capfd):
    command, log = job
    status = cli.main(["-n", "2", "--cooldown", "600", "--", *command("kill-always")])
    err = capfd.readouterr().err
    assert status == 9 and _launches(log) == {0: [0, 1], 1: [0, 1]}, err
    assert re.fullmatch(rf"torus-run: giving up: a rank on {HOST} \(ranks 0-1\) killed by signal 9 \(Killed\); "
                        rf"0 slots left \(no host\), fewer than --min-np 1; {HOST} cooling down for \d+ s more "
                        r"\(its ranks failed in two launches in a row: --cooldown\)", _ours(err)[1]), err


def test_a_discovery_script_that_shrinks_changes_the_rank_count(job, tmp_path, capfd):
    command, log = job
    calls = tmp_path / "calls"
    script = tmp_path / "discover.py"
    # first call: this host with 2 slots; later calls: 1 slot
    script.write_text(f"import pathlib\np = pathlib.Path({str(calls)!r})\nn = len(p.read_text()) if p.exists() "
                      f"else 0\np.write_text('x' * (n + 1))\nprint('{HOST}:' + ('2' if n == 0 else '1'))\n")
    status = cli.main(["--host-discovery-script", f"{sys.executable} {script}", "--", *command("kill-once")])
    err = capfd.readouterr().err
    assert status == 0 and _launches(log) == {0: [0, 1], 1: [0]}, err
    assert calls.read_text() == "xx"  # before each launch
    assert _ours(err)[0].endswith(f"relaunching 1 rank on {HOST}"), err


FAKE_SRUN = r'''#!{python}
"""A stand-in for srun: logs its arguments, answers probes (fails on the nodes in FAKE_SRUN_DEAD), runs the
tasks here with SLURM_PROCID and the --export variables, and reports a task killed by a signal as srun does."""
import json, os, subprocess, sys, time
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
nodes = opts["nodelist"].split(",")
if args == ["true"]:
    sys.exit(1 if nodes[0] in os.environ.get("FAKE_SRUN_DEAD", "").split(",") else 0)
env = dict(os.environ)
env.update(kv.split("=", 1) for kv in opts["export"].split(",")[1:])
ntasks = int(opts["ntasks"])
procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(i))) for i in range(ntasks)]
status, running = 0, set(range(ntasks))
while running:
    time.sleep(0.02)
    for i in [i for i in running if procs[i].poll() is not None]:
        running.discard(i)
        rc = procs[i].returncode
        if rc < 0:  # srun's line, and --kill-on-bad-exit
            print(f"srun: error: {{nodes[i * len(nodes) // ntasks]}}: task {{i}}: Killed", file=sys.stderr,
                  flush=True)
            for q in procs:
                if q.poll() is None:
                    q.kill()
        status = max(status, 128 - rc if rc < 0 else rc)
sys.exit(status)
'''


def test_inside_slurm_srun_launches_on_the_nodes_left(job, tmp_path, monkeypatch, capfd):
    command, log = job
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$3\" = 'node[1-3]' ] && printf 'node1\\nnode2\\nnode3\\n'\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    srun_log = tmp_path / "srun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x3)")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(srun_log))
    monkeypatch.setenv("FAKE_SRUN_DEAD", "node3")  # after launch 0, node3 answers no probe
    status = cli.main(["--job-id", "j41", "--", *command("slurm")])
    err = capfd.readouterr().err
    assert status == 0 and _launches(log) == {0: [0, 1, 2], 1: [0, 1]}, err
    calls = [json.loads(line) for line in srun_log.read_text().splitlines()]
    tail = [*command("slurm")]
    assert calls[0] == ["--overlap", "--nodes=3", "--nodelist=node1,node2,node3", "--ntasks=3",
                        "--distribution=block",
                        "--kill-on-bad-exit=1", "--quit-on-interrupt",
                        "--export=ALL,TORUS_JOB_ID=j41,TORUS_RESTART=0,TORUS_RUN_PROGRESS=1",
                        *tail]
    assert sorted(c[2] for c in calls[1:4]) == ["--nodelist=node1", "--nodelist=node2", "--nodelist=node3"]
    assert all(c[-1] == "true" for c in calls[1:4])
    assert calls[4] == ["--overlap", "--nodes=2", "--nodelist=node1,node2", "--ntasks=2",
                        "--distribution=block",
                        "--kill-on-bad-exit=1", "--quit-on-interrupt",
                        "--export=ALL,TORUS_JOB_ID=j41,TORUS_RESTART=1,TORUS_RUN_PROGRESS=1",
                        "--exclude=node3", *tail]
    assert _ours(err)[0] == ("torus-run: restart 1/3: rank 2 on node3 ended: Killed; node3 unreachable (the probe "
                             "failed with exit status 1: no output); node3 left out; relaunching 2 ranks on "
                             "node1,node2"), err


def test_sigterm_ends_the_job_without_a_relaunch(job):
    command, log = job
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    proc = subprocess.Popen([sys.executable, "-m", "torus.supervise.cli", "-n", "2", "--", *command("sleep")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().splitlines()) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        pids = [int(line.split(" pid ")[1]) for line in log.read_text().splitlines()]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _launches(log) == {0: [0, 1]}
    assert "torus-run: stopped by signal 15; not relaunching" in err, err
    for pid in pids:  # the ranks are gone (a zombie would still answer kill 0)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
