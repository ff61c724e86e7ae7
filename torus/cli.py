"""What torus' command-line tools (torus-bench, torus-sim, torus-train) share when every rank of an MPI job
runs the same command line.

- A usage error is one line, ``prog: error: message``, from rank 0 only, and every rank exits with status 2
  (argparse's own convention); ``--help`` prints once. The rank comes from the launcher's environment, so a
  bad argument needs neither MPI nor any import beyond argparse.
- A failure that every rank reaches at the same point (a bad grid, an unreadable data folder) is gathered into
  one line naming the failing ranks, printed by rank 0 (:func:`agree`, :class:`JobError`).
- A failure on some ranks only, in the middle of the run, is one line from each failing rank, then
  ``MPI_Abort`` ends the job (:func:`abort_on_error`; a stall timeout, a lost peer, with
  ``faults.PEER_LOST_EXIT`` so that torus-run relaunches); ``--debug`` adds the tracebacks.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from pathlib import Path

USAGE = 2  # exit status of a usage error (argparse's)
FAILED = 1  # exit status of a run that failed

_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launcher_rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD`` as the launcher announced it (hydra's ``PMI_RANK``, Open MPI's
    ``OMPI_COMM_WORLD_RANK``, PMIx, MVAPICH), read without starting MPI; 0 outside ``mpiexec``."""
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def usage_error(prog: str, message: str):
    """Print ``prog: error: message`` on rank 0 and exit with status 2 on every rank."""
    if launcher_rank() == 0:
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    sys.exit(USAGE)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and adds ``(default: X)`` once, only where the help does not
    already say it and the default is a value (not None or a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default is argparse.SUPPRESS \
                or action.nargs == 0 or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"(default: {default})"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for a command that every rank runs: help and errors come from rank 0 only,
    and an error is one line (argparse prints the usage block before it; ``--help`` has it)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def _print_message(self, message, file=None):
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        usage_error(self.prog, f"{message} (see {self.prog} --help)")


def writable_file(flag: str, path: str | None) -> str | None:
    """The error text when ``path`` (the value of ``flag``) cannot be created: its folder is missing or not
    writable, or it names a folder; None when it can (or when ``path`` is None)."""
    if path is None:
        return None
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        return f"{flag} {path}: is a folder, expected a file name"
    if not folder.is_dir():
        return f"{flag} {path}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{flag} {path}: folder {folder} is not writable"
    return None


def parse_dims(text: str, size: int | None = None) -> tuple[int, int]:
    """``"XxY"`` as ``(X, Y)``, both >= 1, with ``X * Y == size`` when ``size`` is given; ``ValueError``
    (naming the value and what was expected) otherwise."""
    try:
        x, y = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--dims {text!r}: expected XxY, e.g. 2x2") from None
    if x < 1 or y < 1:
        raise ValueError(f"--dims {text}: both sides must be at least 1")
    if size is not None and x * y != size:
        raise ValueError(f"--dims {text}: {x}x{y} = {x * y} ranks, but this job has {size}")
    return x, y


class JobError(Exception):
    """A failure gathered from every rank by :func:`agree`; ``str()`` is the one summary line."""


def _summary(what: str, errors: list[str | None]) -> str:
    """``what failed on rank(s) 0, 1: Error: message`` with each distinct message once (rank numbers inside
    the messages are read as 'rank N' so that the same error on every rank reads as one)."""
    groups: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error is not None:
            groups.setdefault(re.sub(rf"\brank {rank}\b", "rank N", error), []).append(rank)
    ranks = sorted(r for rs in groups.values() for r in rs)
    every = "every rank" if len(ranks) == len(errors) > 1 else \
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if len(groups) == 1:
        return f"{what} failed on {every}: {next(iter(groups))}"
    return f"{what} failed on {every}: " + "; ".join(
        f"[rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}] {e}" for e, rs in groups.items())


def agree(comm, what: str, fn, *, debug: bool = False, catch=(Exception,)):
    """Run ``fn()`` on every rank of ``comm``, then agree (one ``allgather``) on whether it failed anywhere.

    Returns ``fn()``'s result when it succeeded on every rank; otherwise raises :class:`JobError` on every rank
    with one line naming the failing ranks and their errors. Only for steps that every rank reaches (no
    collective inside ``fn`` that a failing rank could skip). ``debug`` prints each failing rank's traceback."""
    try:
        result, error = fn(), None
    except catch as exc:
        if debug:
            traceback.print_exc()
        result, error = None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    errors = comm.allgather(error)
    if any(e is not None for e in errors):
        raise JobError(_summary(what, errors))
    return result


def abort_on_error(comm, prog: str, debug: bool = False) -> None:
    """Make an uncaught exception on this rank print one line, ``prog: rank R failed: Error: message`` (and the
    traceback with ``debug``), then end the whole job with ``MPI_Abort``: the other ranks may be waiting for this
    one in a collective. Replaces ``torus.faults.abort_on_exception``'s traceback-first report for CLIs."""

    def hook(exc_type, exc, tb):
        sys.stdout.flush()
        if debug:
            traceback.print_exception(exc_type, exc, tb)
        hint = "" if debug else " (--debug shows the traceback)"
        sys.stderr.write(f"{prog}: rank {comm.Get_rank()} failed: {exc_type.__name__}: "
                         f"{' '.join(str(exc).split())}{hint}\n")
        sys.stderr.flush()
        if comm.Get_size() > 1:
            time.sleep(0.5)  # let the launcher forward the line before Abort tears the job down
            from torus import faults
            if issubclass(exc_type, KeyboardInterrupt):
                comm.Abort(130)
            comm.Abort(faults.PEER_LOST_EXIT if faults.peer_lost(exc_type, exc) else FAILED)  # torus-run relaunches

    sys.excepthook = hook


def report(comm, prog: str, error: JobError) -> int:
    """Print a gathered failure once (rank 0) and return the exit status every rank should leave with."""
    if comm.Get_rank() == 0:
        sys.stdout.flush()
        sys.stderr.write(f"{prog}: error: {error}\n")
        sys.stderr.flush()
    return FAILED
