"""DeepSeek's routing, split so the gating kernel still picks and lays out the experts.

V2 scores experts by softmax, V3 by sigmoid plus a per-expert correction bias that steers the
choice but not the weights. Where experts come in groups (`n_group`), a token first keeps the
`topk_group` best groups (a group scored by its best expert, V2's group_limited_greedy, or its
best two, V3) and chooses its top-k inside them. `grouped_choice` gives the scores the choice is
made on (other groups' at the lowest float, never chosen: at least top-k experts remain) and the
scores the weights come from; the gating kernel's top-k of the first (its softmax is monotonic,
so the order is theirs) gives the ids; `grouped_weights` takes the weights from the second,
renormalised where the model does, times routed_scaling_factor. As transformers'
DeepseekV2TopkRouter / DeepseekV3TopkRouter, in float32.
"""

from __future__ import annotations

import torch

from megainfer.config import ModelConfig


def grouped_choice(logits: torch.Tensor, cfg: ModelConfig,
                   score_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (choice scores [T, E], weight scores [T, E]), both float32."""
    logits = logits.float()
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if score_bias is None else scores + score_bias
    if cfg.n_group > 1:
        groups = choice.view(choice.shape[0], cfg.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1) if cfg.scoring == "sigmoid" else groups.amax(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=1), torch.finfo(torch.float32).min)
    return choice, scores


def grouped_weights(scores: torch.Tensor, ids: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The chosen experts' weights [T, k] from their scores."""
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor
