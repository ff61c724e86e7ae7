"""The host memory policy's fast path: the step loop in C (``src/_step_loop.pyx``), when it is used, the
tables it reads, and its results as the errors the step interpreter raises.

Used for numpy buffers when the extension was built (setup.py compiles it through mpi4py's Cython API against
the MPI of an MPI compiler wrapper: MPICH, Open MPI or any other) and was compiled against the MPI mpi4py runs
on. A build against another MPI is never used, and never crashes: its import fails (its libmpi soname, e.g.
``libmpi.so.12`` for MPICH under Open MPI's ``libmpi.so.40``, is not loaded and not on the loader's path),
or Cython's import check finds mpi4py's objects of another size (MPICH's handles are ints, Open MPI's
pointers), or ``_step_loop.matches()`` finds other ``MPI_BYTE`` / ``MPI_COMM_WORLD`` handles than mpi4py's.
``WHY_NOT`` then says which. In those cases, and with ``TORUS_C_LOOP=0``, the Python step interpreter
(torus.runtime.interpreter) runs: same messages, same results to the bit (tests/mpi/test_python_loop.py). Why
a C loop at all: with more ranks than cores the Python driving each message costs a large share of a mid-size
all-reduce (bench/torus_bench/README.md compares the two loops).
"""
from __future__ import annotations

import warnings

import numpy as np
from mpi4py import MPI

from torus import kernels, knobs
from torus._ext import _reduce  # type: ignore[attr-defined]  # compiled, no stubs
from torus.runtime import progress
from torus.runtime.compile import TAG_MOD


def _load():
    """(module, None) when the C loop is used, else (None, why not)."""
    if not knobs.read("TORUS_C_LOOP"):
        return None, "TORUS_C_LOOP=0"
    try:
        with warnings.catch_warnings():
            # Cython's import check on mpi4py's types: smaller than compiled in raises ValueError, larger
            # warns (RuntimeWarning); both mean a build against another MPI's handle types.
            warnings.simplefilter("error", RuntimeWarning)
            from torus._ext import _step_loop
    except ImportError as exc:  # not built, or built against a libmpi that is neither loaded nor findable
        return None, f"torus._ext._step_loop does not import: {exc}"
    except (ValueError, RuntimeWarning) as exc:
        return None, f"torus._ext._step_loop was compiled against another MPI: {exc}"
    if not _step_loop.matches():
        return None, ("torus._ext._step_loop was compiled against another MPI than mpi4py's "
                      f"({MPI.Get_library_version().splitlines()[0]})")
    return _step_loop, None


_step_loop, WHY_NOT = _load()
AVAILABLE = _step_loop is not None


def table(steps, itemsize: int, tail) -> tuple:
    """What ``_step_loop.run`` reads, from compiled steps (compile.py): the arrays (byte offsets; a message's
    communicator as an index into the plan's communicators), those communicators' handles
    (``_step_loop.Communicators``), and the (step, message) of every row for error messages. Built once per
    plan."""
    rows, msgs, step_lo, retire, retire_lo, prefill, prefill_lo, scales = [], [], [0], [], [0], [], [0], []
    send_row: dict = {}
    comms: dict = {}  # communicator name -> (index, communicator)
    for si, st in enumerate(steps):
        for m in st.recvs:
            rows.append((0, _comm(comms, m), m.peer, m.lo, m.hi, max(m.tmp_lo, 0), int(m.tmp_lo >= 0), -1,
                         int(m.final), int(m.fresh), 0))
            msgs.append((si, m))
        for m in st.sends:
            send_row[m.sid] = len(rows)
            rows.append((1, _comm(comms, m), m.peer, m.lo, m.hi, 0, 0, m.sid, 0, int(m.fresh),
                         int(m.sid in st.inner)))
            msgs.append((si, m))
        step_lo.append(len(rows))
        retire.extend(st.retire)
        retire_lo.append(len(retire))
        prefill.extend(st.prefill)
        prefill_lo.append(len(prefill))
        scales.append(st.scale if st.scale is not None else (-1, -1))
    i64 = np.int64
    to_bytes = np.array([1, 1, 1, itemsize, itemsize, itemsize, 1, 1, 1, 1, 1], i64)
    return (np.array(rows, i64).reshape(-1, 11) * to_bytes, np.array(step_lo, i64), np.array(retire, i64),
            np.array(retire_lo, i64), np.array(tail, i64), np.array([send_row[k] for k in range(len(send_row))], i64),
            np.array(prefill, i64).reshape(-1, 2) * itemsize, np.array(prefill_lo, i64),
            np.array(scales, i64).reshape(-1, 2), _step_loop.Communicators(tuple(c for _, c in comms.values())),
            tuple(msgs))


def _comm(comms: dict, m) -> int:
    """The table's index of ``m``'s communicator (each distinct one once, in order of first use)."""
    return comms.setdefault(m.name, (len(comms), m.comm))[0]


def run(ex, what: str, plan, buf: np.ndarray, op_code: int, scale: float, src, tmp) -> None:
    """``Executor.run``'s loop in C on 1-D contiguous numpy ``buf`` (and ``src``); raises what it raises."""
    *arrays, msgs = plan.table
    status, si, row, rc = _step_loop.run(*arrays, buf, src, tmp, _reduce.kind(buf), op_code, scale,
                                     kernels.get_num_threads(), ex.timeout or 0.0, TAG_MOD,
                                     lambda lo, hi: kernels.scale(buf[lo:hi], scale), progress.poll_pause())
    if status == 1:
        step, m = msgs[row]
        ex.stalled(what, step, len(plan.steps), m)
    if status == 2:
        raise MPI.Exception(rc)
