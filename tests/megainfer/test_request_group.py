"""The one request group every frontend uses: ids, all-or-none starts, the prompt's logprobs
shown first, the abort race."""

from __future__ import annotations

import pytest

from megainfer.errors import Overloaded
from megainfer.messages import FinishReason, RequestDelta
from megainfer.request_group import GroupPrompt, RequestGroup
from megainfer.sampling_params import SamplingParams


def delta(engine_id, token, finished=False, prompt_logprobs=None):
    return RequestDelta(engine_id, [token], f"<{token}>", finished, FinishReason.LENGTH if finished else None,
                        prompt_logprobs=prompt_logprobs)


def test_each_completion_is_one_engine_request_named_by_its_index():
    group = RequestGroup("req", [GroupPrompt([1, 2], SamplingParams(n=2, seed=7, prompt_logprobs=1)),
                                 GroupPrompt([3], SamplingParams(n=2, seed=7))])
    assert [c.engine_id for c in group.completions] == ["req-0", "req-1", "req-2", "req-3"]
    assert [c.params.seed for c in group.completions] == [7, 8, 7, 8]
    assert all(c.params.n == 1 for c in group.completions)
    # Prompt logprobs are computed once per prompt, by its first choice.
    assert [c.params.prompt_logprobs for c in group.completions] == [1, None, None, None]
    assert RequestGroup.of("one", [1], SamplingParams()).completions[0].engine_id == "one-0"
    assert group.prompt_tokens == 3


def test_a_refused_completion_withdraws_those_started():
    group = RequestGroup.of("r", [1, 2], SamplingParams(n=3))
    started, aborted = [], []

    def submit(engine_id, prompt, params):
        if engine_id == "r-2":
            raise Overloaded("full")
        started.append(engine_id)
        return engine_id

    with pytest.raises(Overloaded):
        group.start(submit, aborted.append)
    assert aborted == started == ["r-0", "r-1"]


def test_other_choices_wait_for_the_prompts_logprobs():
    group = RequestGroup.of("r", [1, 2], SamplingParams(n=2, prompt_logprobs=0))
    first, second = group.completions
    shown, gap = group.arrived(second, delta("r-1", 5), now=1.0)
    assert shown == [] and gap is None and second.token_ids == [5]  # taken, not yet shown
    logprobs = [None, {2: None}]
    shown, _ = group.arrived(first, delta("r-0", 9, prompt_logprobs=logprobs), now=2.0)
    assert [(c.index, d.new_token_ids) for c, d in shown] == [(0, [9]), (1, [5])]
    assert second.prompt_logprobs == logprobs  # shared by the prompt's choices
    shown, gap = group.arrived(second, delta("r-1", 6), now=3.5)
    assert [(c.index, d.new_token_ids) for c, d in shown] == [(1, [6])] and gap == 2.5


def test_the_first_last_delta_counts_whichever_comes_first():
    group = RequestGroup.of("r", [1], SamplingParams(n=2))
    a, b = group.completions
    group.arrived(a, delta("r-0", 1, finished=True))
    aborts = group.abort_deltas()
    assert [c.index for c, _ in aborts] == [1]  # only what still runs
    # The abort lost the race with b's own end: b's end counts, the abort is passed over.
    group.arrived(b, delta("r-1", 2, finished=True))
    shown, _ = group.arrived(b, aborts[0][1])
    assert shown == [] and b.finish_reason is FinishReason.LENGTH and group.finished
    # An abort that won: the completion's own last delta is passed over.
    group = RequestGroup.of("s", [1], SamplingParams())
    (c, abort), = group.abort_deltas()
    group.arrived(c, abort)
    shown, _ = group.arrived(c, delta("s-0", 3, finished=True))
    assert shown == [] and c.finish_reason is FinishReason.ABORT and c.token_ids == []
