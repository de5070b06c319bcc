"""Many LoRA adapters in one batch: each adapted layer holds ``max_loras`` slots of adapter weights,
and a step's rows run through their own slot's.

A layer fused from ``P`` checkpoint projections (q/k/v: 3, gate/up: 2, o and down: 1) keeps

- ``a``: ``[slots * P * R, in]``, slot ``s`` part ``p``'s ``A`` in rows ``(s * P + p) * R`` on;
- ``b``: ``[out, slots * P * R]``, the same columns holding ``B`` (scaled) in part ``p``'s output rows,

where ``R`` is ``--max-lora-rank`` (a smaller rank leaves zero rows and columns). A step runs one of
three ways (:class:`LoRABatch` picks):

- **masked**, for a small step (decodes): ``out += ((x @ a.T) * mask) @ b.T`` with ``mask[t]`` one
  over row ``t``'s slot's columns (zero for a base-model row): two GEMMs and a multiply per layer
  whatever the mix of adapters. Its GEMMs are ``slots`` times wider than one adapter needs, which
  costs nothing much at a few dozen rows, where a GEMM's cost is mostly its call. The model's C++
  decoder stack runs this way too (``Linear.apply``), from the weights :attr:`LoRASlots.packed`
  gives it and the step's :meth:`LoRABatch.masks`.
- **one adapter**, for a small step whose every row runs with the same adapter (one user; a batch
  on one adapter): that slot's ``A`` and ``B`` alone, no mask: a quarter of the masked way's work
  with four slots, and one op fewer (one user's decode step of SmolLM2 with 4 slots of rank 16:
  the masked way's LoRA products take ~2.7 ms, this ~1.8 ms). The C++ stack runs it too.
- **segmented**, for a large step (prefill chunks): the model runner puts each adapter's rows
  together, and each adapter's rows run through its own slot only (``out[rows] += x[rows] @ a_s.T
  @ b_s.T``, on views, each part's ``B`` alone): a GEMM per adapter and one per part, of the work
  one adapter needs.

Under tensor parallelism a column-parallel layer holds its rows of ``B`` and all of ``A``; a
row-parallel one its columns of ``A`` and all of ``B``, and its partial deltas sum in the all-reduce
with the partial products.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from cadence.backends.dense_gemm import prepacked
from cadence.distributed.layers import linear
from cadence.lora.adapter import LoRAWeights

# Rows from which a step runs segmented. Measured on SmolLM2 (bf16, 2 threads, 4 slots of rank 16):
# masked, a layer's four LoRA products take ~0.35 ms at 64 rows and ~7 ms at 2,048; segmented, four
# adapters' calls cost more at 64 rows and a quarter of the work at 2,048; they cross near 256.
SEGMENTED_ROWS = 256


class LoRABatch:
    """How the step's rows map to adapter slots: masks for the masked way, row ranges for the
    segmented way (see the module's docstring), or nothing when no row uses an adapter."""

    def __init__(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.segments: list[tuple[int, int, int]] | None = None  # (slot, first row, end row)
        self.only_slot = -1  # the slot of every row of a small step all on one adapter; -1: none such
        self._one_hot: torch.Tensor | None = None  # [T, slots]
        self._masks: dict[int, torch.Tensor] = {}  # by part count: [T, slots * parts * R]

    def set(self, row_slots: np.ndarray | None) -> None:
        """The step's rows' slots ``[T]`` (-1: the base model), or None when no row uses an adapter."""
        self.segments, self.only_slot, self._one_hot, self._masks = None, -1, None, {}
        if row_slots is None:
            return
        if len(row_slots) < SEGMENTED_ROWS and row_slots[0] >= 0 and (row_slots == row_slots[0]).all():
            self.only_slot = int(row_slots[0])
            return
        if len(row_slots) >= SEGMENTED_ROWS:
            edges = [0, *(np.flatnonzero(np.diff(row_slots)) + 1).tolist(), len(row_slots)]
            runs = [(int(row_slots[i]), i, j) for i, j in itertools.pairwise(edges) if row_slots[i] >= 0]
            if len(runs) <= self.num_slots:  # each adapter's rows together (the runner groups them)
                self.segments = runs
                return
        slots = torch.from_numpy(row_slots).to(self.device)
        one_hot = torch.zeros(len(row_slots), self.num_slots + 1, dtype=self.dtype, device=self.device)
        one_hot[torch.arange(len(row_slots), device=self.device), slots + 1] = 1
        self._one_hot = one_hot[:, 1:]

    def masks(self) -> list[torch.Tensor]:
        """The masks of layers of 1, 2 and 3 parts (the C++ decoder stack's), or none."""
        masks = [self.mask(parts) for parts in (1, 2, 3)]
        return [m for m in masks if m is not None]

    def mask(self, num_parts: int) -> torch.Tensor | None:
        if self._one_hot is None:
            return None
        mask = self._masks.get(num_parts)
        if mask is None:
            mask = self._masks[num_parts] = self._one_hot.repeat_interleave(num_parts * self.max_rank, dim=1)
        return mask


class LoRASlots:
    """One layer's adapter slots; called by the layer (its ``lora`` hook) with its input and output."""

    def __init__(self, batch: LoRABatch, in_features: int, out_sizes: Sequence[int]) -> None:
        self.batch = batch
        self.num_parts = len(out_sizes)
        self.out_offsets = [0, *itertools.accumulate(out_sizes)]
        self.width = self.num_parts * batch.max_rank  # one slot's columns
        columns = batch.num_slots * self.width
        self.a = torch.zeros(columns, in_features, dtype=batch.dtype, device=batch.device)
        self.b = torch.zeros(self.out_offsets[-1], columns, dtype=batch.dtype, device=batch.device)
        # What the GEMMs read: all slots, and each slot's A, packed for cadence's bf16 GEMM (or
        # oneDNN's) where the model's own weights are: oneDNN reorders a plain bf16 weight on every
        # call, which for these small matrices costs more than the product (a batch-64 decode step of
        # SmolLM2 with 4 slots of rank 16: 14 ms of LoRA products plain, 10 ms packed). Each slot's
        # parts of B stay plain, for addmm_ to accumulate into the output in place.
        self._a, self._b = prepacked(self.a), prepacked(self.b)
        self._slot_a = [self._a] * batch.num_slots
        self._slot_b: list[list[torch.Tensor]] = [[]] * batch.num_slots  # per part
        self._slot_b_whole = [self._b] * batch.num_slots  # every part's columns (one adapter's way)
        for slot in range(batch.num_slots):
            self._pack_slot(slot)

    @property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """All slots' ``a`` and ``b``, and each slot's, as the masked and the one-adapter ways run them
        (the C++ decoder stack too)."""
        return self._a, self._b, self._slot_a, self._slot_b_whole

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        segments = self.batch.segments
        if segments is not None:
            rank, offsets = self.batch.max_rank, self.out_offsets
            for slot, first, end in segments:
                shrunk = linear(x[first:end], self._slot_a[slot], None, self.width)
                # Each part's B alone (no zero blocks), accumulated in place: one pass over the output.
                for part, b in enumerate(self._slot_b[slot]):
                    columns = shrunk[:, part * rank:(part + 1) * rank]
                    out[first:end, offsets[part]:offsets[part + 1]].addmm_(columns, b.t())
            return out
        slot = self.batch.only_slot
        if slot >= 0:
            shrunk = linear(x, self._slot_a[slot], None, self.width)
            return out.add_(linear(shrunk, self._slot_b_whole[slot], None, self.b.shape[0]))
        mask = self.batch.mask(self.num_parts)
        if mask is None:
            return out
        shrunk = linear(x, self._a, None, self.a.shape[0]).mul_(mask)
        return out.add_(linear(shrunk, self._b, None, self.b.shape[0]))

    def load(self, slot: int, parts: Sequence[LoRAWeights | None]) -> None:
        """Put an adapter's weights for each part (None: the adapter leaves that part alone) in ``slot``."""
        start = slot * self.width
        with torch.no_grad():
            self.a[start:start + self.width].zero_()
            self.b[:, start:start + self.width].zero_()
            for part, weights in enumerate(parts):
                if weights is None:
                    continue
                rank, column = weights.a.shape[0], start + part * self.batch.max_rank
                self.a[column:column + rank] = weights.a
                self.b[self.out_offsets[part]:self.out_offsets[part + 1], column:column + rank] = weights.b
        self._a, self._b = prepacked(self.a), prepacked(self.b)
        self._pack_slot(slot)

    def _pack_slot(self, slot: int) -> None:
        start, rank, offsets = slot * self.width, self.batch.max_rank, self.out_offsets
        self._slot_a[slot] = prepacked(self.a[start:start + self.width].contiguous())
        self._slot_b_whole[slot] = prepacked(self.b[:, start:start + self.width].contiguous())
        self._slot_b[slot] = [self.b[offsets[p]:offsets[p + 1], start + p * rank:start + (p + 1) * rank].contiguous()
                              for p in range(self.num_parts)]
