"""Data-parallel pieces for a custom training loop besides the all-reduce (reducer.py): variables broadcast
from one rank and checked alike on every rank, and a barrier bounded by the stall timeout.

``broadcast_variables`` copies rank 0's values into every rank's variables (eager, one ``MPI_Ibcast`` per
dtype, bounded by the stall timeout). A custom loop::

    tc = torus.TorusComm()
    host = HostAllreduce(tc, algorithm="torus2d", compression="none")
    model, opt = make_model(), LARS(...)
    opt.build(model.trainable_variables)
    broadcast_variables(tc, model.variables + opt.variables)      # before the first update
    @tf.function                                                  # jit_compile must stay False
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))          # mean over this rank's batch
        grads = allreduce_tensors(host, tape.gradient(loss, model.trainable_variables), op="avg")
        opt.apply_gradients(zip(grads, model.trainable_variables))
"""
from __future__ import annotations

import pickle
import zlib

import numpy as np

from torus import faults
from torus.errors import MismatchError


def stall_timeout(torus_comm):
    """Seconds ``torus_comm``'s collectives wait without progress before ``TimeoutError`` (None: forever)."""
    # TorusComm keeps the resolved value (argument, TORUS_TIMEOUT, default) on its executor only.
    return torus_comm._executor.timeout


def wait_for_every_rank(torus_comm, what: str) -> None:
    """``MPI_Ibarrier`` on ``torus_comm``'s communicator, waited at most the stall timeout without progress,
    else ``torus.errors.TimeoutError`` naming ``what`` and this rank. Collective; nothing at one rank."""
    if torus_comm.size == 1:
        return
    timeout, rank = stall_timeout(torus_comm), torus_comm.rank
    faults.wait(torus_comm.comm.Ibarrier(), timeout, lambda: (
        f"{what} on rank {rank}: no progress for {timeout:g} s waiting for every rank: some rank did not "
        "get here (it raised, exited, is stuck, or skipped this call); abort the job"))


def gather_records(comm, mine: np.ndarray, timeout, stalled) -> np.ndarray:
    """Every rank's int64 record ``mine`` (the same length on every rank), shape ``(comm.size, mine.size)``:
    one ``MPI_Iallgather`` over ``comm``, waited at most ``timeout`` s without progress, else
    ``torus.errors.TimeoutError`` with the message ``stalled()``. Collective."""
    every = np.empty((comm.Get_size(), mine.size), np.int64)
    faults.wait(comm.Iallgather(mine, every), timeout, stalled)
    return every


def broadcast_variables(torus_comm, variables, root: int = 0, what: str = "broadcast_variables") -> None:
    """Assign rank ``root``'s values to ``variables`` (Keras or tf variables) on every rank. Eager only;
    collective: every rank passes the same variables (count, shapes, dtypes, order).

    First ``check_same_variables`` (``MismatchError`` on every rank, before any value moves); then one
    ``MPI_Ibcast`` per dtype. Each wait is bounded by ``torus_comm``'s stall timeout: a rank that never calls
    (raised, exited, stuck) turns into ``torus.errors.TimeoutError`` on the others instead of a hang. ``what``
    names the operation in the errors."""
    variables = list(variables)
    rank, timeout = torus_comm.rank, stall_timeout(torus_comm)
    check_same_variables(torus_comm, variables, root, what)
    for dt in dict.fromkeys(v.dtype for v in variables):
        group = [v for v in variables if v.dtype == dt]
        flat = np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v).reshape(-1)
                               for v in group])
        stalled = (f"{what} on rank {rank}: no progress for {timeout} s broadcasting {flat.nbytes} "
                   f"bytes of {dt} from rank {root}: some rank died or is stuck; abort the job")
        faults.wait(torus_comm.comm.Ibcast(flat.view(np.uint8), root=root), timeout, lambda stalled=stalled: stalled)
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(tuple(v.shape)))
            offset += n


def check_same_variables(torus_comm, variables, root: int = 0, what: str = "broadcast_variables") -> None:
    """Compare every rank's list of ``variables`` (count, then shapes and dtypes in order) with rank ``root``'s:
    one small ``MPI_Iallgather`` (bounded by the stall timeout, ``torus.errors.TimeoutError`` naming ``what`` and
    this rank). Where they differ, ``MismatchError`` on every rank, naming the ranks and the first variable that
    differs; where the difference is a Keras optimizer that holds no slot variables on some ranks, the error says
    why (``_slotless_optimizers``): one loaded from an ``.h5`` file, or one not built yet. Reads only the
    variables' shapes, dtypes and names, so it can run inside a ``tf.numpy_function``. Collective."""
    variables = list(variables)
    comm, rank, size = torus_comm.comm, torus_comm.rank, torus_comm.size
    timeout = stall_timeout(torus_comm)
    layout = _layout(variables)
    mine = np.array([len(variables), zlib.crc32(repr([(s, d) for _, s, d in layout]).encode())], np.int64)
    every = gather_records(comm, mine, timeout, lambda: (
        f"{what} on rank {rank}: no progress for {timeout:g} s checking every rank's variable "
        "list: some rank did not call it (it raised, exited or is stuck); abort the job"))
    differ = [r for r in range(size) if (every[r] != every[root]).any()]
    if differ:  # the same on every rank: all of them take this branch and its collective
        raise MismatchError(_mismatch(torus_comm, variables, layout, root, differ, every, what))


def _layout(variables) -> list:
    """(name, shape, dtype) of each variable: its Keras ``path`` (a tf.Variable's ``name``)."""
    return [(str(getattr(v, "path", None) or getattr(v, "name", "?")), tuple(int(d) for d in v.shape), str(v.dtype))
            for v in variables]


def _slotless_optimizers(variables) -> list:
    """(name, built) of each Keras optimizer whose ``iterations`` variable is among ``variables`` and that holds
    nothing but its iteration count and learning rate. Keras 3.15's ``.h5`` loader (``keras.models.load_model``)
    builds the optimizer for the model's own directly held variables, none for a Sequential or functional
    model, and drops the saved optimizer state: such an optimizer says ``built`` and has no slots. Only looked
    for once the lists differ (it walks the heap for optimizers)."""
    import gc

    import keras

    ids = {id(v) for v in variables}
    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, keras.optimizers.Optimizer):
            continue
        try:
            iterations, own = obj.iterations, list(obj.variables)
        except Exception:  # a half-built optimizer must not hide the mismatch
            continue
        if id(iterations) not in ids:
            continue
        prefix = str(getattr(iterations, "path", "")).rpartition("/")[0]
        if prefix and all(str(getattr(v, "path", "")) in (f"{prefix}/iteration", f"{prefix}/learning_rate")
                          for v in own):
            found.append((prefix, bool(obj.built)))
    return found


def _mismatch(torus_comm, variables, layout, root, differ, every, what) -> str:
    """The ``MismatchError`` message; collective (one ``allgather`` of every rank's layout and suspects)."""
    comm, rank, timeout = torus_comm.comm, torus_comm.rank, stall_timeout(torus_comm)

    def stalled():
        return f"{what} on rank {rank}: no progress for {timeout:g} s comparing variable lists: abort the job"

    mine = np.frombuffer(pickle.dumps((layout, _slotless_optimizers(variables))), np.uint8)
    sizes = gather_records(comm, np.array([mine.size], np.int64), timeout, stalled)[:, 0]
    blob = np.empty(int(sizes.sum()), np.uint8)
    faults.wait(comm.Iallgatherv(mine, [blob, [int(n) for n in sizes]]), timeout, stalled)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    got = [pickle.loads(blob[bounds[r]:bounds[r + 1]].tobytes()) for r in range(len(sizes))]
    counts = [int(c) for c in every[:, 0]]
    for built in (True, False):
        low = [r for r, (_, suspects) in enumerate(got) if any(b == built for _, b in suspects)]
        if not low:
            continue
        full = [r for r, (_, suspects) in enumerate(got) if not suspects and counts[r] > min(counts[k] for k in low)]
        if not full:
            continue
        name = next(p for p, b in got[low[0]][1] if b == built)
        if built:
            import keras

            return (f"{what} on rank {rank}: the optimizer {name!r} on rank(s) {low} says it is built but holds "
                    f"no slot variables ({counts[low[0]]} variables in all there, {counts[full[0]]} on rank(s) "
                    f"{full}). Keras {keras.__version__} loads an optimizer from an .h5 file that way: "
                    "keras.models.load_model / hvd.load_model of a .h5 builds it for no variables and drops the "
                    "saved optimizer state, and plain Keras then fails in fit with 'Unknown variable'. The model "
                    "is not at fault: save checkpoints as .keras instead of .h5 (model.save('model.keras'), "
                    "ModelCheckpoint('checkpoint-{epoch}.keras')) and resume from those, or compile the loaded "
                    "model with a fresh optimizer")
        return (f"{what} on rank {rank}: the optimizer {name!r} is not built on rank(s) {low} (no slot "
                f"variables) but is on rank(s) {full}: build it on every rank before broadcasting "
                "(optimizer.build(model.trainable_variables))")
    r, lay, lay_root = differ[0], got[differ[0]][0], got[root][0]
    k = next((i for i, (a, b) in enumerate(zip(lay, lay_root)) if a[1:] != b[1:]), min(len(lay), len(lay_root)))
    here = " ".join(map(str, lay[k])) if k < len(lay) else "nothing"
    there = " ".join(map(str, lay_root[k])) if k < len(lay_root) else "nothing"
    return (f"{what} on rank {rank}: rank(s) {differ} hold other variables than rank {root} (count {counts} "
            f"per rank, or shapes/dtypes differ; first difference: variable {k} is {here} on rank {r}, {there} "
            f"on rank {root}): build the same model and optimizer on every rank")
