"""The flight recorder (issue 43): with ``TORUS_RECORDER=K`` every rank keeps its last K collective calls of
each ``TorusComm`` in memory, and writes them to a file when something goes wrong, so that ``torus.doctor``
can name the rank that fell behind and the call where the ranks parted. Off by default: its cost at 64 KiB is
over the bound issue 43 sets (bench/flight_recorder/README.md).

A record (one call): the call's sequence number on its communicator (1, 2, ...: the same call has the same
number on every rank while the ranks agree), the operation, count (elements) and dtype, the algorithm and
its transport, who called (``caller``: the Keras layer names its gradient bucket or all-reduce; else
"user"), wall-clock start and end (``time.time()``: comparable across hosts as far as their clocks agree),
its state (running, done, failed) and, for a failure, the error's message (a stall timeout's names the step
reached and the peer waited on).

Dumps (:func:`dump`) go to ``TORUS_TRACE_DIR`` (default: the working directory) as
``torus-trace-rank<R>.json`` (``R`` the rank in ``MPI.COMM_WORLD``), rewritten atomically by each dump:
on a stall timeout (``TorusComm``: then the first rank of each communicator and node to get there waits
``GATHER_S`` for the others' dumps and prints :func:`torus.doctor.diagnose`'s lines on stderr), on an
uncaught exception under ``torus.faults.abort_on_exception``, and on ``SIGUSR1`` (installed with the first
recording recorder where the main thread has no handler of its own; the job goes on). A rank stopped
(``SIGSTOP``) or blocked in C code outside torus writes nothing: the others' records still name it.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import threading
import time
import weakref
from pathlib import Path

from mpi4py import MPI

from torus import knobs

GATHER_S = 1.5  # the diagnosing rank waits this long for its peers' dumps (they time out at about the same time)


class _Caller(threading.local):
    value = "user"  # a class default: a missing attribute of a thread-local would cost an exception per call


caller = _Caller()  # .value: who makes the calls on this thread (the Keras layer sets it)
_recorders: weakref.WeakSet = weakref.WeakSet()
_signal_installed = False

# fields of a record, in order (a list per call: cheaper than an object)
SEQ, OP, COUNT, DTYPE, ALGORITHM, CALLER, START, END, STATE, ERROR = range(10)
FIELDS = ("seq", "op", "count", "dtype", "algorithm", "caller", "start", "end", "state", "error")


def transport(algorithm: str) -> str:
    """How a call's data moves, by its algorithm."""
    return {"shm": "shared memory", "native": "MPI's own collective"}.get(algorithm, "MPI point-to-point plan")


class Recorder:
    """The last ``capacity`` calls of one communicator (``TorusComm``: ``self.recorder``). ``comm`` is the
    TorusComm's duplicate of the caller's communicator; collective to create (one broadcast: the id that names
    this communicator in every rank's dump)."""

    def __init__(self, comm: MPI.Intracomm, capacity: int | None = None, node: int = 0):
        self.capacity = int(knobs.read("TORUS_RECORDER") if capacity is None else capacity)
        self.comm_id = comm.bcast(secrets.token_hex(4) if comm.Get_rank() == 0 else None, root=0)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.world_ranks = comm.Get_group().Translate_ranks(list(range(self.size)), MPI.COMM_WORLD.Get_group())
        self.seq = 0
        self._ring: list = [None] * max(self.capacity, 1)
        self.node = node  # one diagnosis per node: a cut host's lines may never reach mpiexec
        self.diagnosed = False
        _recorders.add(self)
        if self.capacity:
            _install_signal()

    def begin(self, op: str, count: int, dtype, algorithm: str) -> list:
        """A new call (``dtype``: a numpy dtype, named at the dump); the caller checks ``capacity`` first. The
        record is a list, and ``end`` / ``fail`` complete it (the cost: bench/flight_recorder/README.md)."""
        seq = self.seq = self.seq + 1
        record = [seq, op, count, dtype, algorithm, caller.value, time.time(), None, "running", None]
        self._ring[seq % self.capacity] = record
        return record

    def records(self) -> list[dict]:
        """The calls held, oldest first."""
        held = sorted((r for r in self._ring if r is not None), key=lambda r: r[SEQ])
        return [dict(zip(FIELDS, r), dtype=str(r[DTYPE]), transport=transport(r[ALGORITHM])) for r in held]

    def state(self) -> dict:
        return {"comm_id": self.comm_id, "rank": self.rank, "size": self.size, "world_ranks": self.world_ranks,
                "calls": self.seq, "records": self.records()}


def end(record: list) -> None:
    record[END], record[STATE] = time.time(), "done"


def fail(record: list, exc: BaseException) -> None:
    record[END], record[STATE], record[ERROR] = time.time(), "failed", f"{type(exc).__name__}: {exc}"


def trace_dir() -> Path:
    return Path(knobs.read("TORUS_TRACE_DIR") or os.getcwd())


def dump(reason: str) -> Path | None:
    """Write this process' records (every live recorder) to its trace file; returns the path, or None where
    nothing is recorded or the file cannot be written (a dump must never add an error of its own)."""
    recorders = [r for r in list(_recorders) if r.capacity]
    if not recorders:
        return None
    world = MPI.COMM_WORLD.Get_rank()
    path = trace_dir() / f"torus-trace-rank{world}.json"
    state = {"world_rank": world, "world_size": MPI.COMM_WORLD.Get_size(), "host": socket.gethostname(),
             "pid": os.getpid(), "reason": reason, "time": time.time(),
             "communicators": [r.state() for r in sorted(recorders, key=lambda r: r.comm_id)]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        say(f"torus: rank {world} could not write its flight record to {path}: {e}")
        return None
    return path


def on_stall(recorder: Recorder, exc: BaseException) -> None:
    """A call of ``recorder``'s communicator timed out on this rank: dump, and where this is the first rank of
    the communicator on its node to get here (an exclusive file in the trace folder), wait ``GATHER_S`` for
    the other ranks' dumps, then print the diagnosis of every dump there."""
    path = dump(f"stall timeout: {exc}")
    if path is None or recorder.diagnosed:
        return
    recorder.diagnosed = True
    lock = path.parent / f".torus-diagnosis-{recorder.comm_id}-node{recorder.node}"
    done = lock.with_name(lock.name + ".done")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        # another rank of this communicator diagnoses: wait for it (bounded), since this rank's abort would end
        # that rank before it prints
        deadline = time.monotonic() + GATHER_S + 2.0
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    time.sleep(GATHER_S)
    from torus import doctor
    try:
        lines = doctor.diagnose(doctor.load(path.parent), comm_id=recorder.comm_id)
    except Exception as e:  # noqa: BLE001 - the diagnosis is a courtesy: never hide the timeout behind it
        lines = [f"torus doctor: no diagnosis ({type(e).__name__}: {e})"]
    say("\n".join(lines) + f"\n(the flight records: {path.parent}/torus-trace-rank*.json; "
         f"python -m torus.doctor {path.parent})")
    try:
        done.touch()
    except OSError:
        pass


def _on_sigusr1(signum, frame) -> None:
    path = dump("SIGUSR1")
    if path is not None:
        say(f"torus: rank {MPI.COMM_WORLD.Get_rank()} wrote its flight record to {path} (SIGUSR1)")


def _install_signal() -> None:
    global _signal_installed
    if _signal_installed or threading.current_thread() is not threading.main_thread():
        return
    _signal_installed = True
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR1, _on_sigusr1)


def say(line: str) -> None:
    """``line`` on stderr in one ``os.write``: no Python buffer or lock that another thread (or an interrupted
    print) may hold (torus.faults writes its last lines so too)."""
    try:
        os.write(2, (line + "\n").encode(errors="replace"))
    except OSError:
        pass
