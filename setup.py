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


setup(ext_modules=cythonize([kernel("_reduce"), kernel("_convert")],
                            compiler_directives={"language_level": "3"}))
