"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Random rows sample by the exponential race (argmax of p / Exp(1) noise), which draws from
`p` exactly and lets a seeded request use its own generator for its row alone, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from megainfer.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits [N, V] float32 -> one token id per row."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                   device=logits.device)
        logits = logits / temperature[:, None]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _filter_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.seed is not None and not greedy[row]:
                noise[row].exponential_(generator=self._generator_for(rid, p.seed))
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor(greedy, device=logits.device)
        if greedy_mask.any():
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled.tolist()

    def _generator_for(self, request_id: str, seed: int) -> torch.Generator:
        g = self._request_generators.get(request_id)
        if g is None:
            g = self._request_generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf every logit outside each row's top-k and top-p nucleus (one sort for both)."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
