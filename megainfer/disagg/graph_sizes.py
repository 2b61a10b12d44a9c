"""Which batch sizes decode's CUDA graphs are captured at, and which one a batch replays: plain
integers, free of torch, so that `megainfer deploy --dry-run` can say them without loading it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def capture_sizes(most_rows: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` as given (sorted), else 1, 2, 4, 8, then two a
    doubling (x1.5, x2: no batch pads by more than a third) up to the first that holds
    `most_rows`."""
    if sizes is not None:
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
            raise ValueError(f"CUDA graph sizes must be positive integers, got {list(sizes)!r}")
        return tuple(sorted(set(sizes)))
    ladder, n = [], 1
    while True:
        ladder.append(n)
        if n >= most_rows:
            return tuple(ladder)
        if n < 8:
            n *= 2
        else:  # 8, 12, 16, 24, 32, 48, 64 ...: x1.5 from a power of two, x4/3 back to the next
            n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3


def size_for(sizes: tuple[int, ...], rows: int) -> int | None:
    """The smallest captured size holding `rows`, or None (run eager)."""
    k = bisect.bisect_left(sizes, rows)
    return sizes[k] if k < len(sizes) else None
