"""What an engine scheduling asynchronously asks of a runner during a step (a runner with
`takes_step_hooks`): the work beside the layers, and the tokens placed as they are sampled.

The work beside the layers is the step before's settling (its stops, deltas and statistics) and
then the look-ahead (the next step scheduled), as vLLM schedules ahead once a step is launched.
On a GPU it runs on the thread that launches the layers and posts the rounds, so done in one
piece it holds back the next layer: at the shipped Qwen3-235B plan's 1,884 sequences about 5 ms
against about 1 ms of device time per layer (`megainfer bench host`). So it comes in pieces
(`run_piece`): the settle over a range of the step's sequences at a time (`Engine.SETTLE_PIECE`),
then the look-ahead in two (the sequences advanced, then the next step scheduled). The attention
node's runner runs one piece after each layer's dispatches, most of them within what the device
and the expert nodes spend on the layer. A runner with no layers to spread them over runs them
at once (`run_lookahead`); the engine runs whatever the runner did not reach.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class StepHooks:
    """A step's hooks. A runner that samples micro-batch by micro-batch hands each one's tokens
    to `place` as they are sampled (`place_tokens`), so that the next step's inputs can read them
    while the later micro-batches still wait for their answers, rather than all of them after
    the last one."""

    # The look-ahead: a generator that does one piece per `next` and returns the next step (a
    # SchedulerOutput), or None.
    lookahead: Callable[[], Generator[bool, None, Any]] | None = None
    # The step before's settling: a generator that does one piece per `next`, the last at the end.
    settle: Callable[[], Iterator[bool]] | None = None
    # place(sequences, tokens): the tokens of those sequences (indices into the step's) written
    # where the next step's inputs read them; False where the step was not scheduled ahead.
    place: Callable[[list[int], list[int]], bool] | None = None
    placed: int = 0  # tokens `place` took so far
    ahead: Any = None  # the look-ahead's step, once it ran
    _settle_left: Iterator[bool] | None = None  # the settle under way
    _look_left: Generator[bool, None, Any] | None = None  # the look-ahead under way
    _done: bool = False  # nothing is left beside the layers

    def run_piece(self, everything: bool = False) -> bool:
        """One piece of the work beside the layers (`everything`: all that is left): the
        settle's next piece, else the look-ahead's (its step in `ahead` after the last). True
        from the call that finishes the work, False from the others, before and after it."""
        if self._done:
            return False
        while True:
            if self._settling():
                if not next(self._settle_left, False):  # its last piece
                    self._settle_left = None
            elif self._looking():
                self._look_piece()
            if not self._left():
                self._done = True
                return True
            if not everything:
                return False

    def run_lookahead(self):
        """All that is left beside the layers at once; the next step as scheduled ahead (to lay out
        meanwhile), or None."""
        self.run_piece(everything=True)
        return self.ahead

    def run_settle(self) -> None:
        """The rest of the step before's settling at once (not the look-ahead)."""
        if self._settling():
            for _ in self._settle_left:
                pass
            self._settle_left = None

    def finish_begun(self) -> None:
        """What a runner left half done: the settle's rest, and the look-ahead's if it began (one
        that did not begin is not begun: the engine then records the step after it ends)."""
        self.run_settle()
        while self._look_left is not None:
            self._look_piece()

    def _settling(self) -> bool:
        if self.settle is not None:
            self._settle_left, self.settle = self.settle(), None
        return self._settle_left is not None

    def _looking(self) -> bool:
        if self.lookahead is not None:
            self._look_left, self.lookahead = self.lookahead(), None
        return self._look_left is not None

    def _look_piece(self) -> None:
        try:
            next(self._look_left)
        except StopIteration as returned:  # its last piece: the step it scheduled
            self.ahead, self._look_left = returned.value, None

    def _left(self) -> bool:
        return any(part is not None for part in (self.settle, self._settle_left, self.lookahead, self._look_left))

    def place_tokens(self, sequences: list[int], tokens: list[int]) -> None:
        """Micro-batch by micro-batch, the tokens just sampled for `sequences` (indices into the
        step's sequences, in order)."""
        if self.place is not None and self.place(sequences, tokens):
            self.placed += len(tokens)
