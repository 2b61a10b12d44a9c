"""Micro-batch 0 of the step scheduled ahead, prepared while the step before waits for its
last answers (asynchronous scheduling on a disaggregated attention node).

Between a step's last answer and the next step's first dispatch the expert nodes have nothing
to do, and what the attention node does there is the step boundary they wait through. With
the next step scheduled and laid out ahead (`LayoutAhead`), everything of its micro-batch 0's
inputs but the tokens is known while the step before is still in its last layer: positions,
block tables, slot mapping. `InputsAhead.prepare` builds them then (the tokens the step before
is sampling are placeholders there, `token_recorder.PLACEHOLDER`); once those are placed,
`take` reads each row's token and embeds, one pass over the rows instead of the whole
preparation (`megainfer bench host`'s "experts wait"). A step sampled micro-batch by
micro-batch places each one's tokens as it is sampled (`StepHooks.place_tokens`); then `sampled`
does that pass as soon as the rows' tokens are all placed, usually before the last micro-batch's
answers, and the boundary the expert nodes wait through holds no part of micro-batch 0's inputs.

Only a micro-batch of plain decodes is prepared ahead (one token each, no layered cohort: the
steady state at scale); anything else, or a step filtered since it was scheduled (a request
aborted or stopped meanwhile: `ScheduledAhead.take`), is prepared as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import getitem

import numpy as np
import torch

from megainfer.model.moe_model import MoEModel
from megainfer.runner.model_runner import BatchInputs, MicroBatchState, prepare_rows
from megainfer.runner.step_hooks import StepHooks
from megainfer.scheduling.block_table_rows import BlockTableRows
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.sequence import TOKEN_IDS
from megainfer.scheduling.step_layout import MicroBatchLayout, StepLayout
from megainfer.scheduling.token_recorder import PLACEHOLDER


@dataclass
class KeptInputs:
    """Micro-batch 0 of the step scheduled ahead, prepared but for its tokens."""

    out: SchedulerOutput  # the step
    batch: MicroBatchLayout  # its micro-batch 0
    inputs: BatchInputs  # (token ids: placeholders, positions, attention metadata)
    seqs: list  # the micro-batch's sequences, in row order

    def tokens(self) -> list[int]:
        """The rows' tokens: a decode row's is the one at its position, its sequence's length
        less one (`PLACEHOLDER` until the step before places it)."""
        return list(map(getitem, map(TOKEN_IDS, self.seqs), [end - 1 for end in self.inputs[2].seq_lens_host]))

    def state(self, tokens: list[int], model: MoEModel, device: torch.device) -> MicroBatchState:
        """The micro-batch's state with `tokens`, embedded."""
        inputs = (torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(device), self.inputs[1], self.inputs[2])
        return MicroBatchState(self.batch, inputs, inputs, model.embed(inputs[0]), None)


class InputsAhead:
    def __init__(self) -> None:
        self._kept: KeptInputs | None = None
        self._ready: MicroBatchState | None = None  # the kept inputs with their tokens, once placed

    def prepare(self, ahead: tuple[SchedulerOutput, StepLayout] | None, block_size: int, device: torch.device,
                tables: BlockTableRows) -> None:
        """Micro-batch 0's inputs of `ahead` (the step scheduled ahead and its layout, or None),
        its tokens still placeholders; kept for `take`."""
        self._kept, self._ready = None, None
        if ahead is None:
            return
        out, layout = ahead
        batch = layout.micro_batches[0]
        rows = batch.decode_sequences
        if batch.cohort_sequences or not rows or any(layout.num_tokens[i] != 1 for i in rows):
            return
        seqs = out.all_seqs
        tables.retain(seqs)  # as the step's start does: rows of requests gone may be let go
        self._kept = KeptInputs(out, batch, prepare_rows(seqs, layout, rows, block_size, device, tables),
                                [seqs[i] for i in rows])

    def sampled(self, tokens: list[int], rows: list[int], hooks: StepHooks, model: MoEModel) -> list[int]:
        """A micro-batch of the step before just sampled (`tokens`, of its sequences `rows`):
        they are placed for the step ahead (`StepHooks.place_tokens`) and, once every token the
        kept micro-batch 0 reads is placed, its tokens are read and embedded now, while the
        step's later micro-batches still wait for their answers, so that `take` has nothing left
        to do once the last one is sampled. Returns `tokens`."""
        hooks.place_tokens(rows, tokens)
        kept = self._kept
        if kept is not None and self._ready is None:
            ahead = kept.tokens()
            if PLACEHOLDER not in ahead:
                self._ready = kept.state(ahead, model, kept.inputs[1].device)
        return tokens

    def take(self, model: MoEModel, out: SchedulerOutput, layout: StepLayout, device: torch.device
             ) -> MicroBatchState | None:
        """Micro-batch 0's state of step `out`, if it was prepared ahead: filled already, or its
        tokens read now (each row's last, which the step before placed) and embedded. None:
        prepare it whole."""
        kept, ready = self._kept, self._ready
        self._kept, self._ready = None, None
        if kept is None or kept.out is not out:
            return None
        return ready or kept.state(kept.tokens(), model, device)

