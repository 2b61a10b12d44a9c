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
from megainfer.scheduling.step_layout import LayoutAhead, MicroBatchLayout, StepLayout
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
    def __init__(self, block_size: int, device: torch.device, tables: BlockTableRows) -> None:
        self.block_size, self.device, self.tables = block_size, device, tables  # the runner's
        self._ahead: tuple[SchedulerOutput, StepLayout] | None = None  # the step the kept inputs are of
        self._kept: list[KeptInputs | None] = []  # by micro-batch, those prepared so far (None: not kept)
        self._ready: MicroBatchState | None = None  # micro-batch 0's with its tokens, once placed

    def prepare(self, ahead: tuple[SchedulerOutput, StepLayout] | None, everything: bool = False) -> None:
        """The next micro-batch of `ahead` (the step scheduled ahead and its layout, or None) not
        prepared yet, micro-batch 0 first (`everything`: all that are left), its tokens still
        placeholders; kept for `take`. A runner calls it once after each layer's dispatches,
        once the step ahead is laid out, and for all that are left after the last layer: each
        within what a layer's device time hides. Another step ahead (or None) drops what was kept."""
        if ahead is not self._ahead:
            self._ahead, self._kept, self._ready = ahead, [], None
        if ahead is None:
            return
        out, layout = ahead
        seqs = out.all_seqs
        while len(self._kept) < len(layout.micro_batches):
            batch = layout.micro_batches[len(self._kept)]
            rows = batch.decode_sequences
            if batch.cohort_sequences or not rows or any(layout.num_tokens[i] != 1 for i in rows):
                self._kept.append(None)  # prepared whole at its first layer
                continue
            self.tables.retain(seqs)  # as the step's start does: rows of requests gone may be let go
            inputs = prepare_rows(seqs, layout, rows, self.block_size, self.device, self.tables)
            self._kept.append(KeptInputs(out, batch, inputs, [seqs[i] for i in rows]))
            if not everything:
                return

    def after_layer(self, hooks: StepHooks, layouts: LayoutAhead, m: int, last: bool) -> None:
        """What a runner does on its thread after each layer's dispatches, within what the device
        and the expert nodes then spend on the layer: a piece of the work beside the layers
        (step_hooks.py), the next step laid out once it is scheduled, then one of its micro-batches
        prepared but for its tokens. After the last layer, all that is left."""
        if hooks.run_piece(everything=last):
            layouts.keep(hooks.ahead, m)
        elif hooks.done and not last:
            self.prepare(layouts.peek())
        if last:
            self.prepare(layouts.peek(), everything=True)

    def sampled(self, tokens: list[int], rows: list[int], hooks: StepHooks, model: MoEModel) -> list[int]:
        """A micro-batch of the step before just sampled (`tokens`, of its sequences `rows`):
        they are placed for the step ahead (`StepHooks.place_tokens`) and, once every token the
        kept micro-batch 0 reads is placed, its tokens are read and embedded now, while the
        step's later micro-batches still wait for their answers, so that `take` has nothing left
        to do for it once the last one is sampled (the later micro-batches' tokens are read as
        each one starts). Returns `tokens`."""
        hooks.place_tokens(rows, tokens)
        kept = self._kept[0] if self._kept else None
        if kept is not None and self._ready is None:
            ahead = kept.tokens()
            if PLACEHOLDER not in ahead:
                self._ready = kept.state(ahead, model, self.device)
        return tokens

    def take(self, model: MoEModel, out: SchedulerOutput, layout: StepLayout, micro_batch: int = 0
             ) -> MicroBatchState | None:
        """Micro-batch `micro_batch`'s state of step `out`, if it was prepared ahead: filled
        already (micro-batch 0), or its tokens read now (each row's last, which the step before
        placed) and embedded. None: prepare it whole. What is kept is let go with the last
        micro-batch's."""
        kept = self._kept[micro_batch] if micro_batch < len(self._kept) else None
        ready = self._ready if micro_batch == 0 else None
        stale = kept is not None and kept.out is not out  # kept for a step filtered since
        if stale or micro_batch == len(layout.micro_batches) - 1:
            self._ahead, self._kept, self._ready = None, [], None
        if kept is None or stale:
            return None
        return ready or kept.state(kept.tokens(), model, self.device)
