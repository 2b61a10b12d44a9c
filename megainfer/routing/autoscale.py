"""When to add a replica and when to retire one (Block §6.5): on *predicted* latency, so a
replica starts while the queues that would need it are still forming.

Add: the predicted TTFT of a new request on the best replica exceeds `predicted_ttft_s`, the
fleet is below `max_replicas` and no replica is already starting (one at a time: a starting
replica's capacity is not in the predictions yet). Retire: the newest replica has served
nothing for `idle_s` and the fleet is above `min_replicas`. The caller does the starting and
stopping (Ray in a deployment, the cluster simulator in a simulation) and reports what came
of a start (`added`, `add_failed`); every decision and outcome is a `ScaleEvent` in `events`,
on the caller's clock.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from megainfer.plan import AutoscalePolicy  # plan.yaml's `autoscale` section


class ScaleAction(str, enum.Enum):
    ADD = "add"  # decided to start a replica
    ADDED = "added"  # a started replica serves (deployments only; the simulator may record it when ready)
    ADD_FAILED = "add_failed"  # the cluster could not place it
    RETIRE = "retire"  # the newest replica retires

    def __str__(self) -> str:
        return self.value


@dataclass
class ScaleEvent:
    time_s: float  # the caller's clock (time.monotonic() in a deployment, virtual time in the simulator)
    action: ScaleAction
    replicas: int  # replicas after the action (for ADD: including the one starting)
    predicted_ttft_s: float | None = None  # ADD: the best predicted TTFT that triggered it
    waiting: int | None = None  # ADD: requests waiting (max per replica) when it triggered
    error: str | None = None  # ADD_FAILED: why

    def as_dict(self) -> dict:
        """For JSON: the action as its value; fields that do not apply to the action left out."""
        fields = dataclasses.asdict(self)
        fields["action"] = self.action.value
        return {key: value for key, value in fields.items() if value is not None}


class Autoscaler:
    """The policy's decisions, and the log of them and of their outcomes (`events`)."""

    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self.events: list[ScaleEvent] = []

    def should_add(self, predicted_ttft_s: float, replicas: int, starting: int, now: float,
                   waiting: int | None = None) -> bool:
        """Whether to start a replica now, with `replicas` in the fleet (`starting` of them not
        serving yet); records an ADD when it says yes."""
        if predicted_ttft_s <= self.policy.predicted_ttft_s or starting or replicas >= self.policy.max_replicas:
            return False
        self.events.append(ScaleEvent(now, ScaleAction.ADD, replicas + 1, predicted_ttft_s=predicted_ttft_s,
                                      waiting=waiting))
        return True

    def should_retire(self, replicas: int, newest_idle_s: float, now: float) -> bool:
        """Whether the newest of `replicas` retires, idle for `newest_idle_s`; records a RETIRE
        when it says yes."""
        if replicas <= self.policy.min_replicas or newest_idle_s < self.policy.idle_s:
            return False
        self.events.append(ScaleEvent(now, ScaleAction.RETIRE, replicas - 1))
        return True

    def added(self, now: float, replicas: int) -> None:
        """The replica started on the last ADD serves; `replicas` serve now."""
        self.events.append(ScaleEvent(now, ScaleAction.ADDED, replicas))

    def add_failed(self, now: float, error: str) -> None:
        """The replica of the last ADD could not be started: the fleet stays as it was."""
        self.events.append(ScaleEvent(now, ScaleAction.ADD_FAILED, self._serving(), error=error))

    def _serving(self) -> int:
        """Replicas serving as the last event left the fleet (an ADD counts the one starting)."""
        if not self.events:
            return self.policy.min_replicas
        last = self.events[-1]
        return last.replicas - 1 if last.action is ScaleAction.ADD else last.replicas
