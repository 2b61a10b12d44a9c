"""What an engine scheduling asynchronously asks of a runner during a step (a runner with
`takes_step_hooks`): the work beside the layers, and the tokens placed as they are sampled.

The work beside the layers is the step before's settling (its stops, deltas and statistics) and
then the look-ahead (the next step scheduled), as vLLM schedules ahead once a step is launched.
On a GPU it runs on the thread that launches the layers and posts the rounds, so done in one
piece it holds back the next layer: at the shipped Qwen3-235B plan's 1,884 sequences about 5 ms
against about 1 ms of device time per layer (`megainfer bench host`). So it comes in pieces
(`run_piece`): the settle over a range of the step's sequences at a time (`Engine.SETTLE_PIECE`),
then the look-ahead, and the attention node's runner runs one piece after each layer's
dispatches, each within what the device and the expert nodes spend on the layer. A runner with
no layers to spread them over runs them at once (`run_lookahead`); the engine runs whatever the
runner did not reach.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class StepHooks:
    """A step's hooks. A runner that samples micro-batch by micro-batch hands each one's tokens
    to `place` as they are sampled (`place_tokens`), so that the next step's inputs can read them
    while the later micro-batches still wait for their answers, rather than all of them after
    the last one."""

    lookahead: Callable[[], Any] | None = None  # returns the next step (a SchedulerOutput), or None
    # The step before's settling: a generator that does one piece per `next`, the last at the end.
    settle: Callable[[], Iterator[bool]] | None = None
    # place(sequences, tokens): the tokens of those sequences (indices into the step's) written
    # where the next step's inputs read them; False where the step was not scheduled ahead.
    place: Callable[[list[int], list[int]], bool] | None = None
    placed: int = 0  # tokens `place` took so far
    ahead: Any = None  # the look-ahead's step, once it ran
    _pieces: Iterator[bool] | None = None  # the settle under way
    _done: bool = False  # nothing is left beside the layers

    def run_piece(self, everything: bool = False) -> bool:
        """One piece of the work beside the layers (`everything`: all that is left): the
        settle's next piece, else the look-ahead (its step in `ahead`). True from the call that
        finishes the work, False from the others, before and after it."""
        if self._done:
            return False
        while self._settling():
            if next(self._pieces, False):  # True: more of the settle is left
                if not everything:
                    return False
                continue
            self._pieces = None
            if self.lookahead is not None and not everything:
                return False  # the look-ahead is the next piece
        hook, self.lookahead = self.lookahead, None
        if hook is not None:
            self.ahead = hook()
        self._done = True
        return True

    def run_lookahead(self):
        """All that is left beside the layers at once; the next step as scheduled ahead (to lay out
        meanwhile), or None."""
        self.run_piece(everything=True)
        return self.ahead

    def run_settle(self) -> None:
        """The rest of the step before's settling at once (not the look-ahead)."""
        if self._settling():
            for _ in self._pieces:
                pass
            self._pieces = None

    def _settling(self) -> bool:
        if self.settle is not None:
            self._pieces, self.settle = self.settle(), None
        return self._pieces is not None

    def place_tokens(self, sequences: list[int], tokens: list[int]) -> None:
        """Micro-batch by micro-batch, the tokens just sampled for `sequences` (indices into the
        step's sequences, in order)."""
        if self.place is not None and self.place(sequences, tokens):
            self.placed += len(tokens)
