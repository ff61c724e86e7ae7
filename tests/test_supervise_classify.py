"""How torus-run reads a launch's end (torus/supervise/launch.py) and words it (report.py), on output recorded
from the real launchers, and the exit status that makes a stall timeout worth a relaunch (torus/faults.py).

The hydra samples were recorded on 2026-12-07 with the mpich wheel's mpiexec (hydra 5.0.2), 2-core machine:
one host (``mpiexec -n 3 python -c ...``, rank 1 killing itself with SIGKILL or SIGTERM; every rank raising
under torus.faults.abort_on_exception) and 3 emulated hosts (tests/cluster, 2 ranks each, rank 4 on
10.231.21.3 killing itself with SIGKILL; host 3's link cut under tests/cluster/fault_worker.py). The srun lines
are Slurm's formats (``srun: error: <node>: task <r>: Killed``). Budget: well under a second.
"""
from __future__ import annotations

import sys

import pytest

from torus.supervise import launch, report
from torus.supervise.hosts import Host
from torus.supervise.launch import Launcher, Scan, classify

# one host, rank 1 of 3 killed by SIGKILL: mpiexec exit status 9; the banner (stdout) names rank 0, whom hydra
# killed afterwards; the exit string names the signal
ONE_HOST_SIGKILL = (9, """1 22516
0 22515
2 22517

===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 22515 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
Please see the FAQ page for debugging suggestions
""")
ONE_HOST_SIGTERM = (15, ONE_HOST_SIGKILL[1].replace("Killed (signal 9)", "Terminated (signal 15)"))
# 3 hosts x 2 ranks, rank 4 (on 10.231.21.3) killed by SIGKILL: exit status 255, no exit string; the banner
# names the dead rank's host, then hydra's proxies fail an assertion (stderr)
THREE_HOSTS_SIGKILL = (255, """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 30636 RUNNING AT 10.231.21.3
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================

[proxy:1@vm] HYD_pmcd_pmip_control_cmd_cb (/mpich-5.0.2/src/pm/hydra/proxy/pmip_cb.c:490): assert (!closed) failed
[proxy:1@vm] HYDT_dmxu_poll_wait_for_event (/mpich-5.0.2/src/pm/hydra/lib/tools/demux/demux_poll.c:76): callback \
returned error status
[proxy:1@vm] main (/mpich-5.0.2/src/pm/hydra/proxy/pmip.c:123): demux engine error waiting for event
[proxy:0@vm] [mpiexec@vm] HYDT_bscu_wait_for_completion (/mpich-5.0.2/src/pm/hydra/lib/tools/bootstrap/utils/\
bscu_wait.c:109): one of the processes terminated badly; aborting
[mpiexec@vm] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager error waiting for completion
""")
# every rank raised under torus.faults.abort_on_exception: status 1, no banner
EVERY_RANK_RAISED = (1, """[rank 1] uncaught RuntimeError; aborting the MPI job: boom on 1
Traceback (most recent call last):
  File "<string>", line 6, in <module>
RuntimeError: boom on 1
[rank 0] uncaught RuntimeError; aborting the MPI job: boom on 0
[rank 1] calling MPI_Abort(1); this process ends itself (SIGALRM) if it still runs in 10 s
Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1) - process 1
[rank 1] MPI_Abort returned; exiting with status 1
""")
# host 3's link cut (3 hosts x 1 rank, TORUS_TIMEOUT=3): the survivors' stall timeout, status 75, no banner
LINK_CUT = (75, """[rank 1] uncaught TimeoutError; aborting the MPI job: allreduce(ring) on rank 1: no progress \
for 3 s in the argument check (the all-gather of every rank's call signature): some rank did not call allreduce, \
died or is stuck; the communicator is unusable now, abort the job
[rank 1] calling MPI_Abort(75); this process ends itself (SIGALRM) if it still runs in 5 s
Abort(75) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 75) - process 1
[rank 1] MPI_Abort returned; exiting with status 75
""")
# the probe of a host whose link is down (mpiexec -hosts 10.231.21.3 -n 1 true): status 255 within 10 ms
PROBE_OF_A_CUT_HOST = """[proxy:0@vm] HYDU_sock_connect (/mpich-5.0.2/src/pm/hydra/lib/utils/sock.c:140): \
unable to connect from "vm" to "10.231.21.254" (Network is unreachable)
[mpiexec@vm] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager error waiting for completion"""
SRUN_KILLED = (137, "srun: error: node3: task 2: Killed\nsrun: Force Terminated StepId=41.0\n")
SRUN_EXITED = (1, "srun: error: node1: tasks 0-1: Exited with exit code 1\n")
SRUN_NODE_FAILURE = (1, "srun: error: Node failure on node2\n")


def _scan(text: str) -> Scan:
    scan = Scan()
    for i, line in enumerate(text.splitlines()):
        scan.line(line, now=100.0 + i)
    return scan


PLACED = {"vm": "ranks 0-2", "10.231.21.1": "ranks 0-1", "10.231.21.2": "ranks 2-3", "10.231.21.3": "ranks 4-5"}


@pytest.mark.parametrize("sample, host, signal", [
    (ONE_HOST_SIGKILL, "vm", 9), (ONE_HOST_SIGTERM, "vm", 15), (THREE_HOSTS_SIGKILL, "10.231.21.3", None)])
def test_a_killed_rank_relaunches_and_names_its_host(sample, host, signal):
    status, text = sample
    scan = _scan(text)
    assert scan.hosts == [host] and scan.signal == signal and scan.killed
    assert scan.first_failure == 100.0 + text.splitlines().index(
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES")
    verdict = classify(status, scan, {}, 3, PLACED)
    assert verdict.restart
    if signal is None:
        assert verdict.reason == "a rank on 10.231.21.3 (ranks 4-5) terminated badly (the launcher gives no signal)"
    else:
        name = {9: "Killed", 15: "Terminated"}[signal]
        assert verdict.reason == f"a rank on vm (ranks 0-2) killed by signal {signal} ({name})"


def test_an_exception_on_every_rank_is_not_relaunched():
    status, text = EVERY_RANK_RAISED
    scan = _scan(text)
    assert not scan.killed and scan.hosts == [] and scan.first_failure is None
    verdict = classify(status, scan, {}, 1)
    assert not verdict.restart and verdict.reason.startswith("exit status 1 (an error on the ranks")


def test_a_bad_argument_is_not_relaunched_even_with_a_host_gone():
    verdict = classify(2, Scan(), {"h2": "no answer"}, 2)
    assert not verdict.restart and verdict.reason == "exit status 2 (a bad argument)"


def test_a_rank_killed_by_sigint_is_not_taken_for_a_bad_argument():
    # hydra exits with the signal's number: 2 for SIGINT; the exit string tells the two apart
    status, text = ONE_HOST_SIGKILL
    scan = _scan(text.replace("Killed (signal 9)", "Interrupt (signal 2)"))
    assert classify(2, scan, {}, 1).restart


def test_the_stall_timeout_of_a_cut_link_relaunches_and_the_probe_names_the_host():
    status, text = LINK_CUT
    scan = _scan(text)
    assert not scan.killed
    verdict = classify(status, scan, {}, 3)
    assert verdict.restart and verdict.reason == "exit status 75 (the ranks lost a peer: a stall timeout)"
    why = "the probe failed with exit status 255: " + launch._cause(PROBE_OF_A_CUT_HOST.encode())
    assert why.endswith(': unable to connect from "vm" to "10.231.21.254" (Network is unreachable)')
    verdict = classify(status, scan, {"10.231.21.3": why}, 3)
    assert verdict.restart and verdict.reason == f"exit status 75; 10.231.21.3 unreachable ({why})"


def test_an_unreachable_host_relaunches_whatever_the_status_but_every_host_unreachable_does_not():
    assert classify(1, Scan(), {"h3": "no answer to the probe within 10 s"}, 3).restart
    verdict = classify(255, Scan(), {"h1": "x", "h2": "y"}, 2)
    assert not verdict.restart and "the probe fails on every host" in verdict.reason


def test_another_exit_status_is_the_programs_own():
    verdict = classify(3, Scan(), {}, 2)
    assert not verdict.restart and verdict.reason.startswith("exit status 3")


def test_srun_names_the_rank_and_node():
    status, text = SRUN_KILLED
    scan = _scan(text)
    assert scan.hosts == ["node3"] and scan.ranks == {"node3": "2"} and scan.killed
    assert classify(status, scan, {}, 3).reason == "rank 2 on node3 ended: Killed"
    status, text = SRUN_EXITED
    scan = _scan(text)
    assert not scan.killed and scan.exited == {"node1": 1}
    verdict = classify(status, scan, {}, 3)
    assert not verdict.restart and verdict.reason.endswith("; 0-1 on node1 exited with status 1")
    status, text = SRUN_NODE_FAILURE
    verdict = classify(status, _scan(text), {}, 3)
    assert verdict.restart and verdict.reason == "srun lost node2"


def test_the_resumed_line_is_read_wherever_it_appears():
    scan = _scan("[rank 0] torus-run: resumed at step 1200 (fit 0, epoch 3)\n"
                 "torus-run: resumed at step 9\n")
    assert scan.resumed == 1200 and scan.first_failure is None


def test_progress_markers_are_read_and_not_shown():
    scan = launch.Scan()
    shown = launch._without_progress(b"loss 0.5\ntorus-run: at step 12\ntorus-run: at step 13\nmore", scan)
    assert shown == b"loss 0.5\nmore" and scan.progress == 13
    assert launch._without_progress(b"[1] torus-run: at step 14\n", scan) == b"[1] torus-run: at step 14\n"
    assert scan.progress == 13  # a marker is a whole line of its own


def test_the_launch_and_probe_command_lines():
    placed = [Host("h1", 2), Host("h2", 1)]
    env = {"TORUS_JOB_ID": "abc", "TORUS_RESTART": "1"}
    mpiexec = Launcher("mpiexec", "/bin/mpiexec", ["-launcher", "ssh"])
    assert mpiexec.job(placed, env, ["python", "x.py"]) == [
        "/bin/mpiexec", "-launcher", "ssh", "-hosts", "h1:2,h2:1", "-n", "3", "-genv", "TORUS_JOB_ID", "abc",
        "-genv", "TORUS_RESTART", "1", "python", "x.py"]
    assert mpiexec.probe("h2") == ["/bin/mpiexec", "-launcher", "ssh", "-hosts", "h2", "-n", "1", "true"]
    here = Launcher("mpiexec", "/bin/mpiexec", [], local=True)
    assert here.job([Host("vm", 4)], env, ["a"])[:3] == ["/bin/mpiexec", "-n", "4"]
    assert here.probe("vm") == ["/bin/mpiexec", "-n", "1", "true"]
    srun = Launcher("srun", "/bin/srun", [])
    assert srun.job(placed, env, ["a"], excluded=["h3"]) == [
        "/bin/srun", "--overlap", "--nodes=2", "--nodelist=h1,h2", "--ntasks=3", "--distribution=block",
        "--kill-on-bad-exit=1", "--quit-on-interrupt", "--export=ALL,TORUS_JOB_ID=abc,TORUS_RESTART=1", "--exclude=h3",
        "a"]
    assert srun.probe("h3") == ["/bin/srun", "--overlap", "--nodes=1", "--nodelist=h3", "--ntasks=1", "true"]
    told = Launcher("srun", "/bin/srun", ["--mpi=pmi2", "--overlap"])  # once, whether told or not
    assert told.probe("h3")[:4] == ["/bin/srun", "--mpi=pmi2", "--overlap", "--nodes=1"]


def test_the_restart_line_and_the_summary():
    line = report.restart_line(1, 3, "a rank on h3 (ranks 4-5) killed by signal 9 (Killed)",
                               report.left_out(["h3"], {"h2": 300.0}), 2, ["h1"])
    assert line == ("restart 1/3: a rank on h3 (ranks 4-5) killed by signal 9 (Killed); h3 left out; "
                    "h2 failed in 2 launches in a row, left out for 300 s; relaunching 2 ranks on h1")
    summary = report.Summary()
    assert summary.line(0) == "summary: no restart; exit status 0"
    summary.restarted(["h3"], 2.25)
    summary.resumed(140, 100)
    summary.restarted(["h3", "h2"], 1.0)
    summary.resumed(None, 150)
    assert summary.line(0) == ("summary: 2 restarts, hosts lost: h3, h2, 3.25 s lost (from detecting the failure "
                               "to the relaunch), 40 steps redone (reported by 1 of 2 relaunches); exit status 0")


def test_detection_is_the_first_failure_line_else_the_exit():
    assert launch.Ended(9, _scan(ONE_HOST_SIGKILL[1]), 50.0, 120.0).detected == 105.0  # the 6th line
    assert launch.Ended(75, _scan(LINK_CUT[1]), 50.0, 120.0).detected == 101.0  # the rank's MPI_Abort(75) line
    assert launch.Ended(1, _scan("error: no\n"), 50.0, 120.0).detected == 120.0  # no failure line: the exit


class _World:
    """MPI.COMM_WORLD's stand-in: records Abort's status instead of ending pytest."""

    def __init__(self):
        self.aborted = []

    def Get_rank(self):  # noqa: N802 - mpi4py's name
        return 1

    def Abort(self, status):  # noqa: N802
        self.aborted.append(status)


def _tf_error(inner: str):
    """A TensorFlow error wrapping a Python error raised in a tf.numpy_function, as TensorFlow words it."""
    kind = type("UnknownError", (Exception,), {"__module__": "tensorflow.python.framework.errors_impl"})
    return kind(f"Graph execution error:\n\nTraceback (most recent call last):\n  File \"x.py\", line 3\n{inner}\n"
                "\t [[{{node torus_bucket0_start}}]]")


# TF 2.21's own wording puts a "Detected at node" block, naming the error by its bare class name, before the
# op's traceback (seen in every abort of the fault bench: the bare name was read, and the stall aborted with 1)
_DETECTED = ("Detected at node torus_allreduce defined at (most recent call last):\n  File \"fit.py\", line 9\n\n"
             "TimeoutError: allreduce(shm) on rank 0: no progress for 8 s\n\n")


@pytest.mark.parametrize("exc, status", [
    ("stall", 75), ("stall in a TensorFlow op", 75), ("stall in a TensorFlow op, TF 2.21's wording", 75),
    ("peer's Python exited", 1), ("builtin TimeoutError", 1), ("RuntimeError", 1)])
def test_abort_on_exception_gives_a_stall_timeout_its_own_status(monkeypatch, capfd, exc, status):
    from torus import faults
    from torus.errors import TimeoutError as TorusTimeout

    errors = {
        "stall": TorusTimeout("allreduce(ring) on rank 1: no progress for 3 s at step 2/6"),
        "stall in a TensorFlow op": _tf_error("torus.errors.TimeoutError: allreduce(ring) on rank 1: no progress"),
        "stall in a TensorFlow op, TF 2.21's wording": _tf_error(
            _DETECTED + "torus.errors.TimeoutError: allreduce(shm) on rank 0: no progress for 8 s"),
        "peer's Python exited": TorusTimeout(f"allreduce(ring) on rank 1: rank 2 {faults.PYTHON_EXITED} while "
                                             "this rank waits"),
        "builtin TimeoutError": TimeoutError("socket timed out"),
        "RuntimeError": RuntimeError("boom"),
    }
    assert faults.PEER_LOST_EXIT == launch.PEER_LOST_EXIT == 75
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(faults, "ABORT_GRACE_S", 0)
    monkeypatch.setattr(faults, "watchdog", lambda why: None)  # SIGALRM would end pytest
    monkeypatch.setattr(faults.os, "_exit", lambda status: None)  # the stand-in's Abort returns
    world = _World()
    faults.abort_on_exception(world)
    error = errors[exc]
    sys.excepthook(type(error), error, None)
    assert world.aborted == [status], capfd.readouterr().err


def test_a_launcher_stuck_after_a_peer_lost_abort_is_ended(monkeypatch, tmp_path):
    """hydra waiting on a cut host's proxy after the survivors aborted with status 75 (seen in 2 of 10 link-cut
    trials, bench/fault_injection/results/fault_injection.txt): torus-run ends it and the launch counts as a lost
    peer."""
    monkeypatch.setattr(launch, "LAUNCHER_GRACE_S", 0.5)
    stuck = [sys.executable, "-c", "import sys, time; sys.stderr.write('[rank 1] calling MPI_Abort(75)\\n'); "
             "sys.stderr.flush(); time.sleep(60)"]
    out, err = (tmp_path / "out").open("wb"), (tmp_path / "err").open("wb")
    ended = launch.run(stuck, {}, out=out, err=err)
    assert ended.status == launch.PEER_LOST_EXIT and ended.ended - ended.started < 10
    assert classify(ended.status, ended.scan, {}, 3).restart
    other = [sys.executable, "-c", "import sys; sys.stderr.write('[rank 1] calling MPI_Abort(1)\\n'); sys.exit(1)"]
    assert launch.run(other, {}, out=out, err=err).status == 1  # an error's abort is left to end by itself
