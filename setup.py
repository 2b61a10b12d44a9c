"""The compiled M2N core (transport/csrc/m2n_core.cpp): built by `pip install` with the host's
C++ compiler, linked against nothing but libc. Everything else is in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(ext_modules=[Pybind11Extension("transport._m2n_core", ["transport/csrc/m2n_core.cpp"], cxx_std=17,
                                     extra_compile_args=["-O2", "-Wall", "-Wextra"])])
