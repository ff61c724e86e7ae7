"""Horovod's Keras API (``horovod.tensorflow.keras``) on Keras 3 over torus: change ::

    import horovod.tensorflow.keras as hvd

to ::

    import torus.integrations.keras.horovod as hvd

and run the script under ``mpiexec -n N``. ``init``, ``rank``, ``size``, ``local_rank``, ``local_size``,
``cross_rank``, ``cross_size`` (``basics``); ``allreduce``, ``allgather``, ``broadcast``, ``broadcast_object``,
``allgather_object``, ``broadcast_variables`` and the ops ``Average``, ``Sum``, ``Min``, ``Max``, ``Product``
(``collectives``); ``Compression``; ``DistributedOptimizer`` and ``load_model`` (``optimizer``);
``callbacks.*``. What differs from Horovod and what is missing: integrations/keras/HOROVOD.md.
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
from torus.integrations.keras.horovod.optimizer import DistributedOptimizer, load_model

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
           "broadcast_variables", "barrier", "Average", "Sum", "Min", "Max", "Product", "Compression",
           "DistributedOptimizer", "load_model", "callbacks"]
