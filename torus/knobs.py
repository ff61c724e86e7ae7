"""Every ``TORUS_*`` environment variable torus reads: one table (name -> default, type, doc line) and ``read``.

Code under torus/ and integrations/ reads a variable only through ``read(name)`` (tests/test_knobs.py checks
it), so that one table says what can be set, and docs/knobs.md is generated from it
(``python -m torus.knobs``; the same test checks the file is current). Values are read at each call, so a
variable set before the first use counts; a few are read once at import, which the doc line says.

``read`` returns the default for an unset or empty variable; types: ``int``, ``float``, ``str`` (the text,
stripped: the caller parses where it has a better error message), ``flag`` (0/1, false/true, off/on, no/yes, any
case). A value that does not parse raises ValueError naming the variable. ``build`` knobs are read by setup.py
(which runs before this package exists) and listed here so that the docs list them too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

FLAGS = {"0": False, "false": False, "off": False, "no": False, "1": True, "true": True, "on": True, "yes": True}


@dataclass(frozen=True)
class Knob:
    default: object
    type: str  # int, float, str, flag
    doc: str
    build: bool = False  # read by setup.py at build time, not by the package


KNOBS: dict[str, Knob] = {
    # collectives (TorusComm's defaults; its arguments win)
    "TORUS_ALGO": Knob("auto", "str", "what `algorithm=\"auto\"` runs: `auto` (the table of torus/select.py) or "
                       "`ring`, `torus2d`, `hierarchical`, `native`, `shm`, `swing`, `swing_latency` or another "
                       "algorithm registered in torus/schedules/registry.py; read when a call shape is first seen"),
    "TORUS_SWING_LATENCY_BYTES": Knob(0, "int", "`swing` all-reduces up to this many bytes run the "
                                      "latency-optimal form (`swing_latency`), larger ones the bandwidth-optimal "
                                      "one (0: 96 us on the link between nodes, 12 kB at 1 Gbit/s; 8 KiB on one "
                                      "node; negative: never)"),
    "TORUS_SEGMENT_BYTES": Knob(0, "int", "segment size in bytes (0: 1 MiB on one node, 256 KiB across nodes)"),
    "TORUS_TIMEOUT": Knob(600.0, "float", "stall timeout in seconds of every collective (0 waits forever)"),
    "TORUS_CHECK": Knob(True, "flag", "compare every call's signature across ranks first (MismatchError)"),
    "TORUS_RANKS_PER_NODE": Knob(0, "int", "emulate nodes of this many consecutive ranks (0: the real nodes)"),
    "TORUS_SHM_PHASES": Knob(True, "flag", "across nodes, run the node-level phases of hierarchical and torus2d "
                             "over shared memory"),
    "TORUS_LINK_GBITS": Knob("", "str", "the link speed between nodes in Gbit/s, instead of measuring it"),
    "TORUS_GPU_REDUCE": Knob(None, "flag", "reduce GPU arrays on the GPU (1) or staged on the host (0); unset: "
                             "by size"),
    "TORUS_NUM_THREADS": Knob(0, "int", "OpenMP threads of the host kernels, read at import (unset: TorusComm "
                              "divides the CPUs among the machine's ranks)"),
    "TORUS_C_LOOP": Knob(True, "flag", "run the step loop in C (0: the Python loop)"),
    # the shared-memory transport (torus/runtime/shm.py)
    "TORUS_SHM_WHOLE_BYTES": Knob(16 << 10, "int", "all-reduces up to this many bytes take the one-step path; "
                                  "read at import"),
    "TORUS_SHM_STREAM_BYTES": Knob(128 << 20, "int", "outputs from this many bytes are copied out with "
                                   "non-temporal stores; read at import"),
    "TORUS_SHM_YIELDS": Knob(64, "int", "with more ranks than cores: yields of the core before a wait sleeps"),
    # faults (torus/faults.py)
    "TORUS_ABORT_TIMEOUT": Knob(10.0, "float", "seconds a failing rank waits for MPI_Abort before ending itself"),
    "TORUS_RECORDER": Knob(0, "int", "calls each communicator's flight recorder keeps per rank, e.g. 64 (0: "
                           "off, the default, for its cost: bench/flight_recorder/README.md; torus/recorder.py)"),
    "TORUS_TRACE_DIR": Knob("", "str", "folder of the flight records (torus-trace-rank<R>.json; unset: the "
                            "working directory)"),
    "TORUS_ABORT_ON_STALL": Knob(True, "flag", "a stall timeout left uncaught ends the whole job (MPI_Abort, "
                                 "status 75) in library use too (0: only the exit watchdog)"),
    "TORUS_LEFT_GRACE": Knob(5.0, "float", "seconds an MPI wait goes on after a peer's Python exited; read at "
                             "import"),
    # the communication thread (torus/runtime/progress.py)
    "TORUS_COMM_NICE": Knob(-10, "int", "nice increment of the communication thread, where allowed"),
    "TORUS_COMM_POLL_US": Knob(200.0, "float", "microseconds the communication thread sleeps between polls"),
    "TORUS_TIMELINE": Knob("", "str", "write a Chrome trace of every fit to this file"),
    # Keras (torus.integrations.keras)
    "TORUS_OVERLAP": Knob("", "str", "gradient all-reduce behind backprop: 0/1 (off/on, ...); unset: on across "
                          "nodes only"),
    "TORUS_BUCKET_BYTES": Knob("", "str", "cap in bytes of a gradient bucket, which ramp up to it from 1 MiB "
                               "(unset: 25 MiB)"),
    "TORUS_CACHE": Knob("", "str", "folder of torus-train's digits data set (unset: ~/.cache/torus)"),
    "TORUS_CHECKPOINT_SLEEP": Knob("", "str", "tests only: `SECONDS@EPOCH` pauses a checkpoint write halfway"),
    # snapshots for recovery (torus/snapshot)
    "TORUS_SNAPSHOT_DIR": Knob("", "str", "folder of the recovery snapshots, one subfolder per job; storage local "
                               "to the node (unset: ~/.cache/torus/snapshots)"),
    "TORUS_SNAPSHOT_STEPS": Knob(500, "int", "snapshot every this many steps or `TORUS_SNAPSHOT_SECONDS`, "
                                 "whichever comes first (0: no step trigger); why these defaults: "
                                 "torus/snapshot/cadence.py"),
    "TORUS_SNAPSHOT_SECONDS": Knob(60.0, "float", "snapshot every this many seconds or `TORUS_SNAPSHOT_STEPS`, "
                                   "whichever comes first (0: no time trigger)"),
    # set by torus-run for the ranks of each launch (torus/supervise/); set by hand to resume under plain mpiexec
    "TORUS_JOB_ID": Knob("", "str", "the job's id: snapshots are taken and resumed under it (unset: no "
                         "snapshots; torus-run sets one per run)"),
    "TORUS_RESTART": Knob(0, "int", "which launch of the job this is: 0, then 1, 2, ... after each relaunch"),
    "TORUS_RUN_PROGRESS": Knob(False, "flag", "rank 0 prints torus-run's progress marker (`torus-run: at step S`, "
                               "on stderr) while `fit` trains"),
    # labels of benchmark reports (set by `python -m tests.cluster`'s mpiexec line; torus/bench/report.py)
    "TORUS_CLUSTER_HOSTS": Knob(0, "int", "benchmark label: the number of hosts (0: not on a labelled cluster)"),
    "TORUS_CLUSTER_PPN": Knob(0, "int", "benchmark label: ranks per host"),
    "TORUS_CLUSTER_RATE": Knob("unshaped", "str", "benchmark label: the hosts' link rate"),
    "TORUS_CLUSTER_PLACEMENT": Knob("blocks", "str", "benchmark label: `blocks` or `round_robin`"),
    # build (setup.py)
    "TORUS_NO_OPENMP": Knob(False, "flag", "build the kernels without OpenMP", build=True),
    "TORUS_NO_C_LOOP": Knob(False, "flag", "do not build the C step loop", build=True),
}


def is_set(name: str) -> bool:
    """Whether ``name`` (a knob) is set to a non-empty value."""
    KNOBS[name]
    return bool(os.environ.get(name, "").strip())


def read(name: str):
    """The value of knob ``name``: its default when unset or empty. KeyError for a name not in KNOBS."""
    knob = KNOBS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return knob.default
    try:
        if knob.type == "int":
            try:
                return int(text)
            except ValueError:
                value = float(text)
                if not value.is_integer():
                    raise
                return int(value)
        if knob.type == "float":
            return float(text)
        if knob.type == "flag":
            return FLAGS[text.lower()]
    except (ValueError, KeyError):
        raise ValueError(f"{name}={text!r}: expected {'0 or 1' if knob.type == 'flag' else 'a number'}") from None
    return text


def override(name: str, value: str) -> None:
    """Set knob ``name`` for this process and the processes it starts (as ``export`` would)."""
    KNOBS[name]
    os.environ[name] = value


def setting(name: str, value) -> tuple[str, str]:
    """``(name, str(value))`` for a child process' environment (torus-run's launches); KeyError for a name not in
    KNOBS."""
    KNOBS[name]
    return name, str(value)


def markdown() -> str:
    """docs/knobs.md: the table as Markdown."""
    lines = ["# Environment knobs", "",
             "Generated from `torus/knobs.py` by `python -m torus.knobs > docs/knobs.md`; tests/test_knobs.py",
             "checks that it is current. An argument (`TorusComm(...)`, `TorusStrategy(...)`, a command's flag)",
             "wins over its variable. Unset or empty means the default.", "",
             "| variable | default | type | what |", "|---|---|---|---|"]
    for name, k in KNOBS.items():
        default = ("unset" if k.default in ("", None) else f"`{int(bool(k.default))}`" if k.type == "flag"
                   else f"`{k.default}`")
        lines.append(f"| `{name}` | {default} | {k.type}{' (build)' if k.build else ''} | {k.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
