"""TorusStrategy: data-parallel ``model.fit`` over MPI ranks, as a ``tf.distribute.Strategy``.

Underneath it is TensorFlow's one-device strategy (variables and compute on this process' CPU or its one
GPU) with overrides in its extended class: the replica count is the number of MPI ranks, and
``reduce_to`` / ``batch_reduce_to`` run ``torus.integrations.keras.collectives.loop.allreduce_tensors``: one fused
``tf.numpy_function`` into ``TorusComm.allreduce``. Keras 3's optimizer reaches them through the replica
context's ``all_reduce`` of the gradient list, after clipping and the loss-scale check; inside ``fit`` the
gradients are all-reduced earlier instead, at the start of ``optimizer.apply`` (``gradients.py``), and that later
reduction passes them through. Keras scales each rank's loss by ``1 / num_replicas_in_sync``, so the summed
gradient is the mean over the global batch and one step equals one single-process step on the concatenated
batch (up to summation order). ``experimental_distribute_dataset`` (Keras' route for every input) returns
this rank's share (``inputs.split_batches``) as a plain ``tf.data`` dataset, without TF's MultiDeviceIterator;
``distribute_datasets_from_function`` gives ``dataset_fn`` one input pipeline per rank and returns its dataset
as this rank's. The variable creator gives every variable created under the scope rank 0's initial value
(``creation.py``).

This relies on TensorFlow internals (``OneDeviceExtended``: its private methods are overridden), resolved and
checked at import by ``compat.py`` against the tested range in pyproject.toml; tests/mpi/test_keras_*.py guard
it. Why not ``MirroredStrategy``: with one local device it never calls custom cross-device ops.
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from torus import TorusComm, faults
from torus.integrations.keras import compat
from torus.integrations.keras.collectives import trace
from torus.integrations.keras.collectives.loop import HostAllreduce, broadcast_variables
from torus.integrations.keras.collectives.sparse import reduce_gradients
from torus.integrations.keras.fit import fit_hook, inputs, saving
from torus.integrations.keras.fit.creation import InitialValues
from torus.select import ALGORITHMS


def _local(value):
    """The tensor behind a per-replica value (one replica per process here)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


class _RankReplicaContext(compat.OneDeviceReplicaContext):
    """The one-device replica context, its ``replica_id_in_sync_group`` this rank (as under the multi-worker
    strategy, where replica ids run over the workers)."""

    def __init__(self, strategy, rank: int):
        tf.distribute.ReplicaContext.__init__(self, strategy, replica_id_in_sync_group=rank)


class _TorusExtended(compat.OneDeviceExtended):
    def __init__(self, container, host: HostAllreduce, device: str):
        super().__init__(container, device)
        self._host = host
        self._passing = 0
        self._initial_values = InitialValues(host.torus_comm)

    @contextlib.contextmanager
    def gradients_reduced(self):
        """While open (at trace time), reductions pass their values through: they are reduced already."""
        self._passing += 1
        try:
            yield
        finally:
            self._passing -= 1

    @property
    def _num_replicas_in_sync(self):
        return self._host.torus_comm.size

    def _reduce_to(self, reduce_op, value, destinations, options):
        flat = tf.nest.flatten(value, expand_composites=False)
        reduced = self._batch_reduce_to(reduce_op, [(v, destinations) for v in flat], options)
        return tf.nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        values = [_local(v) for v, _ in value_destination_pairs]
        if self._passing:
            return values
        op = "avg" if reduce_op == tf.distribute.ReduceOp.MEAN else "sum"
        return reduce_gradients(self._host, values, op)  # IndexedSlices stay sparse (sparse.py)

    def _call_for_each_replica(self, fn, args, kwargs):
        with tf.device(self._device), _RankReplicaContext(self._container_strategy(), self._host.torus_comm.rank):
            return fn(*args, **kwargs)

    def _create_variable(self, next_creator, **kwargs):
        # Every variable created under the scope starts from rank 0's initial value (creation.py).
        kwargs["initial_value"] = self._initial_values.of(kwargs)
        return super()._create_variable(next_creator, **kwargs)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        # As under MultiWorkerMirroredStrategy: one input pipeline and one replica per rank. dataset_fn's dataset
        # is this rank's (per-rank batches), marked so: fit and experimental_distribute_dataset do not split it.
        # Returned as a plain tf.data dataset, like _experimental_distribute_dataset's, for the same reason.
        size, rank = self._host.torus_comm.size, self._host.torus_comm.rank
        dataset = dataset_fn(tf.distribute.InputContext(num_input_pipelines=size, input_pipeline_id=rank,
                                                        num_replicas_in_sync=size))
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"TorusStrategy.distribute_datasets_from_function on rank {rank}: dataset_fn returned "
                            f"{type(dataset).__name__}, expected a tf.data.Dataset")
        return inputs.per_rank(dataset)

    def _experimental_distribute_dataset(self, dataset, options):
        # Keras hands every kind of input here as a tf.data dataset of global batches (or per-rank ones).
        # This rank's share goes back as a plain tf.data dataset, not wrapped in TF's DistributedDataset:
        # with one replica per process that wrapper only adds a MultiDeviceIterator, and TF 2.21 tears one
        # down unsafely: its background thread can still be in the host iterator's GetNext when the
        # iterator is deleted, a use after free (SIGSEGV in MultiDeviceBuffer::BackgroundThread, seen in
        # core dumps). Keras deletes a freshly started iterator in every fit/evaluate under a strategy
        # (the first-batch peek in _maybe_symbolic_build, then EpochIterator.reset), so the race fired
        # in about half of the 3-rank test runs on a loaded machine. Keras' steps take a tf.data
        # iterator as they do without a strategy; a GPU ``device`` gets its batch copied at the step.
        return inputs.split_batches(self._container_strategy(), dataset)


class TorusStrategy(tf.distribute.Strategy):
    """Synchronous data parallelism across the ranks of an MPI communicator, one replica per rank.

    Usage, under ``mpiexec -n N python train.py``::

        strategy = TorusStrategy(algorithm="torus2d", compression="fp16")
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=LARS(...), loss=..., metrics=[...])
        model.fit(strategy.shard(dataset).batch(per_rank_batch, drop_remainder=True),
                  callbacks=[...], verbose=1 if strategy.is_chief else 0)

    Each rank feeds its own shard with its per-rank batch (global batch = N x per-rank batch). Gradients are
    fused into one buffer per dtype and all-reduced with ``TorusComm.allreduce`` (``algorithm``; where that is
    the shared-memory transport, into a persistent shared buffer reduced in place, ``window.py``), optionally
    sent as float16/bfloat16 (``compression``); sparse gradients (``tf.IndexedSlices``) are all-gathered as
    IndexedSlices (``sparse.py``; ``sparse_as_dense=True`` densifies them into the fused buffer instead).

    Inside ``fit`` / ``evaluate`` / ``predict`` (wrapped once per process, see ``fit_hook``), whatever callbacks
    are passed and in any order:

    - rank 0's model variables and optimizer state (slots, iteration count, loss scale) reach every rank before
      the first update, after the user callbacks' ``on_train_begin`` (e.g. a restore); ``evaluate`` and
      ``predict`` broadcast the model variables first too (``initial_state.py``);
    - metric results are global: every metric's state variables are summed over ranks before ``result()``,
      after every step and at the end of the epoch, exact for every Keras metric (``metrics.py``), so History,
      EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger and ``evaluate``'s return value see the same
      values on every rank and every rank takes the same decision; one small extra all-reduce per step;
    - the gradients are all-reduced at the start of ``optimizer.apply`` (``gradients.py``), so
      ``LossScaleOptimizer`` (``mixed_float16``) checks the summed gradient (a non-finite gradient on any rank
      makes every rank skip the step and halve its loss scale), and ``clipnorm`` / ``global_clipnorm`` /
      ``clipvalue`` clip the global gradient, both as one process on the global batch would;
    - a model created, loaded or compiled outside ``strategy.scope()`` is moved under the strategy (its
      optimizer too; the step functions are rebuilt), with a warning on the chief; a model of another
      ``tf.distribute`` strategy is refused (``adopt.py``).

    Custom loops, MirroredStrategy-style (tf.distribute's contract, as under ``MultiWorkerMirroredStrategy`` with
    one worker per rank): ``strategy.run(fn, args)`` runs ``fn`` once, on this rank, in a replica context whose
    ``num_replicas_in_sync`` is the number of ranks (``tf.nn.compute_average_loss`` then averages over the global
    batch); the Keras optimizer's ``apply_gradients``, the replica context's ``all_reduce`` and
    ``strategy.reduce`` sum (or average) across ranks.

    - ``distribute_datasets_from_function(dataset_fn)`` calls ``dataset_fn`` once with a
      ``tf.distribute.InputContext`` of ``num_input_pipelines`` = ranks, ``input_pipeline_id`` = rank and
      ``num_replicas_in_sync`` = ranks (``get_per_replica_batch_size(B)`` is ``B // ranks``; TF's ``ValueError``
      where it does not divide), and returns its dataset as it is: this rank's batches, a plain ``tf.data``
      dataset marked per rank, which ``fit`` and the loop take without splitting it again.
    - ``experimental_distribute_dataset(dataset)`` of global batches gives this rank's contiguous slice of every
      batch (``inputs.split_batches``), marked per rank too.
    - Every variable created under ``scope()`` starts from rank 0's initial value, broadcast at creation
      (``creation.py``), so a model built without a seed starts, and stays, equal on every rank in a custom
      loop, in ``train_on_batch`` and in ``fit``. Optimizer slots created in the first step start equal by
      construction (zeros) and are broadcast all the same. This is collective: every rank must create the same
      variables under the scope in the same order; one of another shape or dtype raises ``MismatchError`` on
      every rank, one created on some ranks only raises ``TimeoutError`` there after the stall timeout. Keras'
      seed generator states take rank 0's plus ``rank * SEED_SPREAD`` (each rank its own random stream, as in
      ``fit``). Variables created outside the scope keep each rank's values (``strategy.broadcast_variables``).
    - ``tf.distribute.get_replica_context().replica_id_in_sync_group`` inside ``strategy.run`` (and Keras'
      train step) is this rank.

    ``strategy.callbacks()`` returns ``[]`` (kept for existing code). ``jit_compile=True`` is refused at the
    start of ``fit`` / ``evaluate`` (XLA cannot compile the ``tf.numpy_function``); Keras' default ``"auto"``
    resolves to False for a model compiled under the scope, but to True on a machine with a GPU for one
    compiled outside it. Only the chief (rank 0) prints: the other ranks run with ``verbose=0`` and Keras' own
callbacks' ``verbose`` set to 0 (``quiet.py``; user callbacks untouched). ``train_on_batch`` / ``test_on_batch`` are not
    wrapped: they all-reduce gradients (Keras' own late all-reduce, so clipping and the loss-scale check stay
    local) and return global metrics, but broadcast nothing and do not move a model created outside the scope.
    ``BatchNormalization`` normalizes over each rank's part of the batch unless ``synchronized=True``.

    ``model.save`` / ``save_weights`` / ``export`` and ``keras.saving.save_model`` of a model of the strategy
    (``saving.py``): called on every rank, rank 0 writes the file once, atomically, and the other ranks wait
    for its notice (bounded by the stall timeout; rank 0's error is raised on every rank); called on rank 0
    alone (``if strategy.is_chief:``), rank 0 writes it and nothing waits.

    Parameters
    ----------
    dims : (int, int), optional
        The X x Y grid for ``TorusComm`` (default: TorusComm's, one axis along equal nodes, else
        ``MPI.Compute_dims``).
    algorithm : str
        "auto", "ring", "hierarchical", "torus2d", "swing" or "native".
    compression : str
        "none", "fp16" or "bf16": the wire format of the float32 gradient buffer (metric states always travel
        uncompressed).
    comm : mpi4py.MPI.Intracomm or TorusComm, optional
        The ranks (default ``MPI.COMM_WORLD``); a ``TorusComm`` is used as is (``dims`` then ignored). Its stall
        timeout (``TorusComm(timeout=...)``, ``TORUS_TIMEOUT``, default 600 s) bounds every collective the
        strategy issues, the initial broadcast included.
    device : str
        Where variables and compute live (default "/cpu:0").
    abort_on_exception : bool
        Install ``torus.faults.abort_on_exception`` for the strategy's communicator (default True), so an
        uncaught exception on any rank ends the whole job instead of leaving the other ranks waiting.
    overlap : bool, optional
        All-reduce the gradients in buckets on a communication thread while backprop still runs
        (``buckets.py``). Default (None): ``TORUS_OVERLAP`` (``0``/``1``), else on where the ranks span several
        nodes. The results equal overlap off up to float summation order, and are bitwise equal across ranks.
    bucket_bytes : int, optional
        The bucket cap in bytes (default ``TORUS_BUCKET_BYTES``, else 25 MiB; the first bucket at most 1 MiB).
    sparse_as_dense : bool
        False (default, Horovod's): a sparse gradient's rows and indices are all-gathered, so the optimizer gets
        the IndexedSlices one process computes on the global batch (exact for optimizers that update sparse
        gradients row by row, e.g. Adam); True: made dense and summed with the others (the whole variable on
        the wire; within float rounding of one process only where the optimizer treats both alike).

    Where ``TORUS_TIMELINE=FILE`` is set, ``strategy.timeline`` records a Chrome trace of every rank's steps,
    buckets and all-reduces, written at the end of each ``fit`` (``trace.py``; a custom loop calls
    ``strategy.timeline.save()`` itself, on every rank); otherwise ``strategy.timeline`` is None.

    Collective: every rank constructs it together. Raises ``ValueError`` for an unknown algorithm or
    compression.
    """

    def __init__(self, dims=None, algorithm: str = "auto", compression: str = "none", comm=None,
                 device: str = "/cpu:0", abort_on_exception: bool = True, overlap: bool | None = None,
                 bucket_bytes: int | None = None, sparse_as_dense: bool = False):
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"TorusStrategy: unknown algorithm {algorithm!r}; expected auto or one of "
                             f"{', '.join(ALGORITHMS)}")
        torus_comm = comm if isinstance(comm, TorusComm) else TorusComm(comm, dims)
        if abort_on_exception:
            faults.abort_on_exception(torus_comm.comm)
        if not isinstance(sparse_as_dense, bool):
            raise TypeError(f"TorusStrategy: sparse_as_dense must be True or False, not {sparse_as_dense!r}")
        self.host = HostAllreduce(torus_comm, algorithm, compression, overlap=overlap, bucket_bytes=bucket_bytes,
                                  sparse_as_dense=sparse_as_dense)
        self.metrics_host = HostAllreduce(torus_comm, "auto", "none", overlap=False)
        self.metrics_host.name = "metric allreduce"
        self.timeline = self.host.timeline = self.metrics_host.timeline = trace.make(torus_comm)
        self.save_notices = saving.SaveNotices(torus_comm)
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
        """All-reduce of a gradient list for custom loops (mean over ranks by default): dense ones as in
        ``loop.allreduce_tensors``, ``tf.IndexedSlices`` all-gathered as IndexedSlices unless
        ``sparse_as_dense`` (``sparse.reduce_gradients``)."""
        return reduce_gradients(self.host, list(grads), op)

    def broadcast_variables(self, variables, root: int = 0) -> None:
        """Give every rank rank ``root``'s values (eager, collective, bounded by the stall timeout); see
        ``loop.broadcast_variables``."""
        broadcast_variables(self.torus_comm, variables, root)

    def average_logs(self, model, logs: dict) -> dict:
        """Returns ``logs`` unchanged: ``evaluate`` under the strategy returns global values already (kept for
        existing code that called it after ``evaluate``)."""
        return logs

    def callbacks(self) -> list:
        """``[]``: the initial broadcast and global metrics happen inside ``fit`` without callbacks (kept for
        existing code that lists ``strategy.callbacks() + [...]``)."""
        return []
