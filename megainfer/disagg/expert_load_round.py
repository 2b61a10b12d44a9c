"""The load round: once per step, each expert node tells every attention rank how many (token,
expert) pairs it computed for each expert of each layer in that step.

MegaScale-Infer re-places experts from the load the expert nodes take. Counting it where the
pairs are computed makes it router-independent (a routing or slot-map fault shows as counts
that disagree with the gating kernel's, never as a plan built on them), and every attention
rank then holds the whole deployment's load: the expert nodes see every attention node's tokens.

It is the step's last round in the expert-to-attention direction, sent right after the last
answers (the host has waited for their copies, so the device counters are final):

    header  layer LOAD_LAYER (past any model's layers), micro_batch 0, token count: the entries,
            flags PREFILL when some attention node's step carried prompt tokens (its dispatches
            say so with the same flag; a step counts as prefill when any of the deployment's do,
            the window's rule per engine, expert_load_window.py)
    payload one entry per (layer, row) of the node's room, int32 pairs (layer x experts +
            expert, pairs computed in the step); a row holding no expert is (0, 0)

So a node's round is layers x room x 8 bytes (Qwen3-235B on 32 nodes: 94 x 4 rows, 3 KiB), not
a count for every expert of the model; the attention rank adds every node's entries into the
[layers, experts] counts with one `bincount`. The counts come from the expert layers' device
counters (`ExpertLayer.row_pairs`, one [layers, room] tensor per node): one read per step.
"""

from __future__ import annotations

import numpy as np
import torch

from megainfer.disagg.expert_link import FLAGS, LAYER, STEP, ExpertLink
from megainfer.disagg.staging_sizes import LOAD_ENTRY_BYTES
from megainfer.errors import DataPlaneError
from megainfer.runner.model_runner import ExpertNodeLoad

LOAD_LAYER = 0xFFFF  # the load round's header layer: no model has this many
PREFILL = 2  # header flag: on a dispatch, its step carries prompt tokens; on a load round, some node's did


class ServedPairs:
    """An expert node's pairs per (layer, row) step by step, from its layers' device counters.
    The counters only grow (they are captured into CUDA graphs, so nothing resets them while
    serving); a step's counts are the difference from the last read."""

    def __init__(self, num_layers: int, room: int, num_experts: int, device: torch.device) -> None:
        self.counters = torch.zeros(num_layers, room, dtype=torch.int64, device=device)
        self.num_experts = num_experts
        self._last = np.zeros((num_layers, room), dtype=np.int64)
        # The last step's entries, sent from here: [layers x room, 2] int32 (cell, pairs).
        self.report = np.zeros((num_layers * room, 2), dtype=np.int32)
        self._version: int | None = None  # the placement the cells in `report` name
        self._empty = np.zeros(num_layers * room, dtype=bool)  # rows holding no expert

    def row_view(self, layer: int, room: int) -> torch.Tensor:
        """Layer `layer`'s counters, one per row of its `room` (ExpertLayer's `row_pairs`)."""
        return self.counters[layer, :room]

    def restart(self) -> None:
        """Count from zero: after loading, whose warm-up, profile and capture ran the layers."""
        self.counters.zero_()
        self._last[:] = 0

    def step_counts(self, held: list[list[int]], version: int) -> np.ndarray:
        """The pairs of each (layer, row) since the last call, as `report`'s entries. `held[layer]`:
        the expert of each row that layer holds under placement `version`, the one that served
        since the last call (a re-placement switches at a step's start)."""
        now = self.counters.cpu().numpy()
        delta = now - self._last
        self._last = now.copy()  # on the CPU `now` shares the counters' memory
        if version != self._version:
            self._version = version
            room = self.counters.shape[1]
            cells = np.zeros((len(held), room), dtype=np.int64)
            self._empty = np.ones((len(held), room), dtype=bool)
            for layer, experts in enumerate(held):
                cells[layer, :len(experts)] = layer * self.num_experts + np.asarray(experts, dtype=np.int64)
                self._empty[layer, :len(experts)] = False
            self._empty = self._empty.reshape(-1)
            self.report[:, 0] = np.where(self._empty, 0, cells.reshape(-1))
        self.report[:, 1] = np.where(self._empty, 0, delta.reshape(-1))
        return self.report

    def per_layer(self) -> list[int]:
        """Pairs each layer computed since the counters last restarted (a node's health)."""
        return self.counters.sum(dim=1).tolist()


def post_load(link: ExpertLink, peers: tuple[str, ...], report: np.ndarray, *, step: int, prefill: bool) -> None:
    """An expert node's load round: `report` ([entries, 2] int32) to every attention rank."""
    payload = torch.from_numpy(report.reshape(-1))
    n = len(peers)
    link.post_round(peers, payload, np.zeros(n, dtype=np.int64), np.full(n, report.nbytes, dtype=np.int64),
                    np.full(n, len(report), dtype=np.int64), step=step, layer=LOAD_LAYER, micro_batch=0,
                    flags=PREFILL if prefill else 0)


class LoadRound:
    """An attention rank's side: every expert node's load round of a step, collected and added
    up into the deployment's counts. The gather buffer grows to the largest round once."""

    def __init__(self, peers: tuple[str, ...], num_layers: int, num_experts: int) -> None:
        self.peers = peers
        self.num_layers, self.num_experts = num_layers, num_experts
        self._gathered = np.zeros(0, dtype=np.int32)
        self._rooms: tuple[int, ...] = ()  # each node's entries `_index` was built for
        self._index = np.zeros(0, dtype=np.int64)

    def collect(self, link: ExpertLink, step: int) -> ExpertNodeLoad:
        """After step `step`'s last answers: every expert node's load round, added up."""
        try:
            arrivals = link.collect_round(self.peers, micro_batch=0)
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"the expert nodes sent no load round (step {step}): {exc}") from exc
        try:
            k = arrivals.mismatch(step, LOAD_LAYER, LOAD_ENTRY_BYTES)
            if k >= 0:
                fields = arrivals.fields
                raise DataPlaneError(
                    f"expert node {self.peers[k]} sent (step {fields[k, STEP]}, layer {fields[k, LAYER]}, "
                    f"{arrivals.byte_lengths[k]} bytes for {arrivals.token_counts[k]} entries) where step {step}'s "
                    f"load round (layer {LOAD_LAYER}, {LOAD_ENTRY_BYTES} bytes an entry) was due: the nodes are "
                    "out of step")
            entries = arrivals.token_counts.copy()  # the arrivals' fields are reused by the next round
            words = 2 * int(entries.sum())  # int32 (cell, pairs) per entry
            if words > len(self._gathered):
                self._gathered = np.zeros(words, dtype=np.int32)
            arrivals.gather_into(self._gathered)
            prefill = bool((arrivals.fields[:, FLAGS] & PREFILL).any())
        finally:
            arrivals.release()
        return self._added_up(self._gathered[:words].reshape(-1, 2), entries, prefill)

    def _added_up(self, pairs: np.ndarray, entries: np.ndarray, prefill: bool) -> ExpertNodeLoad:
        """Every node's entries into the [layers, experts] counts and each node's pairs per layer."""
        cells, counts = pairs[:, 0], pairs[:, 1]
        size = self.num_layers * self.num_experts
        if len(cells) and (cells.min() < 0 or cells.max() >= size):
            raise DataPlaneError(f"an expert node's load round names (layer, expert) cell {int(cells.max())} of "
                                 f"{size}: it serves another model")
        per_expert = np.bincount(cells, weights=counts, minlength=size).astype(np.int64)
        per_node = np.bincount(self._node_layer(entries), weights=counts,
                               minlength=len(entries) * self.num_layers).astype(np.int64)
        return ExpertNodeLoad(per_expert.reshape(self.num_layers, self.num_experts),
                              per_node.reshape(len(entries), self.num_layers).T.copy(), prefill)

    def _node_layer(self, entries: np.ndarray) -> np.ndarray:
        """node x layers + layer of every entry: a node's entries are its room's rows, layer by
        layer (`ServedPairs.report`). Built once per set of rooms."""
        key = tuple(entries.tolist())
        if key != self._rooms:
            if any(n % self.num_layers for n in key):
                raise DataPlaneError(f"the expert nodes' load rounds hold {list(key)} entries: not whole rooms of "
                                     f"{self.num_layers} layers (a node of another model)")
            self._index = np.concatenate([k * self.num_layers + np.arange(n) // (n // self.num_layers) if n else
                                          np.zeros(0, dtype=np.int64) for k, n in enumerate(key)])
            self._rooms = key
        return self._index
