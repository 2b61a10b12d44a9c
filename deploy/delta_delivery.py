"""Token deltas from the attention nodes to the frontend's request streams, a poll answer at a
time: each checked against the node the request was sent to (a request held elsewhere, failed
here while its node hung and sent on, is dropped and aborted at the node that sent it), its
first token timed against the router's forecast, then fanned out (`StreamRegistry`)."""

from __future__ import annotations

import time
from typing import Callable

from megainfer.disagg.latency import LatencyHistogram
from megainfer.messages import DeltaBatch, RequestDelta
from megainfer.server.backend import StreamRegistry, foreign_places

# |predicted - measured| TTFT of requests the predictive router placed, seconds.
ROUTER_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DeltaDelivery:
    def __init__(self, registry: StreamRegistry, owner: dict[str, int], ttft_feedback: "TtftFeedback",
                 actor: Callable[[int], object | None]) -> None:
        """`owner`: request id -> the attention node it was sent to (the frontend's, shared);
        `actor(node)`: that node's actor, None once its group retired."""
        self.registry = registry
        self.owner = owner
        self.ttft_feedback = ttft_feedback
        self.actor = actor

    def one(self, node: int, delta: RequestDelta) -> None:
        """A delta of node `node`."""
        if self._accept(node, delta):
            self.registry.deliver(delta)

    def batch(self, node: int, batch: DeltaBatch) -> None:
        """A poll answer of node `node`, every step: its plain deltas checked and handed on as
        columns (`foreign_places`, `StreamRegistry.deliver_batch`), the others one by one."""
        columns = batch.columns
        strays = foreign_places(columns.request_ids, self.owner, node)
        if strays:
            for place in strays:
                self._stray(node, columns.request_ids[place], False)
            columns = columns.without_places(strays)
        self.ttft_feedback.observe_first(columns.request_ids)
        columns.others = [(before, delta) for before, delta in columns.others if self._accept(node, delta)]
        self.registry.deliver_batch(columns)

    def _accept(self, node: int, delta: RequestDelta) -> bool:
        """Whether a delta of node `node` goes on to its stream (its request is held there; a
        finished one is no longer owned); a stray is dropped and aborted there."""
        if self.owner.get(delta.request_id) != node:
            self._stray(node, delta.request_id, delta.finished)
            return False
        self.ttft_feedback.observe(delta)
        if delta.finished:
            self.owner.pop(delta.request_id, None)
        return True

    def _stray(self, node: int, request_id: str, finished: bool) -> None:
        actor = None if finished else self.actor(node)
        if actor is not None:
            actor.abort.remote(request_id)  # frees its blocks


class TtftFeedback:
    """The predictive router's TTFT forecasts against what its requests measured: the error
    histogram (a metric) and the router's own correction (`observe_ttft`)."""

    def __init__(self, router) -> None:
        self.router = router  # the frontend's, as it changes (`Frontend.use_router`)
        self.router_error = LatencyHistogram(ROUTER_ERROR_BUCKETS)
        self._predicted: dict[str, tuple[float, float]] = {}  # request id -> (submitted at, predicted TTFT)

    def expect(self, request_id: str, submitted: float, predicted_ttft_s: float) -> None:
        self._predicted[request_id] = (submitted, predicted_ttft_s)

    def observe_first(self, request_ids: list[str]) -> None:
        """Plain deltas (one token each), as columns: only a request's first is looked at."""
        if self._predicted:
            for request_id in self._predicted.keys() & request_ids:
                submitted, predicted = self._predicted.pop(request_id)
                self._learn(predicted, time.monotonic() - submitted)

    def observe(self, delta: RequestDelta) -> None:
        if delta.request_id in self._predicted and (delta.new_token_ids or delta.finished):
            submitted, predicted = self._predicted.pop(delta.request_id)
            if delta.new_token_ids:
                self._learn(predicted, time.monotonic() - submitted)

    def _learn(self, predicted: float, measured: float) -> None:
        self.router_error.observe(abs(measured - predicted))
        learn = getattr(self.router, "observe_ttft", None)
        if learn is not None:
            learn(predicted, measured)

    def forget(self, request_id: str) -> None:
        self._predicted.pop(request_id, None)
