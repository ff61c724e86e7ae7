"""``DistributedOptimizer``: a Keras 3 optimizer whose ``apply`` all-reduces the gradients first.

As in Horovod, the result is an instance of a class made on the fly that derives from the wrapped optimizer's
class and keeps its name, module and config, so ``model.save`` writes a plain optimizer (e.g. ``Adam``) that
loads without torus; wrap it again after loading. The optimizer is rebuilt from ``get_config()``, so state
already held by the optimizer passed in (slots, iterations) is dropped, as in Horovod.
"""
from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from torus.integrations.keras import compat
from torus.integrations.keras.collectives.reducer import reduce_gradients
from torus.integrations.keras.collectives.sparse import deterministic_scatters
from torus.integrations.keras.horovod.basics import rank
from torus.integrations.keras.horovod.collectives import Average, Sum, host_allreduce
from torus.integrations.keras.horovod.compression import Compression


class _Reducer:
    """What ``apply`` needs: the host all-reduce, the op and its scaling, the local accumulation state."""

    def __init__(self, host, op, predivide, passes, average_aggregated, sparse_as_dense=False):
        self.host, self.passes, self.sparse_as_dense = host, passes, sparse_as_dense
        self.op = "sum" if predivide != 1.0 else op
        self.pre = 1.0 / predivide
        self.post = predivide / host.torus_comm.size if predivide != 1.0 else 1.0
        self.divisor = float(passes if average_aggregated else 1)
        self.accumulators: dict = {}  # id(variable) -> tf.Variable (not tracked: not saved, not broadcast)
        self.counter = None

    def reduce(self, grads):
        """The non-None entries of ``grads`` over ranks: dense ones all-reduced in one fused call, IndexedSlices
        all-gathered as IndexedSlices (densified with the dense ones where ``sparse_as_dense``); None stays None."""
        present = [i for i, g in enumerate(grads) if g is not None]
        chosen = [_scaled(grads[i], self.pre) for i in present]
        reduced = reduce_gradients(self.host, chosen, self.op, self.sparse_as_dense)
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = _scaled(r, self.post)
        return out


def _scaled(gradient, factor: float):
    if factor == 1.0:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor


class _DistributedMixin:
    """Placed before the wrapped optimizer's class in the MRO; ``self._torus`` is a ``_Reducer``."""

    _torus_self_distributed = True  # fit_hook leaves its models to plain Keras (Horovod's semantics)

    def build(self, variables):
        super().build(variables)
        state = self._torus
        if state.passes > 1:
            with tf.init_scope():
                state.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_passes")
                for v in variables:
                    state.accumulators[id(v)] = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                                            name="hvd_accumulator")

    def apply(self, grads, trainable_variables=None):
        deterministic_scatters(self)  # sparse updates: the same bits on every rank (sparse.py)
        state, grads = self._torus, list(grads)
        if state.passes == 1:
            return super().apply(state.reduce(grads), trainable_variables)
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        if not self.built:
            self.build(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        accumulators = [state.accumulators[id(variables[i])] for i in present]
        for i, acc in zip(present, accumulators):
            acc.assign_add(tf.convert_to_tensor(grads[i]))
        count = state.counter.assign_add(1)
        apply_reduced = super().apply

        def update():
            reduced = state.reduce([acc.read_value() for acc in accumulators])
            full = list(grads)
            for i, r in zip(present, reduced):
                full[i] = r / state.divisor if state.divisor != 1.0 else r
            apply_reduced(full, trainable_variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            state.counter.assign(0)

        def skip():
            # Horovod counts every backward pass in `iterations`, applied or not.
            self._iterations.assign_add(1)

        tf.cond(tf.equal(count, state.passes), update, skip)


_CLASSES: dict = {}


def _distributed_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_DistributedMixin, base),
                              {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return _CLASSES[base]


def is_distributed(optimizer) -> bool:
    """True for an optimizer made by ``DistributedOptimizer``."""
    return isinstance(optimizer, _DistributedMixin)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, algorithm="auto"):
    """Wrap a ``keras.optimizers.Optimizer`` (Keras 3, TensorFlow backend) so every update uses the gradients
    all-reduced over all ranks: one fused ``tf.numpy_function`` into ``TorusComm.allreduce`` per update.

    Works inside ``model.fit``'s compiled train step and in custom loops (``apply`` / ``apply_gradients``).
    Keras scales nothing by the number of ranks here: with ``op=Average`` each update is the mean of the
    ranks' gradients, i.e. the gradient of the global batch when every rank feeds an equal batch. Clipping
    (``clipnorm``, ``global_clipnorm``, ``clipvalue``) and weight decay run after the all-reduce, on the global
    gradient, as in one process. Scaling the learning rate by ``size()`` is the caller's job, as in Horovod.

    Parameters (Horovod's; the first eight as documented there)
    ----------
    optimizer : keras.optimizers.Optimizer
        Any Keras 3 optimizer, including ``LossScaleOptimizer`` (wrap the loss-scale optimizer, not the other
        way round: see ``BroadcastGlobalVariablesCallback``).
    name : str, optional
        The optimizer's name (Keras' ``name``); default: the wrapped one's.
    sparse_as_dense : bool
        False (Horovod's default): a sparse gradient (``tf.IndexedSlices``, e.g. ``Embedding``'s) is all-gathered
        as IndexedSlices (every rank's rows and indices, in rank order; ``op=Average`` divides the rows by
        ``size()``), so the optimizer sees what one process sees on the global batch. True: made dense and
        all-reduced with the others (faster where the batch touches most of the rows). With
        ``backward_passes_per_step > 1`` sparse gradients are accumulated, hence all-reduced, dense.
    device_dense, device_sparse, num_groups, groups
        Accepted and ignored: dense gradients always travel in one fused buffer per dtype (the result does not
        depend on grouping).
    compression : hvd.Compression.none, .fp16 or .bf16
        Wire format of float32 gradients (see ``hvd.Compression``).
    gradient_predivide_factor : float
        With ``op=Average``: gradients are multiplied by ``1/f`` before the sum and by ``f/size`` after.
    op : hvd.Average or hvd.Sum
    backward_passes_per_step : int >= 1
        Accumulate this many local gradients (in untracked variables: not saved, not broadcast) and all-reduce
        and apply their sum every ``backward_passes_per_step``-th pass; ``iterations`` still counts every pass.
    average_aggregated_gradients : bool
        Divide the accumulated sum by ``backward_passes_per_step`` (only with ``backward_passes_per_step > 1``).
    algorithm : str
        torus extension: the ``TorusComm.allreduce`` algorithm ("auto", "ring", "torus2d", ...).

    Raises ``ValueError`` before ``hvd.init()``, for ``op`` other than Average/Sum, ``gradient_predivide_factor``
    with ``op=Sum`` or not positive, ``backward_passes_per_step < 1`` or an unknown compression; ``TypeError``
    when ``optimizer`` is not a Keras 3 optimizer. XLA (``jit_compile=True``) cannot compile the all-reduce:
    compile the model with ``jit_compile=False`` (``BroadcastGlobalVariablesCallback`` refuses it).
    """
    what = "hvd.DistributedOptimizer"
    host = host_allreduce(compression, algorithm, what)  # checks init and the compression first
    me = rank()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{what} on rank {me}: expected a keras.optimizers.Optimizer (Keras 3), got "
                        f"{type(optimizer).__name__}")
    if op not in (Average, Sum):
        raise ValueError(f"{what} on rank {me}: op must be hvd.Average or hvd.Sum, got {op!r}")
    if not gradient_predivide_factor > 0 or (gradient_predivide_factor != 1.0 and op != Average):
        raise ValueError(f"{what} on rank {me}: gradient_predivide_factor must be > 0 and needs op=hvd.Average, "
                         f"got {gradient_predivide_factor} with op {op!r}")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"{what} on rank {me}: backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    if is_distributed(optimizer):
        raise ValueError(f"{what} on rank {me}: the optimizer is already distributed")
    config = optimizer.get_config()
    if name:
        config["name"] = name
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped._torus = _Reducer(host, op, float(gradient_predivide_factor), int(backward_passes_per_step),
                              bool(average_aggregated_gradients), bool(sparse_as_dense))
    return wrapped


def _lost_its_slots(optimizer, model) -> bool:
    """Whether ``optimizer`` says it is built but holds fewer variables than the same optimizer built for
    ``model``'s trainable variables (what Keras 3.15's .h5 loader gives: built for no variables)."""
    if not optimizer.built or not model.trainable_variables or tf.distribute.has_strategy():
        return False  # (under a strategy's scope the throwaway build below would create its variables there)
    fresh = type(optimizer).from_config(optimizer.get_config())
    fresh.build(model.trainable_variables)
    return len(fresh.variables) > len(optimizer.variables)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """``keras.models.load_model(filepath)`` with the model's optimizer, and the state loaded into it, made
    distributed (``op=Average``, ``compression``), as Horovod's ``hvd.load_model``. ``custom_optimizers``:
    optimizer classes the file may name, added to ``custom_objects``. Every rank loads the file itself (put it
    where all can read it); ``ValueError`` before ``hvd.init()``. A ``.h5`` file: Keras 3.15 gives its optimizer
    back built for no variables and without its saved state; this warns (``UserWarning``), and broadcasting
    that optimizer to ranks that built theirs raises ``MismatchError`` saying so (save ``.keras`` instead).
    Not collective."""
    host = host_allreduce(compression, "auto", "hvd.load_model")
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = model.optimizer
    if optimizer is not None and _lost_its_slots(optimizer, model):
        warnings.warn(f"hvd.load_model on rank {rank()}: the optimizer loaded from {filepath} says it is built but "
                      f"holds no slot variables: Keras {keras.__version__} loads an optimizer from an .h5 file "
                      "that way (built for no variables, the saved optimizer state dropped). Broadcasting it to "
                      "ranks that built theirs raises MismatchError, and fit fails with 'Unknown variable' as in "
                      "plain Keras. Save checkpoints as .keras instead (model.save('model.keras'), "
                      "ModelCheckpoint('checkpoint-{epoch}.keras'))", stacklevel=2)
    if optimizer is not None and not is_distributed(optimizer):
        # Swap the class in place so the loaded slots and iterations stay; the subclass adds only methods.
        compat.swap_class(optimizer, _distributed_class(type(optimizer)))
        optimizer._torus = _Reducer(host, Average, 1.0, 1, False)
    return model
