"""A step's token positions and per-group batch layouts, from each request's block tables, first new
position and number of new tokens: built alike for the model runner's steps and the draft model's
(``executor/draft_model.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cadence.backends.base import BatchLayout


@dataclass(frozen=True)
class StepLayout:
    positions: np.ndarray  # [T] int64: each token's position in its sequence
    query_start_loc: np.ndarray  # [B + 1] int64: where each request's tokens begin in the step
    layouts: list[BatchLayout]  # one per KV cache group


def step_layout(block_ids: Sequence[Sequence[list[int]]], starts: list[int], counts: list[int],
                block_size: int) -> StepLayout:
    """The layout of a step where request ``i`` computes ``counts[i]`` tokens from position
    ``starts[i]``, its KV in the blocks ``block_ids[i][group]`` of each group.

    Block tables are padded with the null block (0).
    """
    if max(counts) == 1:
        return _one_token_each(block_ids, starts, block_size)
    num_reqs = len(counts)
    counts_array, starts_array = np.array(counts, dtype=np.int64), np.array(starts, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts_array, out=query_start_loc[1:])
    seq_lens = starts_array + counts_array
    # Positions run from each request's first new token to its last.
    positions = (np.arange(int(query_start_loc[-1]), dtype=np.int64)
                 - np.repeat(query_start_loc[:-1] - starts_array, counts_array))
    query_start = torch.from_numpy(query_start_loc.astype(np.int32))
    lens = torch.from_numpy(seq_lens.astype(np.int32))
    max_query_len, max_seq_len = max(counts), int(seq_lens.max())
    req_index = np.repeat(np.arange(num_reqs), counts_array)
    block_index, offsets = positions // block_size, positions % block_size
    layouts = []
    for group in range(len(block_ids[0])):
        block_table = _block_table([ids[group] for ids in block_ids])
        slot_mapping = block_table[req_index, block_index].astype(np.int64) * block_size + offsets
        layouts.append(BatchLayout(query_start, lens, torch.from_numpy(block_table), torch.from_numpy(slot_mapping),
                                   max_query_len, max_seq_len))
    return StepLayout(positions, query_start_loc, layouts)


def _one_token_each(block_ids: Sequence[Sequence[list[int]]], positions: list[int], block_size: int) -> StepLayout:
    """:func:`step_layout` of a step where every request computes one token (decodes): its values from
    the lists directly. At batch 1 the general form's two dozen numpy and torch calls, each paid after
    a forward has flushed the caches, cost a third of a millisecond a token (docs/performance.md, "A
    step of decodes only")."""
    num_reqs = len(positions)
    query_start = torch.arange(num_reqs + 1, dtype=torch.int32)
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
    max_seq_len = max(positions) + 1
    layouts = []
    for group in range(len(block_ids[0])):
        tables = [ids[group] for ids in block_ids]
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, p in zip(tables, positions, strict=True)]
        layouts.append(BatchLayout(query_start, lens, torch.from_numpy(_block_table(tables)),
                                   torch.tensor(slots, dtype=torch.int64), 1, max_seq_len))
    return StepLayout(np.array(positions, dtype=np.int64), np.arange(num_reqs + 1, dtype=np.int64), layouts)


def _block_table(tables: list[list[int]]) -> np.ndarray:
    """``[B, longest]`` int32: each request's blocks, padded with the null block (0)."""
    block_table = np.zeros((len(tables), max(1, max(map(len, tables)))), dtype=np.int32)
    for i, table in enumerate(tables):
        block_table[i, :len(table)] = table
    return block_table
