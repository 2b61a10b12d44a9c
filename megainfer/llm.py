"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from megainfer.config import EngineConfig
from megainfer.engine import Engine, Prompt
from megainfer.errors import RequestError
from megainfer.outputs import RequestOutput
from megainfer.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | os.PathLike = "tiny-mixtral", dtype: str = "float32", seed: int = 0,
                 **engine_options) -> None:
        self.engine = Engine(model, EngineConfig(dtype=dtype, seed=seed, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the prompts' order.

        An invalid prompt or parameter raises RequestError naming its index before any
        work is done for the batch."""
        prompt_list = _normalise_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise RequestError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        seqs = {}
        try:
            for i, (rid, prompt, params) in enumerate(zip(ids, prompt_list, params_list)):
                try:
                    seqs[rid] = self.engine.add_request(rid, prompt, params)
                except RequestError as exc:
                    raise RequestError(f"prompt {i}: {exc}") from None
        except RequestError:
            for rid in seqs:
                self.engine.abort(rid)
            raise
        texts = {rid: [] for rid in ids}
        text_prompts = {rid: p for rid, p in zip(ids, prompt_list) if isinstance(p, str)}
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for delta in self.engine.step():
                    if delta.request_id not in texts:
                        continue
                    texts[delta.request_id].append(delta.new_text)
                    if delta.finished:
                        seq = seqs[delta.request_id]
                        now = time.monotonic()
                        done[delta.request_id] = RequestOutput(
                            request_id=delta.request_id,
                            prompt=text_prompts.get(delta.request_id),
                            prompt_token_ids=seq.prompt_token_ids,
                            token_ids=seq.output_token_ids,
                            text="".join(texts[delta.request_id]),
                            finish_reason=delta.finish_reason,
                            error=delta.error,
                            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
                            tbt_s=seq.tbt_s,
                            latency_s=now - seq.arrival_time,
                            num_preemptions=seq.num_preemptions,
                        )
                        bar.update(1)
        return [done[rid] for rid in ids]


def _normalise_prompts(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of ints) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Seq) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Seq):
        return [p if isinstance(p, str) else list(p) if isinstance(p, Seq) else p for p in prompts]
    raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; "
                       f"got {type(prompts).__name__}")
