"""torus-run's host lists (torus/supervise/hosts.py), as pure functions and through the command line: hostfile
lines and their errors (file and line named, exit status 2), the discovery script, Slurm's node list and task
counts, the placement of ranks over slots, and the health bookkeeping (cooldown after two failed launches in a
row). Budget: well under a second, plus a few tiny scripts.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from torus.supervise import cli
from torus.supervise.hosts import (
    Health,
    Host,
    HostError,
    discover,
    place,
    ranks_on,
    read_hostfile,
    slurm_hosts,
    tasks_per_node,
)


def test_hostfile_lines_as_hydra_reads_them(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1:4\n\n  node2:2   # a comment\nnode3\n10.0.0.7:1\n")
    assert read_hostfile(str(path)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("10.0.0.7", 1)]


@pytest.mark.parametrize("text, line, why", [
    ("node1:4\nnode2:x\n", 2, "slots must be a whole number of at least 1"),
    ("node1:0\n", 1, "slots must be a whole number of at least 1"),
    ("node1:4\n\nnode two:2\n", 3, "expected host[:slots]"),
    (":4\n", 1, "expected host[:slots]"),
    ("a:1\nb:1\na:2\n", 3, "host a is already listed on line 1"),
])
def test_a_bad_hostfile_line_is_named_with_its_file_and_line(tmp_path, text, line, why):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostError) as info:
        read_hostfile(str(path))
    message = str(info.value)
    assert message.startswith(f"--hostfile {path}, line {line}: ") and why in message, message


def test_an_empty_or_missing_hostfile_is_an_error(tmp_path):
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(HostError, match="no hosts listed"):
        read_hostfile(str(tmp_path / "empty"))
    with pytest.raises(HostError, match="cannot read it: No such file or directory"):
        read_hostfile(str(tmp_path / "missing"))


def test_a_bad_hostfile_ends_torus_run_with_status_2_and_one_line(tmp_path, capfd):
    path = tmp_path / "hosts"
    path.write_text("node1:2\nnode2:two\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["--hostfile", str(path), "--", "true"])
    assert info.value.code == 2
    err = capfd.readouterr().err.splitlines()
    assert err == [f"torus-run: error: --hostfile {path}, line 2: 'node2:two': slots must be a whole number of "
                   "at least 1"], err


@pytest.mark.parametrize("argv, expected", [
    (["-n", "2"], "no command: put it after --"),
    (["--", "true"], "-n is needed without --hostfile"),
    (["-n", "0", "--", "true"], "-n 0: must be at least 1"),
    (["-n", "2", "--min-np", "3", "--", "true"], "--min-np 3 is above the 2 ranks asked for"),
    (["-n", "2", "--mpiexec-args", "-hosts a,b", "--", "true"], "--mpiexec-args: -hosts is set by torus-run"),
    (["-n", "2", "--mpiexec-args", "-genv 'A", "--", "true"], "No closing quotation"),
])
def test_bad_arguments_end_with_status_2(capfd, argv, expected):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("torus-run: error: ") and expected in err and len(err.splitlines()) == 1, err


def test_more_ranks_than_slots_is_refused(tmp_path, capfd):
    path = tmp_path / "hosts"
    path.write_text("a:2\nb:1\n")
    with pytest.raises(SystemExit):
        cli.main(["--hostfile", str(path), "-n", "4", "--", "true"])
    assert "-n 4: the hosts have 3 slots (a:2,b:1)" in capfd.readouterr().err


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "discover.py"
    path.write_text(body)
    return f"{sys.executable} {path}"


def test_the_discovery_script_prints_the_hosts(tmp_path):
    script = _script(tmp_path, "print('h1:2')\nprint('h2:1')\n")
    assert discover(script, 30) == [Host("h1", 2), Host("h2", 1)]


def test_a_failing_or_wrong_discovery_script_is_named(tmp_path):
    script = _script(tmp_path, "import sys\nprint('warming up', file=sys.stderr)\nprint('no hosts', "
                               "file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(HostError) as info:
        discover(script, 30)
    assert str(info.value) == f"--host-discovery-script {script}: exit status 3: no hosts", info.value
    script = _script(tmp_path, "print('h1:2')\nprint('h2:-1')\n")
    with pytest.raises(HostError, match=r"\(its output\), line 2: 'h2:-1': slots must be"):
        discover(script, 30)
    with pytest.raises(HostError, match="cannot run it: No such file or directory"):
        discover("/no/such/discovery", 30)


def test_slurm_task_counts_and_node_names():
    assert tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    assert tasks_per_node("4", 1) == [4]
    with pytest.raises(HostError, match="describes 2 nodes, the allocation has 3"):
        tasks_per_node("1(x2)", 3)
    with pytest.raises(HostError, match="expected counts like"):
        tasks_per_node("2(x)", 1)

    calls = []

    def scontrol(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "gpu01\ngpu02\ngpu03\n", "")

    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_TASKS_PER_NODE": "4(x2),2"}
    assert slurm_hosts(env, scontrol) == [Host("gpu01", 4), Host("gpu02", 4), Host("gpu03", 2)]
    assert calls == [["scontrol", "show", "hostnames", "gpu[01-03]"]]
    env.pop("SLURM_TASKS_PER_NODE")
    assert slurm_hosts(env, scontrol) == [Host("gpu01", 1), Host("gpu02", 1), Host("gpu03", 1)]


def test_ranks_fill_slots_in_order():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert place(hosts, 6) == hosts
    assert place(hosts, 3) == [Host("a", 2), Host("b", 1)]
    assert place(hosts, 9) == hosts  # never more than the slots
    assert ranks_on(place(hosts, 5)) == {"a": "ranks 0-1", "b": "ranks 2-3", "c": "rank 4"}


def test_two_failed_launches_in_a_row_start_a_cooldown():
    health = Health(cooldown_s=100)
    # launch 0: ranks failed on b; launch 1: on b again -> b cools down until 10 + 100
    assert health.record(["a", "b", "c"], {"b"}, now=0) == []
    assert health.cooling(5) == {}
    assert health.record(["a", "b", "c"], {"b"}, now=10) == ["b"]
    assert health.cooling(60) == {"b": 50}
    assert health.cooling(110.5) == {}  # back after the cooldown, with a clean count
    assert health.record(["a", "b", "c"], {"b"}, now=120) == []


def test_a_success_in_between_or_a_launch_without_the_host_keeps_it_in():
    health = Health(cooldown_s=100)
    health.record(["a", "b"], {"a"}, now=0)
    health.record(["a", "b"], set(), now=1)  # a's ranks did fine: the count starts again
    assert health.record(["a", "b"], {"a"}, now=2) == []
    # a launch that did not use a neither clears nor adds to a's count
    health.record(["b"], {"b"}, now=3)
    assert health.record(["a", "b"], {"a"}, now=4) == ["a"]
    assert health.record(["a", "b"], {"b"}, now=5) == []  # b did fine at 4: its count started again
