"""A step's layout from block tables: positions, where each request's tokens begin, and the KV slot
of every token in each group's padded block table."""

from __future__ import annotations

import numpy as np

from cadence.executor.step_layout import step_layout


def test_positions_and_slots_follow_each_requests_blocks() -> None:
    # Request 0: a decode at position 5 (blocks 3, 7 of 4 tokens); request 1: three prompt tokens from
    # position 0 (block 2); two groups, the second with other blocks.
    block_ids = [[[3, 7], [9, 11]], [[2], [4]]]
    layout = step_layout(block_ids, np.array([5, 0]), np.array([1, 3]), block_size=4)
    assert layout.positions.tolist() == [5, 0, 1, 2]
    assert layout.query_start_loc.tolist() == [0, 1, 4]
    first, second = layout.layouts
    assert first.block_table.tolist() == [[3, 7], [2, 0]]  # padded with the null block
    assert first.slot_mapping.tolist() == [7 * 4 + 1, 8, 9, 10]
    assert second.block_table.tolist() == [[9, 11], [4, 0]]
    assert second.slot_mapping.tolist() == [11 * 4 + 1, 16, 17, 18]
    assert first.seq_lens.tolist() == [6, 3] and (first.max_query_len, first.max_seq_len) == (3, 6)
