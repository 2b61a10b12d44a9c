"""The compiled M2N core (transport/csrc/: shared memory and rounds in m2n_core.cpp, tcp in
tcp_channels.cpp, rdma in verbs_channels.cpp): built by `pip install` with the host's C++
compiler, linked against nothing but libc (libibverbs is loaded at run time, by path).
Everything else is in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

SOURCES = ["transport/csrc/m2n_core.cpp", "transport/csrc/tcp_channels.cpp", "transport/csrc/verbs_channels.cpp"]

HEADERS = ["transport/csrc/channels.h", "transport/csrc/verbs_abi.h"]

setup(ext_modules=[Pybind11Extension("transport._m2n_core", SOURCES, depends=HEADERS, cxx_std=17,
                                     extra_compile_args=["-O2", "-Wall", "-Wextra"], libraries=["dl"])])
