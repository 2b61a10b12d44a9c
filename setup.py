"""The compiled M2N core (transport/csrc/: shared memory and rounds in m2n_core.cpp, tcp in
tcp_channels.cpp): built by `pip install` with the host's C++ compiler, linked against nothing
but libc. Everything else is in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

SOURCES = ["transport/csrc/m2n_core.cpp", "transport/csrc/tcp_channels.cpp"]

setup(ext_modules=[Pybind11Extension("transport._m2n_core", SOURCES, depends=["transport/csrc/channels.h"],
                                     cxx_std=17, extra_compile_args=["-O2", "-Wall", "-Wextra"])])
