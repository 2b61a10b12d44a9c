"""Transport tests run each shared-memory case on both implementations: the compiled core
(transport/core.py) and the pure-Python reference (transport/shm.py), chosen per process by
MEGAINFER_M2N_CORE. A module opts in with `pytestmark = pytest.mark.usefixtures("m2n_core")`."""

from __future__ import annotations

import pytest

from transport import core


@pytest.fixture(params=["core", "python"])
def m2n_core(request, monkeypatch):
    if request.param == "core" and core.native is None:
        pytest.fail(core.BUILD_ERROR)  # pip install builds it: a missing core is a broken install, not a skip
    monkeypatch.setenv(core.CORE_ENV, "on" if request.param == "core" else "off")
    return request.param
