"""Fixtures shared by the deployment tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session per test module (`ray.init` takes seconds; actors of one test
    module's deployments share it)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
