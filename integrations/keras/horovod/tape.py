"""Horovod's ``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (``horovod.tensorflow``, 0.28.1).

Horovod's TF2 custom loop::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)      # averaged over ranks
    opt.apply_gradients(zip(grads, model.trainable_variables))

``tape.gradient`` returns what ``tf.GradientTape.gradient`` returns (same structure, shapes and dtypes), with
every gradient reduced over all ranks by the same code as ``hvd.DistributedOptimizer``: the dense ones fused
into one buffer per dtype and all-reduced in one ``tf.numpy_function`` (``collectives.reducer.allreduce_tensors``),
``tf.IndexedSlices`` all-gathered as IndexedSlices (``collectives.reducer.reduce_gradients``) unless
``sparse_as_dense``. Works eagerly and inside a ``tf.function`` (not under XLA: ``jit_compile=True`` cannot
compile the ``tf.numpy_function``). None gradients stay None and take no part in the all-reduce. Each call of
``gradient`` is collective: every rank calls it with the same sources (same shapes and dtypes, same gradients
None) in the same order.

Horovod 0.28.1's tape has no gradient aggregation (``backward_passes_per_step`` is an argument of
``DistributedOptimizer`` only, for Keras and for TF1 optimizers); neither has this one. Accumulate gradients
yourself, or use ``hvd.DistributedOptimizer(opt, backward_passes_per_step=k)`` with a plain tape.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from torus.integrations.keras.horovod.basics import rank, size
from torus.integrations.keras.horovod.collectives import Average, Sum, host_allreduce
from torus.integrations.keras.horovod.compression import Compression
from torus.integrations.keras.horovod.optimizer import _Reducer


class _DistributedTape:
    """Placed before the wrapped tape's class in the MRO. The instance shares the wrapped tape's ``__dict__``
    (what it recorded, whether it is persistent, what it watches); its own settings are slots of the class made
    for it, so wrapping never changes what the tape passed in does."""

    def register_local_source(self, source):
        """Gradients for ``source`` (a variable) stay this rank's own: not reduced, divided by ``size()`` where
        ``scale_local_gradients`` (Horovod's default)."""
        self._torus_local[id(source)] = source

    @tf.autograph.experimental.do_not_convert  # nothing to convert; AutoGraph would rewrite it on every trace
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient`` reduced over ranks (module docstring): the same structure, shapes and
        dtypes. ``use_generic_names`` is accepted (Horovod names its ops with it) and has no effect. Raises what
        TensorFlow raises; where ranks' gradients differ in count, size or dtype, ``TorusComm.allreduce``'s
        argument check raises ``torus.errors.MismatchError`` on every rank (inside a ``tf.function``, within
        TensorFlow's error for the failed ``tf.numpy_function``)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients=unconnected_gradients)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
        local = self._torus_local
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in local]
        for i, g in zip(shared, self._torus_reducer.reduce([flat[i] for i in shared])):
            flat[i] = g
        if local and self._torus_scale_local:
            n = size()
            for i, s in enumerate(flat_sources):
                if id(s) in local and flat[i] is not None:
                    g = flat[i]
                    flat[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape) \
                        if isinstance(g, tf.IndexedSlices) else g / n
        return tf.nest.pack_sequence_as(sources, flat)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient`` split into two lists of ``(source, gradient)``: the registered local sources' and the
        others', each in the order of ``sources`` (a flat list)."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if id(s) in self._torus_local else shared).append((s, g))
        return local, shared


_CLASSES: dict = {}


def _distributed_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_DistributedTape, base),
                              {"__module__": base.__module__, "__qualname__": base.__qualname__,
                               "__slots__": ("_torus_reducer", "_torus_local", "_torus_scale_local")})
    return _CLASSES[base]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=None, scale_local_gradients=True, algorithm="auto"):
    """A tape whose ``gradient`` returns the gradients reduced over all ranks (module docstring): an instance
    of a subclass of ``type(gradtape)`` over the same recorded state, as in Horovod. Wrap after the ``with``
    block, before ``gradient``; ``gradtape`` itself keeps giving local gradients.

    Parameters (Horovod's, as documented there)
    ----------
    gradtape : tf.GradientTape
        The tape that recorded the forward pass (persistent or not).
    compression : hvd.Compression.none, .fp16 or .bf16
        Wire format of float32 gradients (see ``hvd.Compression``; the sum accumulates in float32).
    sparse_as_dense : bool
        False: ``tf.IndexedSlices`` gradients are all-gathered as IndexedSlices (every rank's rows and indices, in
        rank order; ``op=Average`` divides the rows by ``size()``). True: made dense and all-reduced with the
        other gradients.
    op : hvd.Average (default) or hvd.Sum
        Average: the mean over ranks of the gradients, i.e. the gradient of the global batch's mean loss when
        every rank feeds an equal batch and takes the mean over its own.
    gradient_predivide_factor : float > 0
        With ``op=Average``: gradients are multiplied by ``1/f`` before the sum and by ``f/size`` after.
    scale_local_gradients : bool
        Divide the gradients of registered local sources (``register_local_source``) by ``size()``.
    device_dense, device_sparse, num_groups, groups
        Accepted and ignored: dense gradients travel in one fused buffer per dtype whatever the grouping.
    process_set
        Only None (every rank): process sets are not provided.
    algorithm : str
        torus extension: the ``TorusComm.allreduce`` algorithm ("auto", "ring", "torus2d", ...).

    Raises ``ValueError`` before ``hvd.init()``, for an ``op`` other than Average/Sum (Adasum is not provided),
    ``gradient_predivide_factor`` with ``op=Sum`` or not positive, ``groups`` that is neither a positive int nor a
    list, a ``process_set``, an unknown compression, or a tape that is already distributed; ``TypeError`` when
    ``gradtape`` is not a ``tf.GradientTape``.
    """
    what = "hvd.DistributedGradientTape"
    host = host_allreduce(compression, algorithm, what)  # checks init and the compression first
    me = rank()
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"{what} on rank {me}: expected a tf.GradientTape, got {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTape):
        raise ValueError(f"{what} on rank {me}: the tape is already distributed (its gradients would be "
                         "reduced twice)")
    if op not in (Average, Sum):
        raise ValueError(f"{what} on rank {me}: op must be hvd.Average or hvd.Sum, got {op!r} (Adasum is not "
                         "provided)")
    if not gradient_predivide_factor > 0 or (gradient_predivide_factor != 1.0 and op != Average):
        raise ValueError(f"{what} on rank {me}: gradient_predivide_factor must be > 0 and needs op=hvd.Average, "
                         f"got {gradient_predivide_factor} with op {op!r}")
    if groups is None and num_groups:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"{what} on rank {me}: groups must be a positive int or a list of lists of variables, "
                         f"got {groups!r}")
    if process_set is not None:
        raise ValueError(f"{what} on rank {me}: process sets are not provided (process_set={process_set!r}); "
                         "gradients are reduced over every rank")
    cls = _distributed_class(type(gradtape))
    tape = cls.__new__(cls)
    tape.__dict__ = gradtape.__dict__  # the same recording, not a copy (see _DistributedTape)
    tape._torus_reducer = _Reducer(host, op, float(gradient_predivide_factor), 1, False, bool(sparse_as_dense))
    tape._torus_local, tape._torus_scale_local = {}, bool(scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=None, local_layers=None,
                                   scale_local_gradients=True, algorithm="auto"):
    """``DistributedGradientTape`` whose gradients for the trainable weights of ``local_layers`` (a Keras layer
    or a list of them) are not reduced: each rank keeps its own (divided by ``size()`` where
    ``scale_local_gradients``). ``ValueError`` when ``local_layers`` holds something else than Keras layers;
    otherwise as ``DistributedGradientTape``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError(f"hvd.PartialDistributedGradientTape on rank {rank()}: local_layers must be Keras "
                         "layers")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients, algorithm)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
