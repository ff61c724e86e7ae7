"""The Keras and TensorFlow internals torus relies on, and every place it patches them, in one module.

Keras 3 has no public hook for what a data-parallel ``fit`` needs (its trainer's ``fit`` / ``evaluate`` /
``predict``, the metric results, the per-output loss trackers, the save entry points, the one-device strategy's
extended class), so torus reaches into ``keras.src`` and ``tensorflow.python``. Every such name is resolved
here, at import, and nowhere else in ``torus.integrations.keras`` (tests/test_keras_compat.py checks both):

- Keras or TensorFlow outside the tested range that pyproject.toml declares for the ``tf`` extra (read from
  the installed package's metadata): one ``UserWarning`` on rank 0 naming the range and the installed version;
- a module or attribute of ``REQUIRED`` missing (a Keras release moved it): ``ImportError`` naming it, the
  installed versions and the tested range, so a changed Keras fails at import, never as a silent local run.

Patch sites: ``install()`` (called by ``TorusStrategy.__init__``) iterates ``PATCH_SITES``, one row per class or
module attribute, and wraps each once per process with the wrapper its row names; a test holds every row to
``REQUIRED``. Per-object patches (an optimizer's ``apply``, a model's ``train_step``, a tracker's
``update_state``, a callback's class) go through ``set_on_instance`` / ``del_on_instance`` / ``swap_class``.
Subclasses that override private methods (``_TorusExtended`` in strategy.py, the rank-aware checkpoint callbacks
in files.py) are listed in ``REQUIRED`` so a renamed base method fails the import instead of silently never
being called.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED = ("keras", "tensorflow-cpu")  # the tf extra's requirements whose range is checked

_MODULES = {
    "trainer": "keras.src.backend.tensorflow.trainer",
    "base_trainer": "keras.src.trainers.trainer",
    "compile_utils": "keras.src.trainers.compile_utils",
    "array_data_adapter": "keras.src.trainers.data_adapters.array_data_adapter",
    "array_slicing": "keras.src.trainers.data_adapters.array_slicing",
    "data_adapter_utils": "keras.src.trainers.data_adapters.data_adapter_utils",
    "file_utils": "keras.src.utils.file_utils",
    "io_utils": "keras.src.utils.io_utils",
    "saving_api": "keras.src.saving.saving_api",
    "one_device_strategy": "tensorflow.python.distribute.one_device_strategy",
    "distribute_lib": "tensorflow.python.distribute.distribute_lib",
    "tf_optimizer": "keras.src.backend.tensorflow.optimizer",
    "eager_context": "tensorflow.python.eager.context",
    "stateful_random_ops": "tensorflow.python.ops.stateful_random_ops",
    "keras_global_state": "keras.src.backend.common.global_state",
}

# (module key or a public object, attributes that must exist on it)
REQUIRED: tuple[tuple[object, tuple[str, ...]], ...] = (
    ("trainer", ("TensorFlowTrainer",)),
    ("trainer.TensorFlowTrainer", ("fit", "evaluate", "predict", "make_train_function", "make_test_function",
                                   "train_step", "test_step", "_maybe_symbolic_build")),
    ("trainer", ("TFEpochIterator",)),
    ("trainer.TFEpochIterator", ("_get_iterator",)),
    ("base_trainer", ("Trainer",)),
    ("base_trainer.Trainer", ("get_metrics_result",)),
    ("compile_utils", ("CompileLoss",)),
    ("compile_utils.CompileLoss", ("call", "metrics")),
    ("array_data_adapter", ("can_convert_arrays",)),
    ("array_slicing", ("train_validation_split",)),
    ("data_adapter_utils", ("unpack_x_y_sample_weight", "get_tensor_spec", "NUM_BATCHES_FOR_TENSOR_SPEC")),
    ("file_utils", ("exists", "makedirs", "copy", "is_remote_path")),
    ("io_utils", ("ask_to_proceed_with_overwrite",)),
    ("saving_api", ("save_model", "save_weights")),
    ("one_device_strategy", ("OneDeviceExtended", "_OneDeviceReplicaContext")),
    ("one_device_strategy.OneDeviceExtended", ("_create_variable", "_reduce_to", "_batch_reduce_to",
                                               "_distribute_datasets_from_function",
                                               "_experimental_distribute_dataset", "_container_strategy",
                                               "_call_for_each_replica")),
    ("distribute_lib", ("_get_default_strategy",)),
    ("tf_optimizer", ("TFOptimizer", "filter_empty_gradients")),
    ("tf_optimizer.TFOptimizer", ("_all_reduce_sum_gradients",)),
    (keras.callbacks.ModelCheckpoint, ("_save_model",)),
    (keras.callbacks.BackupAndRestore, ("_save_model",)),
    (keras.layers.Layer, ("_flatten_layers",)),
    (keras.optimizers.Optimizer, ("_get_variable_index",)),
    (tf.data.Dataset, ("_inputs", "_as_serialized_graph")),
    ("eager_context", ("context",)),
    ("stateful_random_ops", ("global_generator",)),
    ("keras_global_state", ("get_global_attribute", "set_global_attribute")),
)

# Private attributes that subclasses here read or override on their Keras / TensorFlow base (``self._name``,
# ``super()._name``): the rest of the package may use these and no other inherited private name. Instance
# attributes among them (an optimizer's ``_iterations``, its ``_trainable_variables`` after ``build``) cannot be
# checked on the class; tests/test_keras_compat.py checks them on real objects.
INHERITED = frozenset({
    "_container_strategy", "_create_variable", "_reduce_to", "_batch_reduce_to", "_num_replicas_in_sync",
    "_distribute_datasets_from_function", "_experimental_distribute_dataset", "_call_for_each_replica",
    "_device",  # OneDeviceExtended (strategy.py)
    "_save_model",  # ModelCheckpoint / BackupAndRestore (files.py)
    "_get_variable_index", "_iterations", "_trainable_variables",  # keras.optimizers.Optimizer (lars, horovod)
})


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_range() -> dict[str, SpecifierSet]:
    """The tested version range of each of ``TESTED``, as the ``tf`` extra of the installed torus declares it
    (pyproject.toml); empty where torus is not installed (run from a source tree without metadata)."""
    try:
        requires = importlib.metadata.requires("torus") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    out = {}
    for line in requires:
        req = Requirement(line)
        if req.name in TESTED and req.marker is not None and req.marker.evaluate({"extra": "tf"}):
            out[req.name] = req.specifier
    return out


def installed() -> dict[str, str]:
    """The installed version of each of ``TESTED`` (TensorFlow as ``tf.__version__``: any of its wheels)."""
    return {"keras": keras.__version__, "tensorflow-cpu": tf.__version__}


def _describe() -> str:
    ranges = tested_range()
    have = ", ".join(f"{name} {version}" for name, version in installed().items())
    tested = ", ".join(f"{name}{spec}" for name, spec in ranges.items()) or "unknown (torus not installed)"
    return f"installed {have}; tested {tested}"


def check_versions(warn: Callable[[str], None]) -> list[str]:
    """Call ``warn`` with one line for each of ``TESTED`` installed outside its tested range; returns them."""
    ranges, have, lines = tested_range(), installed(), []
    for name, spec in ranges.items():
        if not spec.contains(Version(have[name]), prereleases=True):
            lines.append(f"torus.integrations.keras: {name} {have[name]} is outside the tested range "
                         f"{name}{spec} (pyproject.toml, the [tf] extra); it may work, but nothing guarantees "
                         "that every rank trains as one process: install a tested version")
    for line in lines:
        warn(line)
    return lines


def _resolve(path: object) -> object:
    if not isinstance(path, str):
        return path
    key, _, rest = path.partition(".")
    obj: object = _modules[key]
    for part in filter(None, rest.split(".")):
        obj = getattr(obj, part)
    return obj


def check_required() -> None:
    """Raise ``ImportError`` naming the first missing entry of ``REQUIRED`` (see the module docstring)."""
    for owner, names in REQUIRED:
        target = _resolve(owner)
        for name in names:
            if not hasattr(target, name):
                where = owner if isinstance(owner, str) else f"{owner.__module__}.{owner.__qualname__}"  # type: ignore[attr-defined]
                raise ImportError(f"torus.integrations.keras: {_MODULES.get(where, where)}.{name} is missing: "
                                  f"this Keras / TensorFlow moved a name torus relies on ({_describe()})")


def _import_modules() -> dict:
    out = {}
    for key, name in _MODULES.items():
        try:
            out[key] = importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"torus.integrations.keras: cannot import {name}, which torus relies on "
                              f"({_describe()}): {exc}") from exc
    return out


def _warn_on_rank_zero(line: str) -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        warnings.warn(line, stacklevel=3)


_modules = _import_modules()
check_required()
check_versions(_warn_on_rank_zero)

# The internals, by the names the rest of the package uses.
TensorFlowTrainer = _modules["trainer"].TensorFlowTrainer
Trainer = _modules["base_trainer"].Trainer
CompileLoss = _modules["compile_utils"].CompileLoss
OneDeviceExtended: Any = _modules["one_device_strategy"].OneDeviceExtended  # Any: a base class found at run time
OneDeviceReplicaContext: Any = _modules["one_device_strategy"]._OneDeviceReplicaContext
array_data_adapter = _modules["array_data_adapter"]
array_slicing = _modules["array_slicing"]
data_adapter_utils = _modules["data_adapter_utils"]
file_utils = _modules["file_utils"]
io_utils = _modules["io_utils"]
saving_api = _modules["saving_api"]
TFOptimizer = _modules["tf_optimizer"].TFOptimizer
filter_empty_gradients = _modules["tf_optimizer"].filter_empty_gradients  # Keras' check of a gradient list


def model_strategy(model):
    """The ``tf.distribute`` strategy ``model`` was created (or moved) under, or None."""
    return getattr(model, "_distribute_strategy", None)


def set_model_strategy(model, strategy) -> None:
    model._distribute_strategy = strategy


def optimizer_strategy(optimizer):
    """The strategy ``optimizer`` was created under (Keras' default strategy outside any scope), or None."""
    return getattr(optimizer, "_distribution_strategy", None)


def set_optimizer_strategy(optimizer, strategy) -> None:
    optimizer._distribution_strategy = strategy


def default_strategy():
    """TensorFlow's default (no-op) strategy: what an optimizer created outside every scope holds."""
    return _modules["distribute_lib"]._get_default_strategy()


def flatten_layers(model) -> list:
    """Every layer of ``model``, nested ones included (the model itself too)."""
    return list(model._flatten_layers())


def initial_epoch(model):
    """The epoch ``BackupAndRestore`` restored into ``model`` (read by ``fit`` to start there), or None."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch) -> None:
    model._initial_epoch = epoch


def eager_op_seeds():
    """The ``random.Random`` that eager TensorFlow draws its op seeds from (made by ``tf.random.set_seed``), or
    None."""
    return getattr(_modules["eager_context"].context(), "_rng", None)


def set_eager_op_seeds(rng) -> None:
    _modules["eager_context"].context()._rng = rng


def tf_global_generator():
    """``tf.random.get_global_generator()``'s generator where one exists (None: not made yet; asking TF would
    make one)."""
    return _modules["stateful_random_ops"].global_generator


def set_tf_global_generator(generator) -> None:
    _modules["stateful_random_ops"].global_generator = generator


_GLOBAL_SEED_GENERATOR = "global_seed_generator"  # Keras' global-state key (a literal in Keras 3.12)


def keras_global_seed_generator():
    """Keras' global ``SeedGenerator`` (``keras.random`` draws without a seed) where one exists, or None."""
    return _modules["keras_global_state"].get_global_attribute(_GLOBAL_SEED_GENERATOR)


def set_keras_global_seed_generator(generator) -> None:
    _modules["keras_global_state"].set_global_attribute(_GLOBAL_SEED_GENERATOR, generator)


def backup_files(callback) -> tuple[str, str, str, str]:
    """A ``BackupAndRestore``'s (weights, previous weights, metadata, previous metadata) paths."""
    return (callback._weights_path, callback._prev_weights_path, callback._training_metadata_path,
            callback._prev_training_metadata_path)


def backup_position(callback) -> dict:
    """Where a ``BackupAndRestore`` is: ``{"epoch": ..., "batch": ...}`` as Keras writes its metadata."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}


def dataset_inputs(dataset) -> list:
    """The datasets ``dataset`` was built from (empty for a source dataset)."""
    return list(getattr(dataset, "_inputs", list)())


def shard_count(dataset) -> int | None:
    """``num_shards`` of a ``Dataset.shard`` result (eager), else None."""
    if type(dataset).__name__ != "_ShardDataset" or not tf.executing_eagerly():
        return None
    return int(dataset._num_shards)


def dataset_graph(dataset):
    """``dataset``'s graph, a ``GraphDef`` (device assignments stripped, stateful ops kept as they are);
    raises what TensorFlow raises where it cannot be serialized (e.g. a graph over 2 GB)."""
    policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    serialized = dataset._as_serialized_graph(strip_device_assignment=True, external_state_policy=policy)
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized.numpy())
    return graph


def epoch_dataset(epoch_iterator):
    """What a ``TFEpochIterator`` iterates: the (strategy-distributed) dataset of one epoch."""
    return epoch_iterator._get_iterator()


def set_on_instance(obj, name: str, value) -> None:
    """Set ``obj.name`` past Keras' attribute tracking (a method or a flag, not state to save)."""
    object.__setattr__(obj, name, value)


def del_on_instance(obj, name: str) -> None:
    object.__delattr__(obj, name)


def swap_class(obj, cls: type) -> None:
    """Give ``obj`` the class ``cls`` (a subclass of its own: its state stays, its hooks change)."""
    if not isinstance(cls, type) or not issubclass(cls, type(obj)):
        raise TypeError(f"swap_class: {cls!r} is not a subclass of {type(obj).__name__}")
    obj.__class__ = cls


def is_patched(fn) -> bool:
    return hasattr(fn, "_torus_original")


def patch(owner, name: str, make_wrapper: Callable[[Any], Any], aliases: tuple = ()) -> None:
    """Replace ``owner.name`` by ``make_wrapper(current)`` once per process (idempotent), and every module of
    ``aliases`` that re-exports the same object."""
    current = getattr(owner, name)
    if is_patched(current):
        return
    wrapped = make_wrapper(current)
    setattr(wrapped, "_torus_original", current)  # noqa: B010 (a function attribute mypy cannot see)
    setattr(owner, name, wrapped)
    for alias in aliases:
        module = importlib.import_module(alias)
        if getattr(module, name, None) is current:
            setattr(module, name, wrapped)


def original(fn):
    """What ``patch`` replaced (``fn`` itself where it is not a torus wrapper)."""
    return getattr(fn, "_torus_original", fn)


class Site(NamedTuple):
    """One row of ``PATCH_SITES``: ``owner.name`` becomes ``module.wrapper(current, *args)``."""

    owner: object  # as in REQUIRED: a module key and attribute path ("trainer.TensorFlowTrainer"), or an object
    name: str  # the attribute replaced
    module: str  # the module of torus.integrations.keras that builds the wrapper
    wrapper: str  # its function, called with the current attribute and ``args``
    args: tuple = ()
    aliases: tuple[str, ...] = ()  # modules that re-export the same object: rebound too
    optional: bool = False  # a public attribute some tested Keras lacks: skipped there, so not in REQUIRED


_SAVING_ALIASES = ("keras.saving", "keras.models")  # re-export saving_api's functions (Model.save calls those)

# Every class or module attribute torus replaces, in the order install() wraps them. Not here: the Horovod
# module's ``keras.optimizers.Optimizer.variables`` (``horovod.keras2.install``, on importing it only).
PATCH_SITES: tuple[Site, ...] = (
    Site("trainer.TensorFlowTrainer", "fit", "fit.fit_hook", "wrap", ("fit",)),
    Site("trainer.TensorFlowTrainer", "evaluate", "fit.fit_hook", "wrap", ("evaluate",)),
    Site("trainer.TensorFlowTrainer", "predict", "fit.fit_hook", "wrap", ("predict",)),
    Site("trainer.TensorFlowTrainer", "make_train_function", "fit.metrics", "global_step_maker", ("train_step",)),
    Site("trainer.TensorFlowTrainer", "make_test_function", "fit.metrics", "global_step_maker", ("test_step",)),
    Site("trainer.TensorFlowTrainer", "_maybe_symbolic_build", "fit.inputs", "build_without_peeking"),
    Site("base_trainer.Trainer", "get_metrics_result", "fit.metrics", "global_metrics_result"),
    Site("compile_utils.CompileLoss", "call", "fit.metrics", "share_weighted"),
    Site("tf_optimizer.TFOptimizer", "_all_reduce_sum_gradients", "fit.optimizer", "as_gradients"),
    Site("saving_api", "save_model", "fit.saving", "coordinated", ("Model.save",), _SAVING_ALIASES),
    Site("saving_api", "save_weights", "fit.saving", "coordinated", ("Model.save_weights",), _SAVING_ALIASES),
    Site(keras.Model, "export", "fit.saving", "coordinated", ("Model.export",), optional=True),
)


def wrapper_of(site: Site) -> Callable[[Any], Any]:
    """``site``'s wrapper maker: the current attribute in, its wrapper out (imports the building module)."""
    build = getattr(importlib.import_module(f"torus.integrations.keras.{site.module}"), site.wrapper)
    return lambda current: build(current, *site.args)


def install() -> None:
    """Wrap every row of ``PATCH_SITES`` (once per process)."""
    for site in PATCH_SITES:
        owner = _resolve(site.owner)
        if site.optional and not hasattr(owner, site.name):
            continue
        patch(owner, site.name, wrapper_of(site), aliases=site.aliases)
