"""Ray calls to many actors at once: one `ray.wait` for all of them, each answer or failure
kept apart, so one dead or slow node neither fails nor delays the others' answers."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from megainfer.errors import ConfigError, MegaInferError


def gather(refs: list, timeout_s: float) -> list:
    """Each ref's result, or the exception it raised (RayActorError for a dead actor,
    GetTimeoutError for one that did not answer within `timeout_s`), in the refs' order."""
    if not refs:
        return []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finished = set(done)
    results = []
    for ref in refs:
        if ref not in finished:
            results.append(GetTimeoutError(f"no answer within {timeout_s:g} s"))
            continue
        try:
            results.append(ray.get(ref))
        except (RayActorError, RayTaskError) as exc:
            results.append(exc)
    return results


def cause(exc: RayTaskError) -> BaseException:
    """The exception a node raised (RequestError, DataPlaneError, ...) rather than Ray's wrapper."""
    inner = getattr(exc, "cause", None)
    if isinstance(inner, MegaInferError):
        return inner
    return ConfigError(str(inner or exc))


def get_all(refs: list, timeout_s: float) -> list:
    """Every ref's result; the first failure raises, a node's own error unwrapped."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except RayTaskError as exc:
        raise cause(exc) from None
