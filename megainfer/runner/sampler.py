"""Token sampling with vLLM's semantics, vectorised over the batch.

A row's logits go, in vLLM v1's order: min_tokens (EOS and stop tokens masked until enough
were generated) -> penalties (repetition over prompt and generated tokens, CTRL-style;
frequency and presence over generated tokens) -> greedy argmax, or temperature -> min_p ->
top-k / top-p -> a random draw. Each stage runs only when some row of the batch needs it, on
per-row tensors: an all-greedy batch without penalties is one argmax.

Random rows sample by the exponential race (argmax of p / Exp(1) noise), which draws from
`p` exactly and lets a seeded request use its own generator for its row alone, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import torch

from megainfer.messages import Logprob, PositionLogprobs
from megainfer.sampling_params import SamplingParams

class TokenHistory(Protocol):
    """What penalties and min_tokens read of a request (a `Sequence` is one)."""

    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...


class Sampler:
    def __init__(self, seed: int, device: torch.device | str, eos_token_ids: Iterable[int] = ()) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)  # masked by min_tokens unless the request ignores EOS
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               histories: Sequence[TokenHistory] | None = None) -> list[int]:
        """logits [N, V] float32 -> one token id per row. `histories[i]` is row i's tokens so far,
        needed when a row has penalties or min_tokens. `logits` is left as it was (the caller may
        take raw logprobs from it)."""
        logits = self._process(logits, params, histories)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return self.greedy(logits)
        temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                   device=logits.device)
        scaled = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            scaled = _filter_min_p(scaled, [p.min_p for p in params])
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.seed is not None and not greedy[row]:
                noise[row].exponential_(generator=self._generator_for(rid, p.seed))
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor(greedy, device=logits.device)
        if greedy_mask.any():
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled.tolist()

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """`sample` of rows that are all greedy without penalties or min_tokens: one argmax."""
        return logits.argmax(dim=-1).tolist()

    def _process(self, logits: torch.Tensor, params: list[SamplingParams],
                 histories: Sequence[TokenHistory] | None) -> torch.Tensor:
        """min_tokens and penalties, on a copy; `logits` itself when no row needs them."""
        masked = [i for i, p in enumerate(params) if p.min_tokens]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if not masked and not penalised:
            return logits
        if histories is None:
            raise ValueError("rows with penalties or min_tokens need their token histories")
        logits = logits.clone()
        if masked:
            self._mask_stop_tokens(logits, [(i, params[i], histories[i]) for i in masked])
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            logits[rows] = apply_penalties(logits[rows], [params[i] for i in penalised],
                                           [histories[i] for i in penalised])
        return logits

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[tuple[int, SamplingParams, TokenHistory]]) -> None:
        """EOS (unless ignored) and stop_token_ids to -inf in rows that generated fewer than
        min_tokens, in place."""
        vocab = logits.shape[-1]
        index_rows, index_cols = [], []
        for i, p, history in rows:
            if len(history.output_token_ids) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(self.eos_token_ids)
            stops = [t for t in stops if t < vocab]
            index_rows += [i] * len(stops)
            index_cols += stops
        if index_rows:
            logits[torch.tensor(index_rows, device=logits.device),
                   torch.tensor(index_cols, device=logits.device)] = float("-inf")

    def _generator_for(self, request_id: str, seed: int) -> torch.Generator:
        g = self._request_generators.get(request_id)
        if g is None:
            g = self._request_generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] int64: how often each token occurs in each row's list (one bincount)."""
    rows = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists])
    flat = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(rows), lengths)
    keys = (row_of * vocab + flat.clamp(0, vocab - 1)).to(device)
    return torch.bincount(keys, minlength=rows * vocab).view(rows, vocab)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    """vLLM's penalties on [rows, V] logits (a new tensor): the repetition penalty divides the
    positive and multiplies the negative logits of every token in the prompt or the output
    (CTRL); the frequency penalty subtracts once per occurrence in the output, the presence
    penalty once for any occurrence."""
    vocab, device = logits.shape[-1], logits.device
    outputs = [h.output_token_ids for h in histories]
    output_counts = token_counts(outputs, vocab, device)
    seen_in_output = output_counts > 0
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if (repetition != 1).any():
        seen = seen_in_output | (token_counts([h.prompt_token_ids for h in histories], vocab, device) > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * output_counts - presence * seen_in_output


def _filter_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask to -inf tokens less likely than min_p times the row's most likely one (after
    temperature, as vLLM; the most likely token always stays)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.tensor(min_p, device=logits.device, dtype=probs.dtype)[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def position_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[PositionLogprobs]:
    """Per row of [rows, V] logits: the log-probability and rank of `token_ids[row]`, then the
    row's `num_top[row]` most likely tokens (vLLM's shape; a token appears once).

    These are the raw log-softmax of the model's logits, before temperature, penalties and
    filtering: vLLM's default `logprobs_mode` ("raw_logprobs"), so a token's logprob does not
    depend on how it was sampled. Text is left to the caller (it has the tokenizer)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen_logprobs = logprobs.gather(1, chosen)
    # Rank 1 is the most likely; ties share the larger rank, as vLLM counts them.
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1).tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, :0])
    out: list[PositionLogprobs] = []
    for token, value, rank, values, ids, n in zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks,
                                                  top_values.tolist(), top_ids.tolist(), num_top):
        entry = {token: Logprob(value, rank)}
        for r, (top_id, top_value) in enumerate(zip(ids[:n], values[:n]), start=1):
            entry.setdefault(top_id, Logprob(top_value, r))
        out.append(entry)
    return out
