"""When to add a replica and when to retire one (Block §6.5): on *predicted* latency, so a
replica starts while the queues that would need it are still forming.

Add: the predicted TTFT of a new request on the best replica exceeds `predicted_ttft_s`, the
fleet is below `max_replicas` and no replica is already starting (one at a time: a starting
replica's capacity is not in the predictions yet). Retire: the newest replica has served
nothing for `idle_s` and the fleet is above `min_replicas`. The caller does the starting and
stopping (Ray in a deployment, the cluster simulator in a simulation).
"""

from __future__ import annotations

from dataclasses import dataclass

from megainfer.errors import PlanError


@dataclass
class AutoscalePolicy:
    """plan.yaml's `autoscale` section."""

    min_replicas: int = 1
    max_replicas: int = 1
    predicted_ttft_s: float = 2.0  # add a replica when a new request's best predicted TTFT passes this
    idle_s: float = 60.0  # retire the newest replica after it has been idle this long

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise PlanError(f"autoscale.min_replicas must be at least 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise PlanError(f"autoscale.max_replicas ({self.max_replicas}) must be at least "
                            f"autoscale.min_replicas ({self.min_replicas})")
        for key in ("predicted_ttft_s", "idle_s"):
            if getattr(self, key) <= 0:
                raise PlanError(f"autoscale.{key} must be positive, got {getattr(self, key)}")


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self.decisions: list[tuple[float, str, int]] = []  # (when, "add" | "retire", replicas after)

    def should_add(self, predicted_ttft_s: float, replicas: int, starting: int, now: float) -> bool:
        if predicted_ttft_s <= self.policy.predicted_ttft_s or starting or replicas >= self.policy.max_replicas:
            return False
        self.decisions.append((now, "add", replicas + 1))
        return True

    def should_retire(self, replicas: int, newest_idle_s: float, now: float) -> bool:
        if replicas <= self.policy.min_replicas or newest_idle_s < self.policy.idle_s:
            return False
        self.decisions.append((now, "retire", replicas - 1))
        return True
