"""The predictive router's prior, drawn from the planner's step model.

A replica's `OnlineStepModel` starts from a prior and moves toward the steps it measures. The
prior here is that model's node coefficients (fixed, tokens, seqs, kv_tokens, score_pairs)
fitted by non-negative least squares to what `planner.step_cost_model` charges for a grid of
steps: decode batches at several contexts, and prompt chunks beside a few decodes. So a fresh
replica predicts with the numbers `simulate` and `plan` use (an operator profile where one was
given, efficiency curves elsewhere) until its own measurements take over.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from planner.step_cost_model import AttentionWork, ColocatedStepModel, LayerClass

DECODE_BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 1024, 4096)
PROMPT_CHUNKS = (64, 256, 1024, 2048)


def _expected_experts(tokens: int, num_experts: int, top_k: int) -> int:
    """Distinct experts `tokens` tokens touch under uniform routing, rounded."""
    return max(1, round(num_experts * (1 - (1 - top_k / num_experts) ** tokens)))


def _steps(max_len: int) -> list[tuple[list[tuple[int, int]], int]]:
    """((scheduled tokens, computed tokens) per sequence, sequences sampling) of each grid step."""
    steps = []
    for context in (c for c in CONTEXTS if c < max_len):
        for batch in DECODE_BATCHES:
            steps.append(([(1, context - 1)] * batch, batch))
        for chunk in (n for n in PROMPT_CHUNKS if n < max_len):
            cached = min(context, max_len - chunk) if context > chunk else 0
            steps.append(([(chunk, cached)] + [(1, context - 1)] * 8, 8))
    return steps


def step_prior(step_model: ColocatedStepModel) -> tuple[float, float, float, float, float]:
    """(fixed s, s per token, s per sequence, s per cached token read, s per score pair)."""
    model = step_model.model
    rows, seconds = [], []
    for chunks, sampled in _steps(model.max_position_embeddings):
        work = AttentionWork.of_chunks(chunks)
        tokens = sum(n for n, _ in chunks)
        layer = LayerClass(model.num_layers, tokens, work, _expected_experts(tokens, model.num_experts, model.top_k),
                           dense_layers=model.first_k_dense)
        cost = step_model.step([layer], sampled=sampled, seqs=len(chunks))
        rows.append((1.0, tokens, len(chunks), work.kv_tokens, work.score_pairs))
        seconds.append(cost.seconds)
    x, y = np.asarray(rows), np.asarray(seconds)
    scale = x.max(axis=0)  # columns span ten orders of magnitude: solve on unit columns
    coef, _ = nnls(x / scale, y)
    return tuple(float(c) for c in coef / scale)
