"""torus: ring, hierarchical and 2D-torus collectives over MPI, for data-parallel training.

``TorusComm`` is the entry point; ``IN_PLACE`` is ``mpi4py.MPI.IN_PLACE``. TensorFlow is imported only by
``torus.integrations``.
"""
from mpi4py.MPI import IN_PLACE

from torus.comm import TorusComm
from torus.errors import MismatchError, TimeoutError, TorusError
from torus.ops import DTYPES, OPS
from torus.select import ALGORITHMS

__version__ = "0.1.0"
__all__ = ["TorusComm", "IN_PLACE", "OPS", "DTYPES", "ALGORITHMS", "MismatchError", "TimeoutError",
           "TorusError", "__version__"]
