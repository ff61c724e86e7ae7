"""What torus-run says on stderr: one line per restart, one line when it stops relaunching, and a summary.

Every line starts with ``torus-run: `` so that it stands out of the job's own output. The summary counts the
restarts, the hosts lost (left out of a launch at least once: unreachable or cooling down), the seconds lost
(from each failure's detection, its first line of output or the launcher's exit, to the relaunch) and the steps
redone, where the ranks report them: while a job runs, rank 0 prints ``torus-run: at step S`` (at most every
0.2 s, where ``TORUS_RUN_PROGRESS`` is set; torus-run reads these lines and does not show them) and a rank
that resumes prints ``torus-run: resumed at step S0``: S the newest step the failed launch reported, S0 the
step of the snapshot the relaunch continues from, so S - S0 steps are done again.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

PREFIX = "torus-run: "


def say(text: str, stream: TextIO | None = None) -> None:
    """One line, prefixed, flushed at once (the job's output goes through the same streams)."""
    stream = stream or sys.stderr
    stream.write(f"{PREFIX}{text}\n")
    stream.flush()


def left_out(unreachable: list[str], cooled: dict[str, float]) -> list[str]:
    """The clauses that name the hosts left out of the next launch: ``h3 left out`` for a host the probe
    could not reach (the reason says why) and ``h2 failed in 2 launches in a row, left out for 300 s``."""
    clauses = [f"{h} left out" for h in unreachable]
    clauses += [f"{h} failed in 2 launches in a row, left out for {s:.0f} s" for h, s in cooled.items()]
    return clauses


def restart_line(restart: int, max_restarts: int, reason: str, clauses: list[str], ranks: int,
                 hosts: list[str]) -> str:
    """``restart 1/3: <reason>; h3 left out; relaunching 4 ranks on h1,h2``."""
    parts = [f"restart {restart}/{max_restarts}: {reason}", *clauses,
             f"relaunching {ranks} rank{'s' if ranks != 1 else ''} on {','.join(hosts)}"]
    return "; ".join(parts)


@dataclass
class Summary:
    """The run so far: restarts, hosts lost (in order), seconds from each failure to its relaunch, and the
    steps redone per resumed launch (``None`` where a relaunched job did not say)."""
    restarts: int = 0
    hosts_lost: list[str] = field(default_factory=list)
    seconds_lost: float = 0.0
    redone: list[int | None] = field(default_factory=list)

    def restarted(self, hosts_left_out: list[str], seconds: float) -> None:
        self.restarts += 1
        self.seconds_lost += seconds
        self.hosts_lost += [h for h in hosts_left_out if h not in self.hosts_lost]

    def resumed(self, reached: int | None, resumed: int | None) -> None:
        """Record a relaunch: the newest step the failed launch reported, and the snapshot step the relaunch
        resumed at (either None where the job did not say)."""
        self.redone.append(None if reached is None or resumed is None else max(0, reached - resumed))

    def line(self, status: int) -> str:
        """``summary: 1 restart, hosts lost: h3, 2.30 s lost (from detecting the failure to the relaunch), 40 steps
        redone; exit status 0``."""
        if not self.restarts:
            return f"summary: no restart; exit status {status}"
        known = [r for r in self.redone if r is not None]
        if not self.redone or not known:
            steps = "steps redone not reported by the job"
        else:
            steps = f"{sum(known)} steps redone" + ("" if len(known) == len(self.redone) else
                                                   f" (reported by {len(known)} of {len(self.redone)} relaunches)")
        lost = ", ".join(self.hosts_lost) or "none"
        return (f"summary: {self.restarts} restart{'s' if self.restarts != 1 else ''}, hosts lost: {lost}, "
                f"{self.seconds_lost:.2f} s lost (from detecting the failure to the relaunch), {steps}; "
                f"exit status {status}")
