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


def step_layout(block_ids: Sequence[Sequence[list[int]]], starts: np.ndarray, counts: np.ndarray,
                block_size: int) -> StepLayout:
    """The layout of a step where request ``i`` computes ``counts[i]`` tokens from position
    ``starts[i]``, its KV in the blocks ``block_ids[i][group]`` of each group.

    Block tables are padded with the null block (0).
    """
    num_reqs = len(counts)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    seq_lens = starts + counts
    # Positions run from each request's first new token to its last.
    positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - np.repeat(query_start_loc[:-1] - starts, counts)
    query_start = torch.from_numpy(query_start_loc.astype(np.int32))
    lens = torch.from_numpy(seq_lens.astype(np.int32))
    max_query_len, max_seq_len = int(counts.max()), int(seq_lens.max())
    req_index = np.repeat(np.arange(num_reqs), counts)
    block_index, offsets = positions // block_size, positions % block_size
    layouts = []
    for group in range(len(block_ids[0])):
        width = max(1, max(len(ids[group]) for ids in block_ids))
        block_table = np.zeros((num_reqs, width), dtype=np.int32)
        for i, ids in enumerate(block_ids):
            block_table[i, :len(ids[group])] = ids[group]
        slot_mapping = block_table[req_index, block_index].astype(np.int64) * block_size + offsets
        layouts.append(BatchLayout(query_start, lens, torch.from_numpy(block_table), torch.from_numpy(slot_mapping),
                                   max_query_len, max_seq_len))
    return StepLayout(positions, query_start_loc, layouts)
