"""Micro-batch 0 of the step scheduled ahead, prepared while the step before waits for its
last answers (asynchronous scheduling on a disaggregated attention node).

Between a step's last answer and the next step's first dispatch the expert nodes have nothing
to do, and what the attention node does there is the step boundary they wait through. With
the next step scheduled and laid out ahead (`LayoutAhead`), everything of its micro-batch 0's
inputs but the tokens is known while the step before is still in its last layer: positions,
block tables, slot mapping. `InputsAhead.prepare` builds them then (the tokens the step before
is sampling are placeholders there, `token_recorder.PLACEHOLDER`); once those are placed,
`take` reads each row's token and embeds, one pass over the rows instead of the whole
preparation (`megainfer bench host`'s "experts wait").

Only a micro-batch of plain decodes is prepared ahead (one token each, no layered cohort: the
steady state at scale); anything else, or a step filtered since it was scheduled (a request
aborted or stopped meanwhile: `ScheduledAhead.take`), is prepared as before.
"""

from __future__ import annotations

from operator import attrgetter, getitem

import torch

from megainfer.model.moe_model import MoEModel
from megainfer.runner.model_runner import BatchInputs, MicroBatchState, prepare_rows
from megainfer.scheduling.block_table_rows import BlockTableRows
from megainfer.scheduling.scheduler_output import SchedulerOutput
from megainfer.scheduling.step_layout import StepLayout

_TOKEN_IDS = attrgetter("token_ids")


class InputsAhead:
    def __init__(self) -> None:
        self._kept: tuple[SchedulerOutput, BatchInputs, list] | None = None

    def prepare(self, ahead: tuple[SchedulerOutput, StepLayout] | None, block_size: int, device: torch.device,
                tables: BlockTableRows) -> None:
        """Micro-batch 0's inputs of `ahead` (the step scheduled ahead and its layout, or None),
        its tokens still placeholders; kept for `take`."""
        self._kept = None
        if ahead is None:
            return
        out, layout = ahead
        batch = layout.micro_batches[0]
        rows = batch.decode_sequences
        if batch.cohort_sequences or not rows or any(layout.num_tokens[i] != 1 for i in rows):
            return
        seqs = out.all_seqs
        tables.retain(seqs)  # as the step's start does: rows of requests gone may be let go
        self._kept = (out, prepare_rows(seqs, layout, rows, block_size, device, tables), [seqs[i] for i in rows])

    def take(self, model: MoEModel, out: SchedulerOutput, layout: StepLayout, device: torch.device
             ) -> MicroBatchState | None:
        """Micro-batch 0's state of step `out`, if it was prepared ahead: its tokens read now
        (each row's last, which the step before placed) and embedded. None: prepare it whole."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0] is not out:
            return None
        _, (_, positions, paged), rows = kept
        # A decode row's token is the one at its position: its sequence's length less one.
        tokens = list(map(getitem, map(_TOKEN_IDS, rows), [end - 1 for end in paged.seq_lens_host]))
        inputs = (torch.tensor(tokens, device=device), positions, paged)
        return MicroBatchState(layout.micro_batches[0], inputs, inputs, model.embed(inputs[0]), None)
