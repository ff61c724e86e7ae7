"""An emulated Slurm cluster: the hosts of :class:`tests.cluster.Cluster`, each running a ``slurmd``.

Each host's ``slurmd`` runs inside its network namespace and in a UTS namespace of its own (``unshare --uts``)
whose host name is the namespace's name: Debian's Slurm is no multiple-slurmd build (``slurmd -N`` refused),
and a node finds its entry in slurm.conf by its host name. ``slurmctld`` runs in the root namespace on the
bridge address (``.254``), under the machine's own host name, as do ``srun``, ``salloc`` and ``sbatch`` run
from here; jobs' steps reach it from inside the hosts. One ``munged`` (its own key and socket in the state
folder, so that a system munge is left alone) serves every daemon: a socket path works across network
namespaces. slurm.conf is written into the state folder (``/tmp/torus-cluster-<name>/slurm``) and named by
``SLURM_CONF`` in :meth:`SlurmCluster.env`; ports are the subnet's own, so that clusters coexist.

No cgroups (``proctrack/linuxproc``, ``task/none``): a container's cgroup tree is usually read-only. Every
host has as many CPUs as this machine (slurmd refuses a node configured with more than it finds), one task
slot per CPU; ranks oversubscribe the cores as the hydra clusters do.

:func:`slurm_unavailable` says why not (no packages, no namespaces); :meth:`SlurmCluster.down` kills the
daemons it started (by the pids in the state folder) and every process in the namespaces, then removes them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.cluster import Cluster, child_env, unavailable

PROGRAMS = ("slurmctld", "slurmd", "srun", "sbatch", "salloc", "scontrol", "sinfo", "munged", "unshare")
CONF = """\
ClusterName={name}
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
TmpFS={state}/nodetmp
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=30
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster cannot be made here (one line), or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return (f"no {', '.join(missing)} (Debian: apt-get install -y slurmctld slurmd slurm-client munge)")
    return unavailable()


def _which(program: str) -> str:
    return shutil.which(program) or str(Path("/usr/sbin", program))


class SlurmCluster(Cluster):
    """``hosts`` emulated hosts as Slurm nodes ``<name>1..<name>K`` in one partition ``main``."""

    def __init__(self, hosts: int, rate: str | None = None, name: str = "toruss", subnet: int = 30):
        super().__init__(hosts, rate, name, subnet)
        self.slurm = self.state / "slurm"
        self.conf = self.slurm / "slurm.conf"
        self.munge_socket = self.slurm / "munge" / "munge.socket"
        self.cpus = os.cpu_count() or 1

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process' environment) without any Slurm job's variables, with SLURM_CONF."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        return dict(env, SLURM_CONF=str(self.conf))

    def job_env(self, **extra: str) -> dict:
        """The environment for ``srun``/``sbatch``/``salloc`` from here: :func:`tests.cluster.child_env` with
        SLURM_CONF, and TCP between hosts (UCX would find shared memory across the namespaces, as under
        hydra), and ``MALLOC_PERTURB_=255`` (docs/clusters.md, "Slurm": with it malloc hands out zeroed bytes, and
        MPICH's address lines stay within what Slurm's pmi2 plugin reads in one go); srun passes it on to every
        task (``--export=ALL``)."""
        return self.env(child_env(UCX_TLS="tcp,self", MALLOC_PERTURB_="255", **extra))

    def node(self, host: int) -> str:
        """Host ``host``'s Slurm node name (its namespace's name and its host name inside)."""
        return self.namespace(host)

    # ------------------------------------------------------------------ life cycle
    def _make(self) -> None:
        super()._make()
        state = json.loads((self.state / "state.json").read_text())
        (self.state / "state.json").write_text(json.dumps(dict(state, slurm=True)))
        (self.slurm / "ctld").mkdir(parents=True)
        for h in range(1, self.hosts + 1):
            (self.slurm / "spool" / self.node(h)).mkdir(parents=True)
            (self.slurm / "nodetmp" / self.node(h)).mkdir(parents=True)
        munge = self.munge_socket.parent
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "\n".join(f"NodeName={self.node(h)} NodeAddr={self.address(h)} CPUs={self.cpus} State=UNKNOWN"
                          for h in range(1, self.hosts + 1))
        self.conf.write_text(CONF.format(
            name=self.name, ctl=socket.gethostname().split(".")[0], ctl_addr=self.address(254),
            ctl_port=17000 + self.subnet, d_port=18000 + self.subnet, munge_socket=self.munge_socket,
            state=self.slurm, nodes=nodes))
        self._daemon("munged", [_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                                f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._daemon("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        tmp = self.slurm / "nodetmp"
        for h in range(1, self.hosts + 1):
            # a UTS namespace of its own: slurmd finds its node by host name, and so do the ranks' MPI
            # nsenter, not ip netns exec: that remounts /sys, without the cgroup tree slurmd insists on reading
            self._daemon(f"slurmd-{h}", [
                "nsenter", f"--net=/run/netns/{self.namespace(h)}", "unshare", "--uts", "--mount", "sh", "-c",
                f"hostname {self.node(h)} && mount --bind {tmp}/{self.node(h)} {tmp} && "
                f"exec {_which('slurmd')} -D -f {self.conf}"])
        self._wait(self._all_idle, "every node idle in sinfo", 60)

    def _daemon(self, label: str, cmd: list[str]) -> None:
        log = open(self.slurm / f"{label}.out", "ab")  # noqa: SIM115 (the daemon keeps it)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env(), start_new_session=True)
        log.close()
        (self.slurm / f"{label}.daemon").write_text(str(proc.pid))

    def _wait(self, ready, what: str, limit_s: float = 20) -> None:
        deadline = time.monotonic() + limit_s
        while not ready():
            if time.monotonic() > deadline:
                logs = "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-1500:]
                               for p in sorted(self.slurm.glob("*.out")) + sorted(self.slurm.glob("*.log")))
                raise RuntimeError(f"slurm cluster {self.name}: no {what} after {limit_s:.0f} s{logs}")
            time.sleep(0.2)

    def _all_idle(self) -> bool:
        return sorted(self.sinfo().values()) == ["idle"] * self.hosts

    def sinfo(self) -> dict[str, str]:
        """``{node: state}`` as slurmctld sees them (``{}`` when it does not answer)."""
        done = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                              env=self.env(), timeout=30, check=False)
        rows = [line.split() for line in done.stdout.splitlines() if line.strip()]
        return {row[0]: row[1] for row in rows if len(row) == 2} if done.returncode == 0 else {}

    def down(self) -> None:
        """Stop the daemons started here (slurmd with everything else in the namespaces), then the network."""
        slurm = self.state / "slurm"
        for daemon in sorted(slurm.glob("*.daemon")) if slurm.is_dir() else []:
            try:
                os.killpg(int(daemon.read_text()), signal.SIGKILL)  # each in a session of its own
            except (ProcessLookupError, ValueError):
                pass
        super().down()

    # ------------------------------------------------------------------ launching
    def command(self, program: str, *args: str) -> list[str]:
        """``srun``/``sbatch``/``salloc``/``scontrol``... with ``args`` (run it with :meth:`env`)."""
        return [_which(program), *args]
