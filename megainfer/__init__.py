"""megainfer: disaggregated expert-parallel serving for Mixture-of-Experts models.

Public names load lazily so that `import megainfer` (and `megainfer --help`, and the
planner) do not pay for importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "megainfer.llm",
    "Engine": "megainfer.engine.engine",
    "EngineConfig": "megainfer.engine_config",
    "ModelConfig": "megainfer.config",
    "SamplingParams": "megainfer.sampling_params",
    "RequestOutput": "megainfer.outputs",
    "CompletionOutput": "megainfer.outputs",
    "RequestDelta": "megainfer.messages",
    "MegaInferError": "megainfer.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megainfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
