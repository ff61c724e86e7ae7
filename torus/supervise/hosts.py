"""Which hosts a launch of torus-run may use, and how many ranks it starts.

Vocabulary: a *host* is a name the launcher reaches (hydra's ``-hosts``, srun's ``--nodelist``) with a number
of *slots* (ranks it may hold). Ranks fill each host's slots in turn, in the listed order (blocks of
consecutive ranks per host, hydra's ``host:slots`` placement).

- Sources of hosts: a hostfile (:func:`read_hostfile`; ``host[:slots]`` lines as hydra reads them, ``#``
  comments, slots 1 when left out), a discovery script run before every launch (:func:`discover`; Horovod's
  convention: it prints such lines), a Slurm allocation (:func:`slurm_hosts`), or this host alone.
- :class:`Health` keeps, per host, how many launches in a row its ranks failed, and leaves a host out for a
  cooldown once that reaches two. A host the launcher cannot reach is left out by the probe of that launch
  (torus/supervise/launch.py), not here: it is asked again before the next one.
- :func:`place` fills the usable hosts' slots in order up to the requested rank count.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

FAILURES_BEFORE_COOLDOWN = 2  # a host whose ranks failed in this many launches in a row is left out a while
_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")  # host names, IPv4 addresses, Slurm-style node names


class HostError(ValueError):
    """A host list that cannot be used; the message names where it came from (file and line)."""


class Host(NamedTuple):
    name: str
    slots: int


def parse(text: str, source: str) -> list[Host]:
    """The hosts of ``host[:slots]`` lines (hydra's hostfile format: blank lines and ``#`` comments skipped,
    slots 1 when left out). Raises :class:`HostError` naming ``source`` and the line: a bad name, slots that
    are not a whole number of at least 1, a host listed twice, or no host at all."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, colon, slots = line.partition(":")
        name, slots = name.strip(), slots.strip()
        where = f"{source}, line {lineno}: {raw.strip()!r}"
        if not _NAME.match(name):
            raise HostError(f"{where}: expected host[:slots], e.g. node1:4")
        if colon and not (slots.isdigit() and int(slots) >= 1):
            raise HostError(f"{where}: slots must be a whole number of at least 1")
        if name in seen:
            raise HostError(f"{where}: host {name} is already listed on line {seen[name]}")
        seen[name] = lineno
        hosts.append(Host(name, int(slots) if colon else 1))
    if not hosts:
        raise HostError(f"{source}: no hosts listed (expected host[:slots] lines)")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """The hosts of the hostfile at ``path`` (:func:`parse`); :class:`HostError` when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise HostError(f"--hostfile {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    return parse(text, f"--hostfile {path}")


def discover(script: str, timeout_s: float) -> list[Host]:
    """Run the discovery command ``script`` (split as a shell would, run without one) and parse what it prints
    on stdout (:func:`parse`). :class:`HostError` when it cannot start, runs past ``timeout_s`` seconds, exits
    non-zero (naming the status and its last line on stderr) or prints no valid host list."""
    what = f"--host-discovery-script {script}"
    try:
        done = subprocess.run(shlex.split(script), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise HostError(f"{what}: still ran after {timeout_s:g} s") from None
    except (OSError, ValueError) as e:
        raise HostError(f"{what}: cannot run it: {getattr(e, 'strerror', None) or e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output on stderr"])[-1]
        raise HostError(f"{what}: exit status {done.returncode}: {last}")
    return parse(done.stdout, f"{what} (its output)")


def in_slurm(env: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm allocation (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set)."""
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST"))


def tasks_per_node(text: str, nodes: int) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) as one count per node; :class:`HostError` when it is
    malformed or does not describe ``nodes`` nodes."""
    counts: list[int] = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not found or int(found.group(1)) < 1:
            raise HostError(f"SLURM_TASKS_PER_NODE={text!r}: expected counts like 2(x3),1")
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    if len(counts) != nodes:
        raise HostError(f"SLURM_TASKS_PER_NODE={text!r} describes {len(counts)} nodes, the allocation has {nodes}")
    return counts


def slurm_hosts(env: Mapping[str, str], run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                ) -> list[Host]:
    """The allocation's nodes (``scontrol show hostnames $SLURM_JOB_NODELIST``) with ``SLURM_TASKS_PER_NODE``
    slots each (1 when unset). :class:`HostError` when ``scontrol`` fails."""
    nodelist = env["SLURM_JOB_NODELIST"]
    try:
        done = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    except OSError as e:
        raise HostError(f"scontrol show hostnames {nodelist}: cannot run it: {e.strerror}") from None
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        last = (done.stderr.strip().splitlines() or ["no host names printed"])[-1]
        raise HostError(f"scontrol show hostnames {nodelist}: exit status {done.returncode}: {last}")
    slots = tasks_per_node(env["SLURM_TASKS_PER_NODE"], len(names)) if env.get("SLURM_TASKS_PER_NODE") \
        else [1] * len(names)
    return [Host(n, s) for n, s in zip(names, slots)]


def this_host(slots: int) -> Host:
    """This machine (the name hydra prints for it) with ``slots`` slots: the host list without a hostfile."""
    return Host(os.uname().nodename, slots)


def place(hosts: list[Host], ranks: int) -> list[Host]:
    """The hosts that receive ranks when ``ranks`` ranks fill ``hosts``' slots in order, each with the slots it
    fills (the last one possibly fewer than it has). Takes at most the hosts' total."""
    placed, left = [], ranks
    for host in hosts:
        if left <= 0:
            break
        placed.append(Host(host.name, min(host.slots, left)))
        left -= host.slots
    return placed


def ranks_on(placed: list[Host]) -> dict[str, str]:
    """``{host: "ranks 0-3"}`` (or ``"rank 4"``) for hosts filled in order (:func:`place`)."""
    named, first = {}, 0
    for host in placed:
        last = first + host.slots - 1
        named[host.name] = f"rank {first}" if last == first else f"ranks {first}-{last}"
        first = last + 1
    return named


@dataclass
class Health:
    """Per host: the launches in a row whose ranks failed there, and until when (``time.monotonic()``
    seconds) a host is left out after :data:`FAILURES_BEFORE_COOLDOWN` of them. Pure bookkeeping: the caller
    says which hosts a launch used and where it failed, and passes the clock."""
    cooldown_s: float
    streak: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)

    def record(self, launched: list[str], failed: set[str], now: float) -> list[str]:
        """Count one launch over ``launched``, whose ranks failed on ``failed`` (a host the probe could not
        reach counts as failed). Returns the hosts that start a cooldown now. A host that held no ranks in
        this launch keeps its count."""
        cooled = []
        for name in launched:
            self.streak[name] = self.streak.get(name, 0) + 1 if name in failed else 0
            if self.streak[name] >= FAILURES_BEFORE_COOLDOWN:
                self.until[name] = now + self.cooldown_s
                self.streak[name] = 0
                cooled.append(name)
        return cooled

    def cooling(self, now: float) -> dict[str, float]:
        """``{host: seconds of cooldown left}`` of the hosts left out at ``now``."""
        return {name: end - now for name, end in self.until.items() if end > now}
