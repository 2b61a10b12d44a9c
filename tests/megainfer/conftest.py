"""Fixtures the serving tests share: one engine behind the gRPC server, per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine_backend(mixtral_ref):
    from megainfer import Engine
    from megainfer.engine_config import EngineConfig
    from megainfer.server.engine_backend import EngineBackend

    backend = EngineBackend(Engine(str(mixtral_ref.path), EngineConfig(num_kv_blocks=64)))
    yield backend, mixtral_ref.path
    backend.close()


@pytest.fixture(scope="module")
def grpc_server(engine_backend):
    from megainfer.server.service import Server

    backend, checkpoint = engine_backend
    server = Server(backend, port=0).start()
    yield server, checkpoint
    server.stop(0)
