"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017, arXiv:1708.03888, Algorithm 1)."""
from __future__ import annotations

import re

import keras
import tensorflow as tf
from keras import ops

# Batch-norm parameters and biases: the parameters LARS papers leave out of weight decay and of the trust
# ratio (You et al. 2017 section 3; Goyal et al. 2017 section 5.1 for weight decay on them).
DEFAULT_EXCLUDE = ("bias", "beta", "gamma", "batch_norm", "bn")


@keras.saving.register_keras_serializable(package="torus")
class LARS(keras.optimizers.Optimizer):
    """Momentum SGD with a per-layer trust ratio (You, Gitman, Ginsburg 2017, arXiv:1708.03888, Alg. 1).

    For every variable ``w`` (a layer's kernel, say) with gradient ``g``, each step::

        trust ratio  λ = η · ‖w‖ / (‖g‖ + β · ‖w‖ + ε)      (λ = 1 when ‖w‖ = 0 or ‖g‖ = 0)
        velocity     v ← m · v + lr · λ · (g + β · w)
        weights      w ← w − v
        nesterov     w ← w − (m · v + lr · λ · (g + β · w))              (v already updated)

    with η = ``trust_coefficient``, β = ``weight_decay``, m = ``momentum``, lr = ``learning_rate`` (a float or
    a ``keras.optimizers.schedules.LearningRateSchedule``), norms Euclidean over the whole variable. A variable
    excluded from layer adaptation uses λ = 1 (plain momentum SGD); one excluded from weight decay uses β = 0 in
    both the ratio and the update. The velocity ``v`` is one slot per variable, of the variable's shape and
    dtype. Sparse gradients (``tf.IndexedSlices``, from ``Embedding``) are made dense first, so the ratio and
    the update equal those of the dense gradient. Norms and the update are computed in the variable's dtype;
    λ is finite for any finite input (the zero guard above; ε > 0 adds a margin).

    Difference from TF Model Garden's ``LARS`` (``official/modeling/optimization/lars.py``): it uses
    λ = η · ‖w‖ / ‖g + β · w‖ (the norm of the decayed gradient, no ε) and applies the ratio only when both
    norms are positive. Here the denominator is the paper's ``‖g‖ + β‖w‖`` (an upper bound of ``‖g + βw‖``, so
    λ here is never larger) plus ``epsilon`` for safety.

    Parameters
    ----------
    learning_rate : float or LearningRateSchedule
        Global learning rate lr (default 0.1).
    momentum : float
        m in [0, 1) (default 0.9).
    trust_coefficient : float
        η (default 0.001, the value in Model Garden and NVIDIA's LARC implementations). Only the product lr · η
        sets the step size of adapted layers (λ·lr·‖g‖ ≈ lr·η·‖w‖ for small β), so η and lr trade off; the
        paper's ImageNet runs pair a large lr (2 to 29 with polynomial decay) with a small η. Raise η to 0.01
        when the learning rate comes from the linear-scaling rule at ordinary SGD values (lr ≈ 0.1 per 256).
        What η = 0.001 with lr = 1.0 per 256 images did at global batches of 512 to 8192, alone and with
        batch-size control: docs/keras.md, "Choosing a large batch" (bench/large_batch/).
    weight_decay : float
        β, L2 decay coupled into the gradient as in the paper (default 0). This is not Keras' decoupled
        ``weight_decay``; the base class' decoupled decay is never applied.
    epsilon : float
        ε added to the ratio's denominator (default 1e-6).
    nesterov : bool
        Nesterov momentum as written above (default False).
    exclude_from_weight_decay, exclude_from_layer_adaptation : list of str, optional
        Regular expressions searched in ``variable.path`` (e.g. ``"dense_1/bias"``). ``None`` (the default)
        excludes batch-norm parameters and biases: variables of rank <= 1 or whose path matches
        ``bias|beta|gamma|batch_norm|bn``. A list (``[]`` included) replaces that rule.
    name : str
        Optimizer name (default "lars"). Other keyword arguments (``clipnorm``, ``global_clipnorm``, ...)
        go to ``keras.optimizers.Optimizer``.

    Raises ``ValueError`` for momentum outside [0, 1) or a negative trust coefficient, weight decay or epsilon.
    """

    def __init__(self, learning_rate=0.1, momentum=0.9, trust_coefficient=0.001, weight_decay=0.0,
                 epsilon=1e-6, nesterov=False, exclude_from_weight_decay=None,
                 exclude_from_layer_adaptation=None, name="lars", **kwargs):
        kwargs.pop("weight_decay", None)
        super().__init__(learning_rate=learning_rate, name=name, weight_decay=None, **kwargs)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1), got {momentum}")
        for key, value in (("trust_coefficient", trust_coefficient), ("weight_decay", weight_decay),
                           ("epsilon", epsilon)):
            if value < 0:
                raise ValueError(f"LARS: {key} must be >= 0, got {value}")
        self.momentum = float(momentum)
        self.trust_coefficient = float(trust_coefficient)
        self.lars_weight_decay = float(weight_decay)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self._exclude_wd = None if exclude_from_weight_decay is None else list(exclude_from_weight_decay)
        self._exclude_la = (None if exclude_from_layer_adaptation is None
                            else list(exclude_from_layer_adaptation))

    @staticmethod
    def _excluded(variable, patterns) -> bool:
        if patterns is None:
            return len(variable.shape) <= 1 or re.search("|".join(DEFAULT_EXCLUDE), variable.path) is not None
        return any(re.search(p, variable.path) for p in patterns)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.velocities = self.add_optimizer_variables(variables, "velocity")
        # Decided once per variable, in Python, so the traced step holds no string matching.
        self._decay = [not self._excluded(v, self._exclude_wd) for v in variables]
        self._adapt = [not self._excluded(v, self._exclude_la) for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        if isinstance(gradient, tf.IndexedSlices):
            # Densify (summing repeated rows): ‖g‖ of the raw slices would count a repeated row twice.
            gradient = tf.convert_to_tensor(gradient)
        g = ops.cast(gradient, dtype)
        w = ops.convert_to_tensor(variable)
        beta = self.lars_weight_decay if self._decay[index] else 0.0
        if beta:
            g_decayed = ops.add(g, ops.multiply(ops.cast(beta, dtype), w))
        else:
            g_decayed = g
        if self._adapt[index]:
            w_norm = ops.sqrt(ops.sum(ops.square(w)))
            g_norm = ops.sqrt(ops.sum(ops.square(g)))
            denom = g_norm + ops.cast(beta, dtype) * w_norm + ops.cast(self.epsilon, dtype)
            ratio = ops.cast(self.trust_coefficient, dtype) * w_norm / denom
            both = ops.logical_and(ops.greater(w_norm, 0), ops.greater(g_norm, 0))
            lr = lr * ops.where(both, ratio, ops.ones_like(ratio))
        step = ops.multiply(lr, g_decayed)
        v = self.velocities[index]
        m = ops.cast(self.momentum, dtype)
        self.assign(v, ops.add(ops.multiply(m, v), step))
        if self.nesterov:
            self.assign_sub(variable, ops.add(ops.multiply(m, v), step))
        else:
            self.assign_sub(variable, v)

    def get_config(self):
        config = super().get_config()
        config.update(momentum=self.momentum, trust_coefficient=self.trust_coefficient,
                      weight_decay=self.lars_weight_decay, epsilon=self.epsilon, nesterov=self.nesterov,
                      exclude_from_weight_decay=self._exclude_wd,
                      exclude_from_layer_adaptation=self._exclude_la)
        return config
