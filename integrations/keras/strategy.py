"""TorusStrategy: data-parallel ``model.fit`` over MPI ranks, as a ``tf.distribute.Strategy``.

Underneath it is TensorFlow's one-device strategy (variables and compute on this process' CPU or its one
GPU) with three overrides in its extended class: the replica count is the number of MPI ranks, and
``reduce_to`` / ``batch_reduce_to`` (which Keras 3's optimizer reaches through the replica context's
``all_reduce`` of the gradient list) run ``torus.integrations.keras.loop.allreduce_tensors``: one fused
``tf.numpy_function`` into ``TorusComm.allreduce`` per training step. Keras scales each rank's loss by
``1 / num_replicas_in_sync``, so the summed gradient is the mean over the global batch and one step equals one
single-process step on the concatenated batch (up to summation order).

This relies on TensorFlow internals (``tensorflow.python.distribute.one_device_strategy.OneDeviceExtended``),
checked on TensorFlow 2.21 / Keras 3.15, the versions pinned in pyproject.toml; tests/mpi/test_keras_*.py
guard it. Why not ``MirroredStrategy``: with one local device it never calls custom cross-device ops.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import one_device_strategy

from torus import TorusComm
from torus.integrations.keras import files, fit_hook, inputs  # noqa: F401 (files registers its stage)
from torus.integrations.keras.loop import HostAllreduce, allreduce_tensors, broadcast_variables
from torus.select import ALGORITHMS


def _local(value):
    """The tensor behind a per-replica value (one replica per process here)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


class _TorusExtended(one_device_strategy.OneDeviceExtended):
    def __init__(self, container, host: HostAllreduce, device: str):
        super().__init__(container, device)
        self._host = host

    @property
    def _num_replicas_in_sync(self):
        return self._host.torus_comm.size

    def _reduce_to(self, reduce_op, value, destinations, options):
        flat = tf.nest.flatten(value, expand_composites=False)
        reduced = self._batch_reduce_to(reduce_op, [(v, destinations) for v in flat], options)
        return tf.nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [_local(v) for v, _ in value_destination_pairs]
        op = "avg" if reduce_op == tf.distribute.ReduceOp.MEAN else "sum"
        return allreduce_tensors(self._host, values, op)

    def _experimental_distribute_dataset(self, dataset, options):
        # Keras hands every kind of input here as a tf.data dataset of global batches (or per-rank ones)
        return super()._experimental_distribute_dataset(
            inputs.split_batches(self._container_strategy(), dataset), options)


class TorusStrategy(tf.distribute.Strategy):
    """Synchronous data parallelism across the ranks of an MPI communicator, one replica per rank.

    Usage, under ``mpiexec -n N python train.py``::

        strategy = TorusStrategy(algorithm="torus2d", compression="fp16")
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=LARS(...), loss=..., metrics=[...], jit_compile=False)
        model.fit(strategy.shard(dataset).batch(per_rank_batch, drop_remainder=True),
                  callbacks=strategy.callbacks() + [...], verbose=1 if strategy.is_chief else 0)

    Each rank feeds its own shard with its per-rank batch (global batch = N x per-rank batch). Gradients are
    fused into one buffer per dtype and all-reduced with ``TorusComm.allreduce`` (``algorithm``), optionally
    sent as float16/bfloat16 (``compression``); sparse gradients are densified (see ``allreduce_tensors``).
    ``callbacks()`` broadcasts rank 0's weights and optimizer state before the first update and averages
    fit's logged metrics across ranks; only the chief (rank 0) should print and write checkpoints.
    ``jit_compile=True`` is refused (XLA cannot compile the ``tf.numpy_function``). Keras clips gradients
    (``clipnorm``, ``global_clipnorm``, ``clipvalue``) before the all-reduce, on each rank's loss-scaled local
    gradient, so clipping does not match a single process; LARS needs none.

    Parameters
    ----------
    dims : (int, int), optional
        The X x Y grid for ``TorusComm`` (default: ``MPI.Compute_dims``).
    algorithm : str
        "auto", "ring", "hierarchical", "torus2d" or "native".
    compression : str
        "none", "fp16" or "bf16": the wire format of the float32 gradient buffer.
    comm : mpi4py.MPI.Intracomm or TorusComm, optional
        The ranks (default ``MPI.COMM_WORLD``); a ``TorusComm`` is used as is (``dims`` then ignored).
    device : str
        Where variables and compute live (default "/cpu:0").

    Collective: every rank constructs it together. Raises ``ValueError`` for an unknown algorithm or
    compression.
    """

    def __init__(self, dims=None, algorithm: str = "auto", compression: str = "none", comm=None,
                 device: str = "/cpu:0"):
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"TorusStrategy: unknown algorithm {algorithm!r}; expected auto or one of "
                             f"{', '.join(ALGORITHMS)}")
        torus_comm = comm if isinstance(comm, TorusComm) else TorusComm(comm, dims)
        self.host = HostAllreduce(torus_comm, algorithm, compression)
        super().__init__(_TorusExtended(self, self.host, device))
        fit_hook.install(self)

    @property
    def torus_comm(self) -> TorusComm:
        return self.host.torus_comm

    @property
    def rank(self) -> int:
        return self.torus_comm.rank

    @property
    def size(self) -> int:
        return self.torus_comm.size

    @property
    def is_chief(self) -> bool:
        """True on rank 0: the one rank that should print, log and write checkpoints."""
        return self.rank == 0

    def shard(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """``dataset.shard(size, rank)``: every ``size``-th element, starting at ``rank``. Shard before
        shuffling with a per-rank seed and before batching. The result is marked per rank
        (``inputs.per_rank``): fit takes its batches as this rank's share instead of splitting them."""
        return inputs.per_rank(dataset.shard(self.size, self.rank))

    def allreduce_gradients(self, grads, op: str = "avg"):
        """Fused all-reduce of a gradient list for custom loops (mean over ranks by default); see
        ``loop.allreduce_tensors``."""
        return allreduce_tensors(self.host, list(grads), op)

    def broadcast_variables(self, variables, root: int = 0) -> None:
        """Give every rank rank ``root``'s values (eager, collective); see ``loop.broadcast_variables``."""
        broadcast_variables(self.torus_comm, variables, root)

    def average_logs(self, model, logs: dict) -> dict:
        """Global values of ``model.evaluate(..., return_dict=True)``'s logs: call right after evaluate, on
        every rank (collective); weights each rank by its sample count. Returns ``logs``, updated in place."""
        from torus.integrations.keras.callbacks import average_logs, loss_samples
        return average_logs(self.torus_comm, logs, loss_samples(model))

    def callbacks(self) -> list:
        """The callbacks ``model.fit`` needs: initial-state broadcast (first) and metric averaging."""
        from torus.integrations.keras.callbacks import BroadcastInitialState, MetricAverage
        return [BroadcastInitialState(self), MetricAverage(self)]
