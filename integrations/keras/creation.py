"""Variables created under ``TorusStrategy.scope()`` start from rank 0's initial values, as under
``tf.distribute.MultiWorkerMirroredStrategy`` (whose variable creator broadcasts every initial value from the
chief).

The strategy's variable creator (``_TorusExtended._create_variable``) passes every variable's initial value
through :meth:`InitialValues.of` before the variable exists. The value is computed eagerly on every rank (a
callable initial value, e.g. the Keras initializer of a layer's kernel, is called once, under
``tf.init_scope()``, so this holds too for variables created while a ``tf.function`` is traced: a model built
lazily in the first step, optimizer slots); then every rank all-gathers a record of it (byte count, and a crc32
of shape and dtype) and, when every record equals rank 0's, takes rank 0's bytes (``MPI_Ibcast``). The
variable is created from that value. So a model built under the scope without ``keras.utils.set_random_seed``
starts equal on every rank, whatever runs next (``strategy.run`` in a custom loop, ``train_on_batch``, ``fit``,
which broadcasts again when it starts, after the callbacks' restores); every rank applies the same summed
gradients, so the variables stay equal. Optimizer slots and the iteration count are created in the first step
from constant initializers (zeros), equal on every rank by construction; they pass through here all the same.

Collective: every rank must create the same variables under the scope, in the same order (the names may differ:
Keras numbers layers per process; only shapes and dtypes are compared). Each wait is bounded by the
``TorusComm``'s stall timeout, on a communicator of its own (a ``Dup``), so a creation one rank makes alone
never pairs with another collective:

- a rank creates a variable of another shape or dtype than rank 0 at the same point: ``MismatchError`` (a
  ``ValueError``) on every rank, naming the ranks;
- variables created inside a save (Keras 3.15 builds a reference optimizer there) are rank 0's alone and are
  created as in one process (``alone.py``);
- a rank creates a variable the others do not (e.g. ``if rank == 0:`` inside the scope): that rank raises
  ``torus.errors.TimeoutError`` naming the variable after the stall timeout (``TORUS_TIMEOUT``, default 600 s),
  and ``abort_on_exception`` ends the job; the others' next collective times out too. Create rank-local
  variables outside the scope.

What is not broadcast, seed generator states, the cost: docs/design.md ("Initial values at creation").
"""
from __future__ import annotations

import zlib

import numpy as np
import tensorflow as tf

from torus import faults
from torus.errors import MismatchError
from torus.integrations.keras.collectives.loop import gather_records, stall_timeout
from torus.integrations.keras.fit import alone
from torus.integrations.keras.fit.initial_state import SEED_SPREAD

_UNSIZED = (tf.string, tf.resource, tf.variant)


def _eager_value(initial_value, dtype):
    """``initial_value`` (a value or a callable returning one) as an eager tensor of ``dtype``, computed outside
    any function being traced; None where it cannot be (a symbolic tensor, graph mode) or has no fixed size."""
    with tf.init_scope():
        if not tf.executing_eagerly():
            return None
        try:
            value = initial_value() if callable(initial_value) else initial_value
        except TypeError:  # it uses a tensor of the function being traced; TF calls it again there (and re-raises)
            return None
        if tf.is_symbolic_tensor(value):
            return None
        value = tf.convert_to_tensor(value, dtype=dtype)
    return None if value.dtype in _UNSIZED else value


class InitialValues:
    """Rank 0's initial value for every variable created under one ``TorusStrategy``'s scope (see the module
    docstring). Collective to construct (``Dup`` of the ``TorusComm``'s communicator)."""

    def __init__(self, torus_comm):
        self.rank, self.size = torus_comm.rank, torus_comm.size
        self.comm = torus_comm.comm.Dup() if self.size > 1 else None
        self.timeout = stall_timeout(torus_comm)
        self.created = 0

    def of(self, kwargs: dict):
        """The initial value to create the variable described by ``kwargs`` (a variable creator's keyword
        arguments) from: rank 0's, as an eager tensor, or ``kwargs["initial_value"]`` itself where it is not
        broadcast. Collective (nothing at one rank)."""
        initial = kwargs["initial_value"]
        if self.size == 1 or alone.active():  # a save's own variables, on rank 0 alone (alone.py)
            return initial
        value = _eager_value(initial, kwargs.get("dtype"))
        if value is None:
            return initial
        self.created += 1
        array = np.array(value.numpy())  # a copy: the bytes received must not land in the caller's tensor
        name = kwargs.get("name") or "Variable"
        what = f"variable {name!r} {tuple(array.shape)} {value.dtype.name}"
        where = f"number {self.created} created under strategy.scope() on this rank"
        rule = ("every rank must create the same variables under strategy.scope(), in the same order (each "
                "starts from rank 0's initial value); create rank-local variables outside the scope")
        layout = repr((tuple(array.shape), value.dtype.name)).encode()
        mine = np.array([array.nbytes, zlib.crc32(layout)], np.int64)
        every = gather_records(self.comm, mine, self.timeout, lambda: (
            f"TorusStrategy on rank {self.rank}: no progress for {self.timeout:g} s agreeing on the initial value "
            f"of {what} ({where}): some rank did not create it, or it raised, exited or is stuck; {rule}; "
            "abort the job"))
        differ = [r for r in range(self.size) if (every[r] != every[0]).any()]
        if differ:
            raise MismatchError(f"TorusStrategy on rank {self.rank}: rank(s) {differ} created a variable of another "
                                f"shape or dtype than rank 0 where this rank created {what} ({where}); {rule}")
        if array.nbytes:
            flat = array.reshape(-1)
            faults.wait(self.comm.Ibcast(flat.view(np.uint8), root=0), self.timeout, lambda: (
                f"TorusStrategy on rank {self.rank}: no progress for {self.timeout:g} s receiving rank 0's initial "
                f"value of {what} ({where}): some rank died or is stuck; abort the job"))
            if self.rank and name.endswith("seed_generator_state") and array.size:
                flat[0] += self.rank * SEED_SPREAD
        with tf.init_scope():
            return tf.constant(array, dtype=value.dtype)
