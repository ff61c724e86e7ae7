"""An emulated cluster on one Linux machine: K hosts as network namespaces on one bridge, launched by hydra.

Each host ``i`` (1..K) is a namespace ``<name><i>`` whose ``eth0`` (one end of a veth pair, the other end on
the bridge ``<name>br``) has the address ``10.231.<subnet>.<i>/24``; the bridge holds ``.254`` in the root
namespace, where ``mpiexec`` runs. The namespaces have no default route: from inside, only the other hosts,
the bridge address and their own loopback are reachable. ``rate`` (``tc tbf``, e.g. ``"2gbit"``) shapes each
host's link in both directions, with a bucket of ``BURST_SECONDS`` of data (1 ms; ``TORUS_CLUSTER_BURST_S``
sets another, e.g. 0.01 for the 10 ms of the figures taken before 2026-12-01 16:00) (this kernel has no
``netem``: no delay or loss).

hydra launches through an ssh stand-in (``nslaunch``, written at :meth:`Cluster.up`) that runs the proxy
command inside the host's namespace with ``ip netns exec``. MPICH's UCX netmod would find shared memory
between namespaces (same kernel), so :meth:`Cluster.mpiexec` forces TCP between hosts (``UCX_TLS=tcp,self``);
ranks of one host still use MPICH's own shared memory. ``COMM_TYPE_SHARED`` follows hydra's host list, so
every host is a real node to MPI and torus.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): :func:`unavailable` says why not. :meth:`Cluster.up` first
removes leftovers of the same name (an earlier crashed run), and :meth:`Cluster.down` kills every process
left inside the namespaces, by pid, before deleting them (deleting a namespace does not kill its processes).
Used as a context manager the cluster is torn down on exit, on an exception, at interpreter exit and on
SIGTERM/SIGHUP.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "10.231"
# tbf's bucket: what a host may send above the rate after a pause. A real link never runs faster than its
# rate, so the bucket is kept to about a millisecond of data (at least one 64 KiB GSO packet, which tbf
# would otherwise split): with 10 ms of data, 256 KiB all-reduces between shuffled benchmark calls ran
# from a full bucket, above the link's rate, CPU-bound on this machine rather than link-bound
# (bench/across_hosts/README.md, "The one cell auto missed").
BURST_SECONDS = float(os.environ.get("TORUS_CLUSTER_BURST_S", "1e-3"))
BURST_MIN_BYTES = 64 << 10
BRIDGE_HOST = 254
STATE_ROOT = Path("/tmp")
NSLAUNCH = """#!/bin/sh
# ssh stand-in for hydra's ssh launcher: nslaunch [ssh options] HOST COMMAND...
# runs COMMAND inside HOST's network namespace (written by tests/cluster for cluster {name!r})
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
host=$1; shift
case "$host" in
{cases}
  *) echo "nslaunch: $host is no host of cluster {name}" >&2; exit 255;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"'{' '.join(cmd)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh("ip", *args, check=check)


def unavailable() -> str | None:
    """Why a cluster cannot be made here (one line), or None when it can: tries a throwaway namespace."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2)"
    probe = f"torusprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return (f"'ip netns add' refused: {made.stderr.strip() or made.returncode} "
                "(needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """``hosts`` emulated hosts named ``<name>1..<name>K`` at ``10.231.<subnet>.1..K``.

    ``rate``: a ``tc`` rate (``"2gbit"``, ``"500mbit"``) applied to each host's link both ways, or None.
    ``name`` (at most 10 characters: interface names are limited to 15) and ``subnet`` (0-255) let two
    clusters coexist; the test harness uses its own. Raises ``ValueError`` on bad arguments and
    ``RuntimeError`` when a network command fails (after tearing down what was made)."""

    def __init__(self, hosts: int, rate: str | None = None, name: str = "torusc", subnet: int = 13):
        if not 1 <= hosts <= 250:
            raise ValueError(f"Cluster: hosts must be in 1..250, got {hosts}")
        if not (name.isalnum() and name.islower() and 1 <= len(name) <= 10):
            raise ValueError(f"Cluster: name must be 1-10 lowercase letters or digits, got {name!r}")
        if not 0 <= subnet <= 255:
            raise ValueError(f"Cluster: subnet must be in 0..255, got {subnet}")
        if rate is not None:
            _bits(rate)
        self.hosts, self.rate, self.name, self.subnet = hosts, rate, name, subnet
        self.bridge = f"{name}br"
        self.state = STATE_ROOT / f"torus-cluster-{name}"
        self.nslaunch = self.state / "nslaunch"
        self._atexit = False

    # ------------------------------------------------------------------ names
    def namespace(self, host: int) -> str:
        """The namespace of host ``host`` (1-based)."""
        return f"{self.name}{host}"

    def address(self, host: int) -> str:
        return f"{PREFIX}.{self.subnet}.{host}"

    def host_of(self, address: str) -> int:
        return int(address.rsplit(".", 1)[1])

    @property
    def addresses(self) -> list[str]:
        return [self.address(h) for h in range(1, self.hosts + 1)]

    # ------------------------------------------------------------------ life cycle
    def up(self) -> Cluster:
        """Make the bridge, the namespaces, their links and rate limits, and the ssh stand-in. Idempotent:
        leftovers of a cluster of this name (any size) are removed first."""
        self.down()
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.address(BRIDGE_HOST)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in range(1, self.hosts + 1):
            ns, outer = self.namespace(h), f"{self.name}v{h}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                burst = str(max(BURST_MIN_BYTES, int(_bits(self.rate) / 8 * BURST_SECONDS)))
                for dev, where in ((outer, ()), ("eth0", ("-n", ns))):
                    _sh("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
                        "burst", burst, "latency", "50ms")
        self.state.mkdir(parents=True, exist_ok=True)
        cases = "\n".join(f"  {self.address(h)}|{self.namespace(h)}) ns={self.namespace(h)};;"
                          for h in range(1, self.hosts + 1))
        self.nslaunch.write_text(NSLAUNCH.format(name=self.name, cases=cases))
        self.nslaunch.chmod(0o755)
        (self.state / "state.json").write_text(json.dumps(
            {"hosts": self.hosts, "rate": self.rate, "name": self.name, "subnet": self.subnet}))

    def down(self) -> None:
        """Kill every process inside this cluster's namespaces, delete them and the bridge. Safe to call
        when nothing (or only part) is there."""
        for ns in self._existing_namespaces():
            self.kill_all(ns)
            _ip("netns", "del", ns, check=False)
        # a namespace is destroyed asynchronously, and its veth pairs with it: delete our ends now, so that a
        # following up() can reuse the names at once
        for link in _ip("-o", "link", "show", "type", "veth", check=False).stdout.splitlines():
            dev = link.split(":")[1].strip().split("@")[0]
            if dev.startswith(f"{self.name}v") and dev[len(self.name) + 1:].isdigit():
                _ip("link", "del", dev, check=False)
        if _ip("link", "show", self.bridge, check=False).returncode == 0:
            _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.state, ignore_errors=True)

    def _existing_namespaces(self) -> list[str]:
        listed = _ip("netns", "list", check=False).stdout.split()
        # names are <name><digits>; another cluster's name may share a prefix, so match the digits exactly
        return [n for n in listed if n.startswith(self.name) and n[len(self.name):].isdigit()]

    def kill_all(self, ns: str) -> None:
        """SIGKILL every process in namespace ``ns`` until none is left."""
        for _ in range(50):
            pids = self.pids(ns)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"cluster {self.name}: processes {self.pids(ns)} in {ns} survive SIGKILL")

    def __enter__(self):
        if not self._atexit:
            atexit.register(self.down)
            self._atexit = True
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    signal.signal(sig, _exit_on_signal)
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ what runs inside
    @staticmethod
    def pids(ns: str) -> list[int]:
        """Pids of the processes in namespace ``ns`` (empty when it does not exist)."""
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in out]

    def processes(self) -> dict[str, list[tuple[int, str]]]:
        """``{namespace: [(pid, command line), ...]}`` of everything running inside the cluster."""
        found = {}
        for h in range(1, self.hosts + 1):
            ns = self.namespace(h)
            found[ns] = [(pid, _cmdline(pid)) for pid in self.pids(ns)]
        return found

    # ------------------------------------------------------------------ faults
    def cut(self, host: int) -> None:
        """Take host ``host``'s link down (from inside: the host loses the network, not its loopback)."""
        _ip("-n", self.namespace(host), "link", "set", "eth0", "down")

    def restore(self, host: int) -> None:
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up")

    # ------------------------------------------------------------------ launching
    def mpiexec(self, ppn: int = 1, mpiexec: str | None = None, round_robin: bool = False) -> list[str]:
        """The ``mpiexec`` command line (up to the program) for ``ppn`` ranks per host, in blocks: ranks
        ``0..ppn-1`` on host 1, and so on; ``round_robin``: dealt out one per host in turn (hydra's ``-hosts
        h1,h2,...`` without slots: rank ``r`` on host ``r % hosts + 1``). Append ``-n N`` (at most
        ``hosts * ppn``) and the program."""
        exe = mpiexec or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
        hosts = ",".join(a if round_robin else f"{a}:{ppn}" for a in self.addresses)
        # TORUS_CLUSTER_*: what torus-bench records of the emulation (torus/bench/report.py); torus reads no
        # other meaning into them
        return [exe, "-launcher", "ssh", "-launcher-exec", str(self.nslaunch), "-iface", self.bridge,
                "-hosts", hosts, "-genv", "UCX_TLS", "tcp,self", "-genv", "TORUS_CLUSTER_HOSTS", str(self.hosts),
                "-genv", "TORUS_CLUSTER_PPN", str(ppn), "-genv", "TORUS_CLUSTER_RATE", self.rate or "unshaped",
                "-genv", "TORUS_CLUSTER_PLACEMENT", "round_robin" if round_robin else "blocks"]


def from_state(name: str = "torusc") -> Cluster:
    """The cluster of this name that ``up`` left running (``FileNotFoundError`` when there is none)."""
    state = json.loads((STATE_ROOT / f"torus-cluster-{name}" / "state.json").read_text())
    if state.get("slurm"):
        from tests.cluster.slurm import SlurmCluster
        return SlurmCluster(state["hosts"], state["rate"], state["name"], state["subnet"])
    return Cluster(state["hosts"], state["rate"], state["name"], state["subnet"])


def child_env(**extra: str) -> dict:
    """This process' environment for an ``mpiexec`` child: without this job's PMI/hydra variables (the child
    would join this job) and without TORUS_RANKS_PER_NODE (nodes must come from the hosts)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL")) and k != "TORUS_RANKS_PER_NODE"}
    env.setdefault("TORUS_TRACE_DIR", os.path.join(tempfile.gettempdir(), "torus-traces"))  # not the checkout
    return dict(env, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **extra)


def _bits(rate: str) -> int:
    units = {"kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"Cluster: rate {rate!r} is not <number>kbit|mbit|gbit")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _exit_on_signal(signum, frame):
    sys.exit(128 + signum)  # runs atexit (the teardown)
