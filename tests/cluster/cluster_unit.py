"""The emulated cluster itself (run by tests/cluster/suites.py as root, one process): what ``up`` makes, that a
second ``up`` clears an earlier run's leftovers (processes included), and that ``down`` leaves nothing.
Its own name and subnet (torusu, 10.231.15.0/24). Budget: about 2 s.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cluster import Cluster, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no namespaces here: {unavailable()}")


def _out(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def cluster():
    c = Cluster(2, "100mbit", name="torusu", subnet=15)
    yield c
    c.down()


def test_up_twice_clears_leftovers_and_down_leaves_nothing(cluster):
    cluster.up()
    leftover = subprocess.Popen(["ip", "netns", "exec", cluster.namespace(2), "sleep", "600"])
    cluster.up()  # as after a crashed run: the old namespaces and what ran in them go first
    assert leftover.wait(timeout=10) == -9
    assert {cluster.namespace(1), cluster.namespace(2)} <= set(_out("ip", "netns", "list").split())
    cluster.down()
    assert not [n for n in _out("ip", "netns", "list").split() if n.startswith("torusu")]
    assert "torusu" not in _out("ip", "-o", "link", "show")


def test_hosts_reach_each_other_over_a_shaped_link_and_nothing_else(cluster):
    cluster.up()
    for h in (1, 2):
        ns = cluster.namespace(h)
        routes = _out("ip", "-n", ns, "route", "show").splitlines()
        # one route, to the cluster's own subnet: no default route out of it
        assert len(routes) == 1 and routes[0].startswith("10.231.15.0/24 dev eth0 "), routes
        assert "tbf" in _out("tc", "-n", ns, "qdisc", "show", "dev", "eth0")
        assert "rate 100Mbit" in _out("tc", "qdisc", "show", "dev", f"torusuv{h}")
    echo = "import socket; s = socket.create_server(('10.231.15.2', 5555)); c, _ = s.accept(); c.sendall(c.recv(5))"
    server = subprocess.Popen(["ip", "netns", "exec", cluster.namespace(2), sys.executable, "-c", echo])
    client = ("import socket, time\n"
              "for _ in range(100):\n"
              "    try: c = socket.create_connection(('10.231.15.2', 5555)); break\n"
              "    except OSError: time.sleep(0.05)\n"
              "c.sendall(b'hello'); print(c.recv(5).decode())")
    assert _out("ip", "netns", "exec", cluster.namespace(1), sys.executable, "-c", client).strip() == "hello"
    server.wait(timeout=10)
    assert [(pid, cmd) for procs in cluster.processes().values() for pid, cmd in procs] == []
