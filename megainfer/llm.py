"""Offline API in vLLM's shape: `LLM(model).generate(prompts, SamplingParams(...))` and
`LLM.chat(messages)`, each returning one `RequestOutput` per prompt."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from functools import cached_property
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from megainfer.chat_template import ChatTemplate
from megainfer.engine.engine import Engine, Prompt
from megainfer.engine_config import EngineConfig
from megainfer.errors import RequestError
from megainfer.generation_config import generation_defaults
from megainfer.messages import FinishReason, RequestDelta
from megainfer.outputs import CompletionOutput, OutputMetrics, RequestOutput
from megainfer.request_group import Completion, RequestGroup
from megainfer.sampling_params import SamplingParams

Message = dict[str, Any]  # {"role": ..., "content": ...} as transformers' chat templates take it


class LLM:
    def __init__(self, model: str | os.PathLike = "tiny-mixtral", dtype: str = "auto", device: str = "auto",
                 seed: int = 0, chat_template: str | Path | None = None, **engine_options) -> None:
        """`model`: a checkpoint directory, a preset or a Hugging Face id in the local cache;
        `chat_template`: a Jinja file (or its text) replacing the checkpoint's, for `chat`;
        `engine_options`: EngineConfig's fields."""
        self.engine = Engine(model, EngineConfig(dtype=dtype, device=device, seed=seed, **engine_options))
        self.checkpoint = self.engine.checkpoint  # None for a preset
        self._chat_template_override = chat_template
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @cached_property
    def _defaults(self) -> dict[str, Any]:
        return generation_defaults(self.checkpoint)

    @cached_property
    def _chat_template(self) -> ChatTemplate | None:
        return ChatTemplate.load(self.checkpoint, self._chat_template_override)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no parameters: the sampling settings of the
        checkpoint's generation_config.json, SamplingParams' defaults for the rest (as vLLM)."""
        return SamplingParams(**self._defaults)

    def generate(self, prompts: Prompt | Mapping | Seq[Prompt | Mapping],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}); outputs in the prompts' order, each with its
        `sampling_params.n` completions.

        An invalid prompt or parameter raises RequestError naming its index before any work is
        done for the batch. A request that fails while running (a broken step, a token the
        tokenizer cannot decode) does not raise: its completion ends with finish_reason "error"
        and `error` saying why, with the text and tokens it had; the other prompts' outputs
        are whole. (vLLM raises only when its engine dies; here a request fails alone, and
        raising would throw the batch's good results away.)"""
        items = [(p if isinstance(p, str) else None, p) for p in _normalise_prompts(prompts)]
        return self._run(items, sampling_params, use_tqdm, "prompt")

    def chat(self, messages: list[Message] | Seq[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | Path | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several (a list of
        those), each rendered with the chat template (`chat_template`, else the LLM's override,
        else the checkpoint's) and tokenized as transformers' apply_chat_template does (the
        template writes BOS itself). `continue_final_message` leaves the last message open
        for the model to go on with; `chat_template_kwargs` reach the template as variables
        (e.g. enable_thinking). Each output's `prompt` is the rendered conversation."""
        if not isinstance(messages, Seq) or isinstance(messages, str) or not messages:
            raise RequestError("messages must be a non-empty list of messages, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        template = (ChatTemplate.load(self.checkpoint, chat_template) if chat_template is not None
                    else self._chat_template)
        if template is None:
            raise RequestError(f"model {self.engine.model_config.name} has no chat template (none in its "
                               "tokenizer_config.json or chat_template.jinja); pass chat_template=")
        if self.tokenizer is None:
            raise RequestError(f"model {self.engine.model_config.name} has no tokenizer to encode the chat with")
        items = []
        for i, conversation in enumerate(conversations):
            try:
                text = template.render(list(conversation), add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       **(chat_template_kwargs or {}))
            except RequestError as exc:
                raise RequestError(f"conversation {i}: {exc}") from None
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm, "conversation")

    def _run(self, items: list[tuple[str | None, Prompt]], sampling_params, use_tqdm: bool,
             what: str) -> list[RequestOutput]:
        """Submit every (prompt text, prompt) item's n completions, step the engine until all
        ended, and gather them."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise RequestError(f"sampling_params has {len(params_list)} entries for {len(items)} {what}s")
        runs = [_PromptRun(RequestGroup.of(str(next(self._ids)), prompt, params, text or ""), text)
                for (text, prompt), params in zip(items, params_list)]
        running: dict[str, tuple[_PromptRun, Completion]] = {}  # engine request id -> its run, until its last delta
        try:
            for i, run in enumerate(runs):
                try:
                    run.start(self.engine)
                except RequestError as exc:
                    raise RequestError(f"{what} {i}: {exc}") from None
                running.update((c.engine_id, (run, c)) for c in run.group.completions)
            with tqdm(total=len(running), desc="generating", disable=not use_tqdm) as bar:
                while running:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError(f"the engine ended {sorted(running)} without their last deltas")
                    for delta in self.engine.step():
                        run, c = running.get(delta.request_id, (None, None))
                        if run is None:
                            continue  # another caller's request on a shared engine
                        run.arrived(c, delta, time.monotonic())
                        if delta.finished:
                            del running[delta.request_id]
                            bar.update(1)
        except BaseException:  # a bad prompt, an interrupt: leave the engine with none of ours
            for engine_id in running:
                self.engine.abort(engine_id)
            raise
        return [run.output() for run in runs]


class _PromptRun:
    """One prompt's request group on the engine, and its metrics."""

    def __init__(self, group: RequestGroup, prompt_text: str | None) -> None:
        self.group = group
        self.prompt_text = prompt_text
        self.metrics = OutputMetrics(arrival_time=time.monotonic())

    def start(self, engine: Engine) -> None:
        """Queue every completion, or none (`RequestGroup.start`)."""
        sequences = self.group.start(engine.add_request, engine.abort)
        prompt = self.group.prompts[0]
        prompt.token_ids = list(sequences[0].prompt_token_ids)
        prompt.num_tokens = len(prompt.token_ids)  # a text prompt's, as the engine tokenized it

    def arrived(self, c: Completion, delta: RequestDelta, now: float) -> None:
        _, gap = self.group.arrived(c, delta, now)
        metrics = self.metrics
        if delta.new_token_ids:
            # Tokens of one delta arrive together: the gaps between them are 0.
            metrics.tbt_s += ([] if gap is None else [gap]) + [0.0] * (len(delta.new_token_ids) - 1)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        if delta.finished:
            metrics.finished_time = now  # the last completion to end sets it last

    def output(self) -> RequestOutput:
        completions = self.group.completions
        self.metrics.engine = [c.last.metrics if c.last is not None else None for c in completions]
        prompt = self.group.prompts[0]
        return RequestOutput(request_id=self.group.request_id, prompt=self.prompt_text,
                             prompt_token_ids=prompt.token_ids, prompt_logprobs=prompt.logprobs,
                             outputs=[_output(c) for c in completions],
                             finished=self.group.finished, metrics=self.metrics,
                             num_cached_tokens=self.group.cached_tokens)


def _output(c: Completion) -> CompletionOutput:
    last, asked = c.last, c.params.logprobs is not None
    logprobs = c.logprobs if asked else None
    cumulative = sum(p[t].logprob for t, p in zip(c.token_ids, logprobs)) if asked else None
    return CompletionOutput(
        index=c.index, text="".join(c.text), token_ids=c.token_ids, cumulative_logprob=cumulative,
        logprobs=logprobs, finish_reason=None if last is None else last.finish_reason.value,
        stop_reason=c.stop_reason,
        error=last.error if last is not None and last.finish_reason is FinishReason.ERROR else None)


def _normalise_prompts(prompts) -> list[Prompt]:
    """One prompt (a string, a list of ints, or vLLM's prompt dict) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return [_one_prompt(prompts, 0)]
    if isinstance(prompts, Seq) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Seq):
        return [_one_prompt(p, i) for i, p in enumerate(prompts)]
    raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; "
                       f"got {type(prompts).__name__}")


def _one_prompt(prompt, index: int) -> Prompt:
    if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt
        keys = set(prompt)
        if keys == {"prompt"}:
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return list(prompt["prompt_token_ids"])
        raise RequestError(f"prompt {index}: a prompt dict holds exactly one of 'prompt' (text) or "
                           f"'prompt_token_ids'; got keys {sorted(keys)}")
    if isinstance(prompt, Seq) and not isinstance(prompt, str):
        return list(prompt)
    return prompt
