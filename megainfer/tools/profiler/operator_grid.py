"""Where each operator is measured: the grid of problem sizes per operator, by device.

Axes are geometric (powers of two, with the midpoints 3·2^k on the one-axis tables and the
experts axis), since operator times are close to linear in work and the step model
interpolates in log(1 + x); every axis ends at its bound so the table covers it. Bounds:
context up to max_model_len; tokens up to min(max_model_len, 8192 on a GPU / 2048 on a
CPU); sequences up to 256 / 64; experts 1..num_experts; tokens per expert up to 4096 /
2048; all-reduce bytes those of 1..max tokens hidden states. `--quick` keeps three or four
points per axis, for tests and a first look.
"""

from __future__ import annotations

from dataclasses import dataclass

from megainfer.config import ModelConfig

# (GPU, CPU) bounds of the default grid.
MAX_TOKENS = {"cuda": 8192, "cpu": 2048}
MAX_SEQS = {"cuda": 256, "cpu": 64}
MAX_TOKENS_PER_EXPERT = {"cuda": 4096, "cpu": 2048}
CACHED_FROM = 16  # smallest nonzero cached prefix of the prefill grid (one KV block)
OVERHEAD_STEPS = {"cuda": 32, "cpu": 12}  # decode steps timed per batch size for step_overhead
QUICK_OVERHEAD_STEPS = 4


def geometric(lo: int, hi: int, midpoints: bool = False) -> tuple[int, ...]:
    """Powers of two from lo (and 3·2^k between them with midpoints) up to hi, hi included."""
    values, p = set(), 1
    while p <= hi:
        if p >= lo:
            values.add(p)
        if midpoints and lo <= 3 * p // 2 <= hi and p >= 2:
            values.add(3 * p // 2)
        p *= 2
    values.update((lo, hi))
    return tuple(sorted(values))


def _clipped(values: tuple[int, ...], hi: int) -> tuple[int, ...]:
    return tuple(sorted({min(v, hi) for v in values}))


@dataclass(frozen=True)
class OperatorGrid:
    """Per operator, its axes' values in OPERATOR_AXES order (allreduce only with tp > 1), and
    how many decode steps step_overhead times at each of its batch sizes."""

    axes: dict[str, tuple[tuple[int, ...], ...]]
    overhead_steps: int

    def num_points(self, operator: str) -> int:
        n = 1
        for values in self.axes[operator]:
            n *= len(values)
        return n

    @property
    def total_points(self) -> int:
        return sum(self.num_points(op) for op in self.axes)


def default_grid(model: ModelConfig, device_kind: str, max_model_len: int, tp: int, dtype_bytes: int,
                 quick: bool = False) -> OperatorGrid:
    """The grid `megainfer profile` measures on a device of this kind ("cuda" or "cpu")."""
    max_tokens = min(max_model_len, MAX_TOKENS[device_kind])
    max_seqs = MAX_SEQS[device_kind]
    if quick:
        tokens = _clipped((1, 8, 64, 512), max_tokens)
        seqs = _clipped((1, 4, 16), max_seqs)
        axes = {
            "dense": (tokens,),
            "attention_decode": (seqs, _clipped((1, 64, 512), max_model_len)),
            "attention_prefill": (_clipped((1, 16, 256), max_tokens), _clipped((0, 256), max_model_len)),
            "moe": (_clipped((1, 16, 256), MAX_TOKENS_PER_EXPERT[device_kind]),
                    tuple(sorted({1, model.top_k, model.num_experts}))),
            "lm_head": (_clipped((1, 16, 256), max_tokens),),
            "sampling": (seqs,),
            "step_overhead": (_clipped((1, 4), max_seqs),),
        }
        overhead_steps = QUICK_OVERHEAD_STEPS
    else:
        axes = {
            "dense": (geometric(1, max_tokens, midpoints=True),),
            "attention_decode": (geometric(1, max_seqs), geometric(1, max_model_len)),
            "attention_prefill": (geometric(1, max_tokens), (0, *geometric(CACHED_FROM, max_model_len))),
            "moe": (geometric(1, MAX_TOKENS_PER_EXPERT[device_kind]),
                    geometric(1, model.num_experts, midpoints=True)),
            "lm_head": (geometric(1, max_tokens, midpoints=True),),
            "sampling": (geometric(1, max_seqs, midpoints=True),),
            "step_overhead": (geometric(1, max_seqs),),
        }
        overhead_steps = OVERHEAD_STEPS[device_kind]
    if tp > 1:
        row_bytes = model.hidden_size * dtype_bytes  # one token's hidden state, what attention all-reduces
        axes["allreduce"] = (tuple(t * row_bytes for t in axes["dense"][0]),)
    return OperatorGrid(axes, overhead_steps)


def pricing_grid(model: ModelConfig, grid: OperatorGrid) -> OperatorGrid:
    """The tp = 1 points step_overhead's subtraction needs, for a profile at tp > 1 (the engine
    it times runs the model unsharded): its batch sizes, contexts up to the decode grid's, tokens
    per expert up to the largest batch."""
    batches = grid.axes["step_overhead"][0]
    return OperatorGrid({
        "dense": (batches,),
        "attention_decode": (batches, grid.axes["attention_decode"][1]),
        "moe": (geometric(1, batches[-1]), grid.axes["moe"][1]),
        "lm_head": (batches,),
        "sampling": (batches,),
    }, grid.overhead_steps)
