"""A change every rank of a deployment makes at one agreed step (a re-placement of the experts:
expert_slot_maps.py on attention ranks, expert_switch.py on expert ranks): set ahead of that
step, refused once it has begun on this rank (the change would reach it too late, and the
others would make it alone), taken when the step begins."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from megainfer.errors import DataPlaneError

T = TypeVar("T")


class AgreedStep(Generic[T]):
    def __init__(self) -> None:
        self._pending: tuple[int, T] | None = None
        self._last_step = -1  # the last step `due` saw begin
        self._lock = threading.Lock()

    def set(self, step: int, change: T, what: str) -> None:
        """Make `change` at step `step`; DataPlaneError naming `what` if that step has begun here."""
        with self._lock:
            if step <= self._last_step:
                raise DataPlaneError(f"the switch to {what} at step {step} came after that step began here "
                                     f"(step {self._last_step})")
            self._pending = (step, change)

    def cancel(self, change_is, what: str) -> bool:
        """Drop the pending change where `change_is(change)`; DataPlaneError if it was already made."""
        with self._lock:
            if self._pending is None or not change_is(self._pending[1]):
                return False
            if self._pending[0] <= self._last_step:
                raise DataPlaneError(f"{what} is already serving here: too late to cancel")
            self._pending = None
            return True

    def clear(self) -> None:
        with self._lock:
            self._pending = None

    def due(self, step: int) -> T | None:
        """Step `step` begins: the change to make now, if it is the agreed step's."""
        with self._lock:
            self._last_step = step
            if self._pending is None or step < self._pending[0]:
                return None
            change, self._pending = self._pending[1], None
            return change
