"""How many tokens a request will still generate: the predictive router's response-length
estimate. Pluggable; the default learns from the requests that finished.

`BucketedLengthEstimator` keeps, per prompt-length bucket (powers of two), the output lengths
of recent finished requests, and answers the mean of those longer than what the request has
generated so far (the expected total given it has not stopped yet), capped by max_tokens.
Before a bucket has seen enough requests it borrows the nearest bucket with data, and before
any request has finished it answers the prior.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np


class OutputLengthEstimator(Protocol):
    name: str

    def estimate(self, prompt_tokens: int, generated: int, max_tokens: int) -> int:
        """Expected total output tokens (>= generated + 1, <= max_tokens)."""

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request finished after `output_tokens` generated tokens."""


class MaxTokensEstimator:
    """Every request runs to max_tokens: exact when clients set max_tokens and ignore EOS."""

    name = "max_tokens"

    def estimate(self, prompt_tokens: int, generated: int, max_tokens: int) -> int:
        return max(max_tokens, generated + 1)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Nothing to learn."""


class BucketedLengthEstimator:
    name = "bucketed"

    def __init__(self, *, prior: int = 256, window: int = 256, min_samples: int = 8) -> None:
        self.prior = prior
        self.window = window
        self.min_samples = min_samples
        self._lengths: dict[int, deque[int]] = {}
        self._sorted: dict[int, np.ndarray] = {}  # bucket -> its lengths sorted, rebuilt on change

    @staticmethod
    def bucket(prompt_tokens: int) -> int:
        return max(int(prompt_tokens), 1).bit_length()

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        bucket = self.bucket(prompt_tokens)
        self._lengths.setdefault(bucket, deque(maxlen=self.window)).append(int(output_tokens))
        self._sorted.pop(bucket, None)

    def _samples(self, bucket: int) -> np.ndarray | None:
        """The sorted output lengths of `bucket`, or of the nearest bucket with enough of them."""
        ready = [b for b, lengths in self._lengths.items() if len(lengths) >= self.min_samples]
        if not ready:
            return None
        nearest = min(ready, key=lambda b: (abs(b - bucket), b))
        lengths = self._sorted.get(nearest)
        if lengths is None:
            lengths = self._sorted[nearest] = np.sort(np.fromiter(self._lengths[nearest], dtype=np.int64))
        return lengths

    def estimate(self, prompt_tokens: int, generated: int, max_tokens: int) -> int:
        lengths = self._samples(self.bucket(prompt_tokens))
        if lengths is None:
            guess = self.prior
        else:
            longer = lengths[np.searchsorted(lengths, generated, side="right"):]
            # A request already past every length seen: it goes on a while longer (half again).
            guess = float(longer.mean()) if len(longer) else generated * 1.5
        return int(min(max(round(guess), generated + 1), max(max_tokens, generated + 1)))


ESTIMATORS = {"bucketed": BucketedLengthEstimator, "max_tokens": MaxTokensEstimator}
