"""How ``fit`` / ``evaluate`` / ``predict`` inputs are split over the ranks of a ``TorusStrategy``.

``batch_size`` is the global batch, as in ``keras.distribution.DataParallel`` and tf.distribute's
``experimental_distribute_dataset``: every rank reads the same global batches and trains on its contiguous
slice of each, rows ``[rank * B / N, (rank + 1) * B / N)``. One step at N ranks then equals one step of one
process on the global batch (Keras scales each rank's loss by ``1 / N``; the all-reduce sums).

What each kind of input does (arrays, ``PyDataset``, generators, ``tf.data``, datasets marked per rank):
docs/design.md ("Inputs"); ``split_batches`` below is where the split happens.

Every rank passes the same arguments: where ``x`` is arrays / tensors the ranks first compare row counts,
``batch_size``, validation rows and a sampled crc32 of the arrays (``agree.py``) and refuse, on every rank
before any step, arrays that differ (``x[rank::size]`` sharded by hand would otherwise train on ``1 / N`` of
the data, silently).

Training needs equal per-rank batches for exactness (Keras' loss scaling by ``1 / N``), so ``fit`` refuses a
global batch that does not split evenly: ``batch_size`` not a multiple of N, or a last partial batch of
``rows % batch_size`` rows not a multiple of N. Arrays are checked before anything runs (``ValueError``);
the message gives one ``batch_size`` and row count that satisfy both (:func:`even_fix`); datasets and
generators when such a batch arrives (``tf.errors.InvalidArgumentError``; every rank reads the
same batch, so all fail together). ``evaluate``, ``predict`` and fit's validation split any batch as evenly as
possible (ranks may get one row more, or an empty batch), which the global metric averaging weighs by sample
count; ``predict`` returns every row in input order on every rank (rows gathered per batch;
``steps_per_execution > 1`` is refused there).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from torus.integrations.keras import compat
from torus.integrations.keras.compat import array_data_adapter, array_slicing, data_adapter_utils
from torus.integrations.keras.fit import agree, dataset_agree, fit_hook

_MARK = "_torus_per_rank"
_DEFAULT_BATCH = 32  # Keras' own default for arrays


def per_rank(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Mark ``dataset`` as already holding this rank's share (per-rank batches); returns it. The mark
    survives later transformations (``batch``, ``map``, ``prefetch``...)."""
    setattr(dataset, _MARK, True)
    return dataset


def is_per_rank(dataset: tf.data.Dataset, size: int | None = None) -> bool:
    """Whether ``dataset`` or any dataset it was built from was marked by :func:`per_rank`, or (given the
    rank count ``size``) went through ``Dataset.shard(size, ...)``."""
    todo, seen = [dataset], set()
    while todo:
        ds = todo.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if getattr(ds, _MARK, False):
            return True
        if size and compat.shard_count(ds) == size:
            return True
        todo.extend(compat.dataset_inputs(ds))
    return False


def epoch_order(seed: int, epoch: int, count: int, batch_size: int | None = None) -> np.ndarray:
    """The order (int64 indices, shape ``(count,)``) in which rows or batches are served in ``epoch``:
    ``np.random.default_rng([seed, epoch]).permutation(count)``; with ``batch_size`` (Keras'
    ``shuffle="batch"``) a permutation within each consecutive block of ``batch_size`` instead."""
    rng = np.random.default_rng([seed, epoch])
    if batch_size is None:
        return rng.permutation(count)
    return np.concatenate([start + rng.permutation(min(batch_size, count - start))
                           for start in range(0, count, batch_size)] or [np.zeros(0, np.int64)])


class AgreedOrder(keras.utils.PyDataset):
    """Global batches served in :func:`epoch_order` for the epoch ``clock["epoch"]`` (set by fit's
    epoch-clock callback), from arrays (``source`` = ``(x, y, sample_weight)`` with ``batch_size``) or from a
    ``PyDataset`` (``source``; its batch order is permuted)."""

    def __init__(self, source, seed: int, clock: dict, *, batch_size: int | None = None,
                 within_batches: bool = False):
        template = source if isinstance(source, keras.utils.PyDataset) else None
        super().__init__(workers=getattr(template, "workers", 1),
                         use_multiprocessing=getattr(template, "use_multiprocessing", False),
                         max_queue_size=getattr(template, "max_queue_size", 10))
        self.source, self.seed, self.clock = source, seed, clock
        self.batch_size, self.within_batches = batch_size, within_batches
        if template is None:
            parts = list(source)
            while parts[-1] is None:  # (x, None, None) -> (x,); a None before a given part stays (Keras' rule)
                parts.pop()
            # lists as tuples, as Keras' array adapter does: tf.data takes no list in an element's structure
            self._rows = keras.tree.map_structure(np.asarray, keras.tree.lists_to_tuples(tuple(parts)))
            self._count = int(keras.tree.flatten(self._rows)[0].shape[0])
        else:
            self._count = len(source)
        self._cached: tuple = (None, None)

    def reseed(self, seed: int) -> None:
        """Serve every epoch from now on in ``seed``'s order (a resumed run takes its snapshot's seed)."""
        self.seed, self._cached = seed, (None, None)

    def _order(self) -> np.ndarray:
        epoch = self.clock["epoch"]
        if self._cached[0] != epoch:
            block = self.batch_size if self.within_batches else None
            self._cached = (epoch, epoch_order(self.seed, epoch, self._count, block))
        return self._cached[1]

    def __len__(self):
        return self._count if self.batch_size is None else math.ceil(self._count / self.batch_size)

    def __getitem__(self, index):
        order = self._order()
        if self.batch_size is None:
            return self.source[int(order[index])]
        rows = order[index * self.batch_size:(index + 1) * self.batch_size]
        return keras.tree.map_structure(lambda a: a[rows], self._rows)

    def on_epoch_begin(self):
        if self.batch_size is None:
            self.source.on_epoch_begin()

    def on_epoch_end(self):
        if self.batch_size is None:
            self.source.on_epoch_end()


class Replay:
    """A Python generator of batches as a ``tf.data`` dataset that loses none of them to Keras' peek.

    Under any tf.distribute strategy, fit and evaluate first draw one batch from a fresh iterator to build
    the model, then iterate again; a generator cannot restart, so that peek (and its prefetch) would swallow
    batches one process trains on. Here every odd-numbered iterator is taken for that peek: what it pulls is
    served again, first, by the next one. (Predict does not peek and is left alone.)"""

    def __init__(self, generator):
        self.generator = iter(generator)
        self.pulled = list(itertools.islice(self.generator, data_adapter_utils.NUM_BATCHES_FOR_TENSOR_SPEC))
        if not self.pulled or not isinstance(self.pulled[0], tuple):
            raise ValueError("TorusStrategy: a generator passed to fit/evaluate must yield tuples (x,), (x, y) "
                             "or (x, y, sample_weight), and at least one")
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2:
            yield from self.pulled
            for item in self.generator:
                self.pulled.append(item)
                yield item
        else:
            replay, self.pulled = self.pulled, []
            yield from replay
            yield from self.generator

    def dataset(self) -> tf.data.Dataset:
        spec = data_adapter_utils.get_tensor_spec(self.pulled)
        return tf.data.Dataset.from_generator(self, output_signature=spec)


def _is_generator(x) -> bool:
    return inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__"))


def _agreed_seed(strategy) -> int:
    # Drawn on every rank, so numpy's global state moves alike on all of them (drawn on rank 0 alone, the user's
    # next np.random draw differed per rank); rank 0's draw wins where the states differed before.
    mine = int(np.random.randint(2 ** 31 - 1))
    return strategy.torus_comm.comm.bcast(mine, root=0)


def even_fix(rows: int, batch_size: int, size: int) -> tuple[int, int]:
    """The ``(batch_size, rows)`` closest below the given ones (``batch_size`` at least ``size``) with which every
    global batch, the last partial one too, splits evenly over ``size`` ranks. Both must be multiples of
    ``size``, and that suffices: then every full batch and the last one, ``rows % batch_size``, are too.
    ``rows`` comes back 0 when there are fewer rows than ranks."""
    return batch_size - batch_size % size or size, rows - rows % size


def _check_even(strategy, rows: int, batch_size: int, validation_split: float = 0.0) -> None:
    size = strategy.size
    last = rows % batch_size
    if not batch_size % size and not last % size:
        return
    what = []
    if batch_size % size:
        what.append(f"batch_size={batch_size} is not a multiple of {size} ranks")
    if last % size:
        what.append(f"the last batch of each epoch holds {last} rows ({rows} rows, batch_size={batch_size}), "
                    f"not a multiple of {size} ranks")
    batch, keep = even_fix(rows, batch_size, size)
    training = f" of the {rows} that validation_split={validation_split:g} leaves" if validation_split else ""
    if keep == 0:
        fix = f"there are fewer training rows ({rows}) than ranks: pass more rows or run on fewer ranks"
    elif keep == rows:
        fix = f"e.g. batch_size={batch} and all {rows} rows"
    else:
        fix = f"e.g. batch_size={batch} and the first {keep} training rows{training} (x[:{keep}], y and " \
              "sample_weight alike)"
    counts = [r for r in range(1, 1 + max(size, 8) * 4) if not batch_size % r and not last % r]
    what.append(f"rank counts that split it evenly: {', '.join(map(str, counts))}")
    raise ValueError(f"TorusStrategy fit on rank {strategy.rank}: {'; '.join(what)}. batch_size is the global "
                     "batch and every rank needs an equal share of every batch, the last one too, for the result "
                     "to equal one process' (Keras scales each rank's loss by 1/ranks): batch_size and the number "
                     f"of training rows must both be multiples of {size} ({fix}), or pass per-rank data with "
                     "strategy.shard(tf.data.Dataset...)")


def build_without_peeking(original):
    """``TensorFlowTrainer._maybe_symbolic_build`` (``original``) that, for a model of a TorusStrategy, builds
    from the epoch dataset's ``element_spec`` instead of a batch pulled from a started iterator. Keras' peek (under
    every ``tf.distribute`` strategy) starts the dataset once before the first epoch, so a dataset shuffled with a
    seed and ``reshuffle_each_iteration`` would train its first epoch on its second order, unlike one process;
    a symbolic build needs only shapes and dtypes."""

    @functools.wraps(original)
    def build(self, iterator=None, data_batch=None):
        if iterator is not None and data_batch is None and fit_hook.strategy_of(self) is not None:
            if type(self).call is keras.Model.call:
                # No call() (the keras.io GAN: its own train_step over sub-models): nothing to build from a
                # batch, which Keras' symbolic build fails on under any strategy; built in its first step, as
                # Keras builds every model without one.
                return None
            dataset = compat.epoch_dataset(iterator)
            if isinstance(dataset, tf.data.Dataset):
                return original(self, data_batch=dataset.element_spec)
        return original(self, iterator=iterator, data_batch=data_batch)

    return build


def prepare_inputs(call) -> None:
    """fit_hook stage "inputs": arrays split-checked and served in the agreed order, PyDatasets in it too."""
    strategy, method, arguments = call.strategy, call.method, call.arguments
    agree.agree_arrays(strategy, method, arguments)
    dataset_agree.agree_datasets(strategy, method, arguments)
    strategy.next_split = "train" if method == "fit" else "eval"
    if method == "predict" and strategy.size > 1 and arguments["self"].steps_per_execution > 1:
        raise ValueError(f"TorusStrategy predict on rank {strategy.rank}: steps_per_execution > 1 is not "
                         "supported (rows are gathered per batch); compile with steps_per_execution=1")
    if method == "evaluate" and _is_generator(arguments["x"]):
        arguments["x"] = Replay(arguments["x"]).dataset()
    if method != "fit":
        return
    if _is_generator(arguments["validation_data"]):
        arguments["validation_data"] = Replay(arguments["validation_data"]).dataset()
    if _is_generator(arguments["x"]):
        arguments["x"] = Replay(arguments["x"]).dataset()
        if arguments["shuffle"]:  # Keras' own warning, which the dataset above would turn into one about tf.data
            if strategy.is_chief:
                warnings.warn("`shuffle=True` was passed, but will be ignored since the data `x` was provided as "
                              "a generator. The generator is expected to yield already-shuffled data.",
                              stacklevel=3)  # the user's fit call
            arguments["shuffle"] = False
    x, shuffle = arguments["x"], arguments["shuffle"]
    clock = {"epoch": arguments["initial_epoch"]}
    call.scratch["clock"] = clock
    if array_data_adapter.can_convert_arrays((x, arguments["y"], arguments["sample_weight"])):
        split = 0.0
        if arguments["validation_split"] and arguments["validation_data"] is None:
            (x, y, sw), validation = array_slicing.train_validation_split(
                (x, arguments["y"], arguments["sample_weight"]), validation_split=arguments["validation_split"])
            split = arguments["validation_split"]
            arguments.update(x=x, y=y, sample_weight=sw, validation_data=validation, validation_split=0.0)
        batch_size = arguments["batch_size"] or _DEFAULT_BATCH
        rows = int(keras.tree.flatten(x)[0].shape[0])
        _check_even(strategy, rows, batch_size, split)
        if shuffle:
            source = (arguments["x"], arguments["y"], arguments["sample_weight"])
            arguments.update(x=AgreedOrder(source, _agreed_seed(strategy), clock, batch_size=batch_size,
                                           within_batches=shuffle == "batch"),
                             y=None, sample_weight=None, batch_size=None, shuffle=False,
                             validation_batch_size=arguments["validation_batch_size"] or batch_size)
    elif isinstance(x, keras.utils.PyDataset) and shuffle:
        if x.use_multiprocessing:
            raise ValueError(f"TorusStrategy fit on rank {strategy.rank}: a PyDataset with "
                             "use_multiprocessing=True cannot be shuffled in agreement across ranks; pass "
                             "shuffle=False (and shuffle inside the PyDataset with a seed shared by all ranks) "
                             "or use threads (use_multiprocessing=False)")
        arguments.update(x=AgreedOrder(x, _agreed_seed(strategy), clock), shuffle=False)


def _slice(element, lo, hi):
    return tf.nest.map_structure(lambda t: t[lo:hi], element)


def split_batches(strategy, dataset: tf.data.Dataset) -> tf.data.Dataset:
    """This rank's share of ``dataset`` (called by ``TorusStrategy.experimental_distribute_dataset``):
    per-rank datasets with their step counts equalised in training, global ones sliced per batch (evenly or
    refused in training, as evenly as possible otherwise) and the slices marked per rank (:func:`per_rank`)."""
    mode, strategy.next_split = strategy.next_split, "eval"  # fit's first dataset trains; the next ones validate
    if strategy.size == 1:
        return dataset
    if is_per_rank(dataset, strategy.size):
        return _equal_steps(strategy, dataset) if mode == "train" else dataset
    rank, size = strategy.rank, strategy.size
    for spec in tf.nest.flatten(dataset.element_spec):
        if not isinstance(spec, (tf.TensorSpec, tf.RaggedTensorSpec)) or spec.shape.rank == 0:
            raise ValueError(f"TorusStrategy on rank {rank}: cannot split a dataset element {spec} into per-rank "
                             "shares (only batched dense or ragged tensors split by rows); batch the dataset, or "
                             "feed each rank its own share with strategy.shard(dataset) before batching")

    def first(element):
        return tf.shape(tf.nest.flatten(element)[0])[0]

    if mode == "train":
        def share(element):
            n = first(element)
            check = tf.debugging.Assert(tf.equal(n % size, 0), [
                f"TorusStrategy fit on rank {rank}: a global batch of", n,
                (f"rows does not split evenly over {size} ranks; every batch (the last one too) must hold a "
                 f"multiple of {size} rows, e.g. batch(B, drop_remainder=True) with B a multiple of {size}")])
            with tf.control_dependencies([check]):
                b = n // size
            return _slice(element, rank * b, (rank + 1) * b)
    else:
        def share(element):
            n = first(element)
            return _slice(element, n * rank // size, n * (rank + 1) // size)
    # a tuple element arrives unpacked (and must go back a tuple, even of one); anything else arrives whole.
    # The shares are marked per rank: a custom loop that passes them to fit is not split again.
    if isinstance(dataset.element_spec, tuple):
        return per_rank(dataset.map(lambda *element: share(element)))
    return per_rank(dataset.map(share))


def _equal_steps(strategy, dataset):
    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(dataset.reduce(np.int64(0), lambda c, _: c + 1))  # one pass; assert_cardinality skips it
    counts = strategy.torus_comm.comm.allgather(count)
    finite = [c for c in counts if c != tf.data.INFINITE_CARDINALITY]
    if len(set(counts)) == 1 or not finite:
        return dataset
    least = min(finite)
    if strategy.is_chief:
        listed = ", ".join(f"rank {r}: {'infinite' if c < 0 else c}" for r, c in enumerate(counts))
        warnings.warn(f"TorusStrategy fit: the per-rank datasets hold different numbers of batches ({listed}); "
                      f"every rank runs {least} per epoch (dataset.take({least})), the rest are skipped",
                      stacklevel=2)
    return dataset.take(least)


class PredictRows(keras.callbacks.Callback):
    """Rows of every predict batch on this rank (for putting the gathered rows back in input order)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_predict_batch_end(self, batch, logs=None):
        self.rows.append(int(keras.tree.flatten(logs["outputs"])[0].shape[0]))


class EpochClock(keras.callbacks.Callback):
    """Tells :class:`AgreedOrder` which epoch fit is in."""

    def __init__(self, clock: dict):
        super().__init__()
        self.clock = clock

    def on_epoch_begin(self, epoch, logs=None):
        self.clock["epoch"] = epoch


def gather_predictions(call, result):
    """fit_hook stage "result" for predict: every rank's rows, gathered, in input order (per-rank inputs: in
    rank order)."""
    strategy, arguments = call.strategy, call.arguments
    if call.method != "predict" or strategy.size == 1:
        return result
    recorder = call.scratch["predict_rows"]
    gathered = strategy.torus_comm.comm.allgather((recorder.rows, result))
    x = arguments["x"]
    if isinstance(x, tf.data.Dataset) and is_per_rank(x, strategy.size):
        pieces = [out for _, out in gathered]
    else:
        offsets = [np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]) for rows, _ in gathered]
        pieces = [keras.tree.map_structure(lambda a, r=r, k=k: a[offsets[r][k]:offsets[r][k + 1]],
                                           gathered[r][1])
                  for k in range(len(gathered[0][0])) for r in range(strategy.size)]
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *pieces)


def input_callbacks(call) -> None:
    """fit_hook stage "callbacks": fit's epoch clock (for :class:`AgreedOrder`) and predict's row recorder,
    added to a copy of the user's list (a ``CallbackList`` gets them appended)."""
    strategy, arguments = call.strategy, call.arguments
    if call.method == "fit":
        extra = EpochClock(call.scratch["clock"])
    elif call.method == "predict" and strategy.size > 1:
        extra = call.scratch["predict_rows"] = PredictRows()
    else:
        return
    callbacks = arguments["callbacks"]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(extra)
    else:
        arguments["callbacks"] = [extra] + list(callbacks or [])
