"""TorusStrategy: data-parallel ``model.fit`` over MPI ranks, as a ``tf.distribute.Strategy``.

Underneath it is TensorFlow's one-device strategy (variables and compute on this process' CPU or its one GPU) with
overrides in its extended class: the replica count is the number of MPI ranks, and ``reduce_to`` /
``batch_reduce_to`` (the replica context's collectives) run the reducer (``collectives/reducer.py``). Gradients
reach it on their own route (``fit/optimizer.py``): at the start of ``optimizer.apply`` inside ``fit``, else
where Keras' optimizer sums them. Keras scales each rank's loss by ``1 / num_replicas_in_sync``, so the summed
gradient is the mean over the global batch and one step equals one single-process step on the concatenated batch (up
to summation order). ``experimental_distribute_dataset`` (Keras' route for every input) returns this rank's share
(``inputs.split_batches``) as a plain ``tf.data`` dataset, without TF's MultiDeviceIterator;
``distribute_datasets_from_function`` gives ``dataset_fn`` one input pipeline per rank and returns its dataset as
this rank's. The variable creator gives every variable created under the scope rank 0's initial value
(``creation.py``).

This relies on TensorFlow internals (``OneDeviceExtended``: its private methods are overridden), resolved and
checked at import by ``compat.py`` against the tested range in pyproject.toml; tests/mpi/test_keras_*.py guard
it. Why not ``MirroredStrategy``: with one local device it never calls custom cross-device ops.
"""
from __future__ import annotations

from typing import ClassVar

import tensorflow as tf
from mpi4py import MPI

from torus import TorusComm, agreement, faults, knobs
from torus.errors import MismatchError
from torus.integrations.keras import compat
from torus.integrations.keras.collectives import trace
from torus.integrations.keras.collectives.host import HostAllreduce
from torus.integrations.keras.collectives.loop import broadcast_variables, stall_timeout, wait_for_every_rank
from torus.integrations.keras.collectives.reducer import reduce_gradients
from torus.integrations.keras.creation import InitialValues
from torus.integrations.keras.fit import fit_hook, inputs, saving, snapshots
from torus.schedules import registry


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
    def __init__(self, container, host: HostAllreduce, replica_host: HostAllreduce, device: str):
        super().__init__(container, device)
        self._host = host
        self._replica_host = replica_host  # the replica context's collectives (TorusStrategy.__init__)
        self._initial_values = InitialValues(host.torus_comm)

    @property
    def _num_replicas_in_sync(self):
        return self._host.torus_comm.size

    def _reduce_to(self, reduce_op, value, destinations, options):
        flat = tf.nest.flatten(value, expand_composites=False)
        reduced = self._batch_reduce_to(reduce_op, [(v, destinations) for v in flat], options)
        return tf.nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        # The replica context's collectives (SyncBN's moments, ctx.all_reduce, strategy.reduce): gradients reach
        # the reducer on their own route (gradients.py), never this one.
        values = [_local(v) for v, _ in value_destination_pairs]
        op = "avg" if reduce_op == tf.distribute.ReduceOp.MEAN else "sum"
        return reduce_gradients(self._replica_host, values, op)  # IndexedSlices stay sparse (sparse.py)

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


def _agree_settings(torus_comm, settings: dict) -> None:
    """``MismatchError`` on every rank when the ranks' ``settings`` (the resolved overlap, the algorithm, the
    compression, sparse_as_dense) differ: each decides which collectives a step issues, so ranks that differ
    would pair the wrong messages or wait forever. One ``MPI_Iallgather`` bounded by the stall timeout, before
    the strategy's first collective that depends on them. Collective; nothing at one rank."""
    if torus_comm.size == 1:
        return
    rank, timeout = torus_comm.rank, stall_timeout(torus_comm)
    text = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    differ, texts = agreement.texts_that_differ(torus_comm.comm, text, timeout, lambda: (
        f"TorusStrategy on rank {rank}: no progress for {timeout:g} s comparing the ranks' settings: some rank "
        "did not construct it (it raised, exited or is stuck)"))
    if differ:
        raise MismatchError(
            f"TorusStrategy on rank {rank}: {agreement.ranks_text(differ)} constructed it with other settings "
            f"than rank 0 (rank 0: {texts[0]}; rank {differ[0]}: {texts[differ[0]]}): pass the same arguments "
            "and TORUS_OVERLAP / TORUS_ALGO on every rank")


class TorusStrategy(tf.distribute.Strategy):
    """Synchronous data parallelism across the ranks of an MPI communicator, one replica per rank.

    Usage, under ``mpiexec -n N python train.py``: ``strategy = TorusStrategy()``, build and compile the model
    under ``with strategy.scope():``, then ``model.fit(x, y, batch_size=GLOBAL_BATCH, ...)`` with the same
    arrays on every rank. Inside ``fit`` / ``evaluate`` / ``predict``, whatever callbacks are passed: rank 0's
    variables and optimizer state reach every rank first; metric states are summed over ranks, so logs and
    callback decisions are global; gradients are all-reduced at the start of ``optimizer.apply`` (before
    clipping and the loss-scale check); files are written once. Custom loops follow tf.distribute's contract
    (``strategy.run``, ``strategy.reduce``, ``distribute_datasets_from_function``); every variable created
    under ``scope()`` starts from rank 0's value (collective: the same variables on every rank, in order).
    The contract, every feature and its limits: docs/keras.md.

    Parameters
    ----------
    dims : (int, int), optional
        The X x Y grid for ``TorusComm`` (default: TorusComm's).
    algorithm : str
        "auto" or a registered algorithm (torus/schedules/registry.py: "ring", "hierarchical", "torus2d", "swing",
        "native", ...).
    compression : str
        "none", "fp16" or "bf16": the wire format of the float32 gradient buffer.
    comm : mpi4py.MPI.Intracomm or TorusComm, optional
        The ranks (default ``MPI.COMM_WORLD``); a ``TorusComm`` is used as is (``dims`` then ignored); its stall
        timeout bounds every collective the strategy issues.
    device : str
        Where variables and compute live (default "/cpu:0").
    abort_on_exception : bool
        Install ``torus.faults.abort_on_exception`` for the strategy's communicator (default True).
    overlap : bool, optional
        All-reduce the gradients in buckets on a communication thread during backprop. Default (None):
        ``TORUS_OVERLAP``, else on where the ranks span several nodes.
    bucket_bytes : int, optional
        The bucket cap in bytes (default ``TORUS_BUCKET_BYTES``, else 25 MiB; the first bucket at most 1 MiB).
    sparse_as_dense : bool
        False (default): sparse gradients are all-gathered as IndexedSlices; True: made dense and summed.
    snapshot_steps, snapshot_seconds : int, float, optional
        Where the job has an id (``TORUS_JOB_ID``, set by ``torus-run``): a snapshot of the training state
        every this many steps or seconds, whichever comes first (default ``TORUS_SNAPSHOT_STEPS``,
        ``TORUS_SNAPSHOT_SECONDS``; 0 turns one off), and ``fit`` resumes from the newest (``fit/snapshots.py``).

    ``strategy.timeline`` records a Chrome trace where ``TORUS_TIMELINE=FILE`` is set, else None. Collective:
    every rank constructs it together. Raises ``ValueError`` for an unknown algorithm or compression.
    """

    latest: ClassVar[TorusStrategy | None] = None  # the one this process created last (fit_hook.strategy_of)
    local_depth: ClassVar[int] = 0  # > 0 inside fit_hook.local(): fit / evaluate / predict run as plain Keras

    def __init__(self, dims=None, algorithm: str = "auto", compression: str = "none", comm=None,
                 device: str = "/cpu:0", abort_on_exception: bool = True, overlap: bool | None = None,
                 bucket_bytes: int | None = None, sparse_as_dense: bool = False, snapshot_steps: int | None = None,
                 snapshot_seconds: float | None = None):
        if algorithm != "auto" and algorithm not in registry.names():
            raise ValueError(f"TorusStrategy: unknown algorithm {algorithm!r}; expected auto or one of "
                             f"{', '.join(registry.names())}")
        torus_comm = comm if isinstance(comm, TorusComm) else TorusComm(comm, dims)
        if abort_on_exception:
            faults.abort_on_exception(torus_comm.comm)
        if not isinstance(sparse_as_dense, bool):
            raise TypeError(f"TorusStrategy: sparse_as_dense must be True or False, not {sparse_as_dense!r}")
        self.host = HostAllreduce(torus_comm, algorithm, compression, overlap=overlap, bucket_bytes=bucket_bytes,
                                  sparse_as_dense=sparse_as_dense)
        _agree_settings(torus_comm, {"overlap": self.host.overlap, "algorithm": algorithm,
                                     "compression": compression, "sparse_as_dense": sparse_as_dense,
                                     "job id": knobs.read("TORUS_JOB_ID")})
        self.snapshots = snapshots.Session.create(torus_comm, snapshot_steps, snapshot_seconds)
        # With overlap, the replica context's collectives (SyncBN's moments, strategy.reduce inside run) and the
        # metric all-reduce get a TorusComm of their own, run inline on TensorFlow's thread beside the buckets
        # on the communication thread (which needs MPI_THREAD_MULTIPLE): then the bucket starts need not come
        # after them in program order, and SyncBN's backward all-reduces no longer gate the first bucket.
        apart = self.host.overlap and torus_comm.size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        replica_comm = torus_comm.Dup() if apart else torus_comm
        self.host.replica_apart = apart
        self.replica_host = HostAllreduce(replica_comm, algorithm, compression, overlap=False,
                                          sparse_as_dense=sparse_as_dense) if apart else self.host
        self.metrics_host = HostAllreduce(replica_comm, "auto", "none", overlap=False)
        self.metrics_host.name = "metric allreduce"
        self.timeline = self.host.timeline = self.metrics_host.timeline = trace.make(torus_comm)
        if apart:  # beside the buckets' spans, on a lane of their own
            self.replica_host.timeline, self.replica_host.name = self.timeline, "replica allreduce"
            self.replica_host.lane = self.metrics_host.lane = "replica"
        self.save_notices = saving.SaveNotices(torus_comm)
        self.next_split = "eval"  # how inputs.split_batches splits the next dataset (fit's inputs stage: "train")
        super().__init__(_TorusExtended(self, self.host, self.replica_host, device))
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

    def barrier(self) -> None:
        """Return once every rank has called ``barrier`` (collective; ``MPI_Ibarrier`` on this strategy's
        communicator). Bounded by the stall timeout: ``torus.errors.TimeoutError`` naming this rank where some
        rank never comes. For what one rank does alone that the others then read, e.g.
        ``if strategy.is_chief: model.save(path)`` followed by ``keras.models.load_model(path)`` on every rank
        (``fit`` itself returns only once rank 0's ``ModelCheckpoint`` / ``BackupAndRestore`` files are in
        place)."""
        wait_for_every_rank(self.torus_comm, "TorusStrategy.barrier")

    def allreduce_gradients(self, grads, op: str = "avg"):
        """All-reduce of a gradient list for custom loops (mean over ranks by default): dense ones as in
        ``reducer.allreduce_tensors``, ``tf.IndexedSlices`` all-gathered as IndexedSlices unless
        ``sparse_as_dense`` (``reducer.reduce_gradients``)."""
        return reduce_gradients(self.host, list(grads), op)

    def broadcast_variables(self, variables, root: int = 0) -> None:
        """Give every rank rank ``root``'s values (eager, collective, bounded by the stall timeout); see
        ``loop.broadcast_variables``."""
        broadcast_variables(self.torus_comm, variables, root)

    def resume(self, variables, model=None) -> dict | None:
        """Custom loops, once before the first step: where the job has an id (``TORUS_JOB_ID``, set by
        torus-run), assign the newest snapshot any rank holds of this job and of these ``variables`` (the
        model's and the optimizer's, the same list ``snapshot`` gets: build the optimizer first) and return its
        meta dict, with ``"step"`` the global step it was taken after; None where there is none or snapshots
        are off. ``model`` (a Keras model, optional): its layers' configurations key the snapshots too, as
        under ``fit``, so that a model changed without changing its variables (another activation) starts
        fresh; without it the variables' shapes and dtypes alone key them. Collective. The loop then continues
        at ``step`` (its data position is the loop's: put what it needs in ``snapshot``'s meta)."""
        if self.snapshots is None:
            return None
        if model is not None:
            self.snapshots.architecture = snapshots.architecture(model)
        return self.snapshots.resume(list(variables))

    def snapshot(self, variables, step: int, **meta) -> None:
        """Custom loops, after every step: a snapshot of ``variables`` after global step ``step`` (int), with
        ``meta`` (JSON values: epoch, batch, seed...), when one is due (``snapshot_steps`` /
        ``snapshot_seconds``), written in the background by one rank per node. Not collective, and nothing
        where snapshots are off."""
        if self.snapshots is not None:
            self.snapshots.take(list(variables), int(step), meta)

    def average_logs(self, model, logs: dict) -> dict:
        """Returns ``logs`` unchanged: ``evaluate`` under the strategy returns global values already (kept for
        existing code that called it after ``evaluate``)."""
        return logs

    def callbacks(self) -> list:
        """``[]``: the initial broadcast and global metrics happen inside ``fit`` without callbacks (kept for
        existing code that lists ``strategy.callbacks() + [...]``)."""
        return []
