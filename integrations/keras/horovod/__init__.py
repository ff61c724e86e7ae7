"""Horovod's Keras API (``horovod.tensorflow.keras``) on Keras 3 over torus: change ::

    import horovod.tensorflow.keras as hvd

to ::

    import torus.integrations.keras.horovod as hvd

and run the script under ``mpiexec -n N``. ``init``, ``rank``, ``size``, ``local_rank``, ``local_size``,
``cross_rank``, ``cross_size`` (``basics``); ``allreduce``, ``allgather``, ``broadcast``, ``broadcast_object``,
``allgather_object``, ``broadcast_variables`` and the ops ``Average``, ``Sum``, ``Min``, ``Max``, ``Product``
(``collectives``); ``Compression``; ``DistributedOptimizer`` and ``load_model`` (``optimizer``);
``callbacks.*``; ``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (``tape``, from
``horovod.tensorflow``, for TF2 custom loops). Importing it makes a Keras 3 optimizer's ``variables`` callable
too, so Horovod's ``opt.variables()`` works (``keras2``). What differs from Horovod and what is missing:
integrations/keras/HOROVOD.md. A Horovod name that is not provided raises ``AttributeError`` saying so.
"""
from torus.integrations.keras.horovod import callbacks
from torus.integrations.keras.horovod.basics import (
                                                     cross_rank,
                                                     cross_size,
                                                     init,
                                                     is_initialized,
                                                     local_rank,
                                                     local_size,
                                                     rank,
                                                     shutdown,
                                                     size,
)
from torus.integrations.keras.horovod.collectives import (
                                                     Average,
                                                     Max,
                                                     Min,
                                                     Product,
                                                     Sum,
                                                     allgather,
                                                     allgather_object,
                                                     allreduce,
                                                     barrier,
                                                     broadcast,
                                                     broadcast_object,
                                                     broadcast_variables,
)
from torus.integrations.keras.horovod.compression import Compression
from torus.integrations.keras.horovod.keras2 import install as _install_keras2
from torus.integrations.keras.horovod.optimizer import DistributedOptimizer, load_model
from torus.integrations.keras.horovod.tape import DistributedGradientTape, PartialDistributedGradientTape

_install_keras2()

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
           "broadcast_variables", "barrier", "Average", "Sum", "Min", "Max", "Product", "Compression",
           "DistributedOptimizer", "load_model", "callbacks", "DistributedGradientTape",
           "PartialDistributedGradientTape"]

GUIDE = "integrations/keras/HOROVOD.md"

# Public names of Horovod 0.28.1's horovod.tensorflow and horovod.tensorflow.keras that torus does not provide,
# with what to use instead where there is something.
NOT_PROVIDED = {
    "Adasum": "use hvd.Average or hvd.Sum",
    "ProcessSet": "", "global_process_set": "", "add_process_set": "", "remove_process_set": "",
    "process_set_included_op": "",
    "reducescatter": "", "grouped_reducescatter": "", "alltoall": "",
    "grouped_allreduce": "call hvd.allreduce per tensor, or torus.integrations.keras.allreduce_tensors for one "
                         "fused all-reduce of a list",
    "grouped_allgather": "call hvd.allgather per tensor",
    "broadcast_": "assign the result of hvd.broadcast, or use hvd.broadcast_variables",
    "broadcast_object_fn": "call hvd.broadcast_object",
    "broadcast_global_variables": "use hvd.broadcast_variables(model.variables, root_rank) (TF2 has no global "
                                  "variable collection)",
    "BroadcastGlobalVariablesHook": "use hvd.broadcast_variables (TF1 sessions are not supported)",
    "join": "every rank must take the same number of steps",
    "elastic": "", "run": "launch with mpiexec -n N",
    "start_timeline": "see torus.timeline", "stop_timeline": "see torus.timeline",
    "is_homogeneous": "", "rank_op": "", "local_rank_op": "", "size_op": "", "local_size_op": "",
    "mpi_threads_supported": "", "mpi_enabled": "", "mpi_built": "", "gloo_enabled": "", "gloo_built": "",
    "nccl_built": "", "ddl_built": "", "ccl_built": "", "cuda_built": "", "rocm_built": "",
    "SyncBatchNormalization": "use TorusStrategy with keras.layers.BatchNormalization(synchronized=True)",
    "LocalGradientAggregationHelper": "use hvd.DistributedOptimizer(opt, backward_passes_per_step=k)",
    "handle_average_backwards_compatibility": "", "check_num_rank_power_of_2": "",
}


def __getattr__(name: str):
    """``AttributeError`` for names this module lacks: Horovod's (``NOT_PROVIDED``) say that torus does not
    provide them; any other name gets Python's usual message, both pointing to HOROVOD.md."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in NOT_PROVIDED:
        hint = NOT_PROVIDED[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: Horovod's hvd.{name} is not "
                             f"provided by torus{'; ' + hint if hint else ''} (see {GUIDE})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (the Horovod names torus provides and "
                         f"what differs: {GUIDE})")
