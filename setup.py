"""Builds the Cython host kernels in src/ into torus._ext; everything else lives in pyproject.toml."""
import os
import sys

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


def _mpi_dirs():
    """(include dir, library dir) of the ``mpich`` wheel's MPI, or None: in an isolated build it is a build
    requirement (pyproject.toml), so it lies in the build environment, not in sys.prefix."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        dist = distribution("mpich")
    except (ImportError, PackageNotFoundError):
        return None
    found = {}
    for f in dist.files or ():
        name = str(f).replace("\\", "/")
        if name.endswith("include/mpi.h"):
            found["inc"] = str(dist.locate_file(f).resolve().parent)
        elif name.endswith("/libmpi.so") or name == "libmpi.so":
            found["lib"] = str(dist.locate_file(f).resolve().parent)
    return (found["inc"], found["lib"]) if len(found) == 2 else None


def step_loop():
    """torus._ext._step_loop, the C step loop (src/_step_loop.pyx), when MPI's headers are at hand (else the
    Python loop runs; TORUS_NO_C_LOOP=1 skips it). Linked without an rpath: mpi4py has loaded libmpi.so.12
    by the time torus imports it (torus/runtime/c_step_loop.py)."""
    if os.environ.get("TORUS_NO_C_LOOP") == "1" or sys.platform != "linux":
        return []
    dirs = _mpi_dirs()
    if dirs is None:
        print("torus: MPI headers not found; building without the C step loop", file=sys.stderr)
        return []
    ext = kernel("_step_loop")
    ext.include_dirs.append(dirs[0])
    ext.library_dirs.append(dirs[1])
    ext.libraries.append("mpi")
    return [ext]


setup(ext_modules=cythonize([kernel("_reduce"), kernel("_convert"), kernel("_shm"), *step_loop()],
                            compiler_directives={"language_level": "3"}))
