"""Which attention node (or replica) takes a new request. Policies share one interface and
see the same per-node load; the deployment keeps the loads fresh (a snapshot per node
refreshed in the background, plus what it has routed since the snapshot).

- round_robin: in turn.
- random: uniformly at random (seeded).
- least_loaded: Llumnix's freeness, the KV capacity left after what is cached and what is
  still to prefill, per request the node carries; the freest node wins.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from megainfer.errors import ConfigError

ROUTERS = ("round_robin", "random", "least_loaded")


@dataclass
class NodeLoad:
    """What a router knows of one node."""

    capacity_tokens: int  # KV-cache tokens the node holds in all
    used_tokens: int = 0  # tokens cached now
    pending_prefill_tokens: int = 0  # prompt tokens admitted or queued but not yet computed
    running: int = 0
    waiting: int = 0

    def add(self, prompt_tokens: int) -> None:
        """A request routed here since the last snapshot."""
        self.pending_prefill_tokens += prompt_tokens
        self.waiting += 1

    def freeness(self) -> float:
        """Llumnix: (capacity - cached - pending prefill) / requests carried (one more: the new one)."""
        free = self.capacity_tokens - self.used_tokens - self.pending_prefill_tokens
        return free / (self.running + self.waiting + 1)


class Router(Protocol):
    name: str

    def choose(self, loads: list[NodeLoad], prompt_tokens: int) -> int:
        """Index of the node that takes a request of `prompt_tokens` tokens."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, loads: list[NodeLoad], prompt_tokens: int) -> int:
        return next(self._next) % len(loads)


class RandomRouter:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, loads: list[NodeLoad], prompt_tokens: int) -> int:
        return self._rng.randrange(len(loads))


class LeastLoaded:
    name = "least_loaded"

    def choose(self, loads: list[NodeLoad], prompt_tokens: int) -> int:
        # Ties go to the lower index, so equal nodes fill in a stable order.
        return max(range(len(loads)), key=lambda i: (loads[i].freeness(), -i))


def make_router(name: str, seed: int = 0) -> Router:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomRouter(seed)
    if name == "least_loaded":
        return LeastLoaded()
    raise ConfigError(f"router {name!r} is not one of {', '.join(ROUTERS)}")
