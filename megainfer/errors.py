"""Errors a user can cause. The CLI prints these without a traceback and exits non-zero.

Every message names the offending field or value and, where there is one, the fix.
"""


class MegaInferError(Exception):
    """Base class of every error megainfer raises for bad input or environment."""


class ConfigError(MegaInferError):
    """A model or engine configuration value is missing, unsupported or out of range."""


class CheckpointError(MegaInferError):
    """A checkpoint directory is missing, incomplete, or holds tensors of the wrong shape."""


class RequestError(MegaInferError):
    """A single request is invalid (prompt, sampling parameters); it fails alone."""


class PlanError(MegaInferError):
    """A plan, GPU catalog or planner input is malformed, or no plan can satisfy it."""


class DataPlaneError(MegaInferError):
    """The exchange with other nodes failed (a peer died or the deployment is re-wiring).
    Requests it fails are unavailable, not wrong: retrying them later can succeed."""


class Overloaded(MegaInferError):
    """The server's queue is full; the request was refused rather than left to pile up."""
