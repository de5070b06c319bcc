"""A step's layout from block tables: positions, where each request's tokens begin, and the KV slot
of every token in each group's padded block table."""

from __future__ import annotations

import torch

from cadence.executor.step_layout import step_layout


def test_positions_and_slots_follow_each_requests_blocks() -> None:
    # Request 0: a decode at position 5 (blocks 3, 7 of 4 tokens); request 1: three prompt tokens from
    # position 0 (block 2); two groups, the second with other blocks.
    block_ids = [[[3, 7], [9, 11]], [[2], [4]]]
    layout = step_layout(block_ids, [5, 0], [1, 3], block_size=4)
    assert layout.positions.tolist() == [5, 0, 1, 2]
    assert layout.query_start_loc.tolist() == [0, 1, 4]
    first, second = layout.layouts
    assert first.block_table.tolist() == [[3, 7], [2, 0]]  # padded with the null block
    assert first.slot_mapping.tolist() == [7 * 4 + 1, 8, 9, 10]
    assert second.block_table.tolist() == [[9, 11], [4, 0]]
    assert second.slot_mapping.tolist() == [11 * 4 + 1, 16, 17, 18]
    assert first.seq_lens.tolist() == [6, 3] and (first.max_query_len, first.max_seq_len) == (3, 6)


def test_a_step_of_one_token_each_has_the_same_layout() -> None:
    """Decodes only (built without the general form's arithmetic): the same values and dtypes as the
    general form gives the same requests beside a prefill."""
    block_ids = [[[3, 7], [9, 11]], [[2], [4]], [[5, 6, 8], [1, 12, 13]]]
    starts = [5, 3, 8]
    decodes = step_layout(block_ids, starts, [1, 1, 1], block_size=4)
    mixed = step_layout([*block_ids, [[10], [14]]], [*starts, 0], [1, 1, 1, 2], block_size=4)
    assert decodes.positions.tolist() == starts == mixed.positions.tolist()[:3]
    assert decodes.positions.dtype == mixed.positions.dtype
    assert decodes.query_start_loc.tolist() == [0, 1, 2, 3]
    assert decodes.query_start_loc.dtype == mixed.query_start_loc.dtype
    for alone, beside in zip(decodes.layouts, mixed.layouts, strict=True):
        for name in ("query_start_loc", "seq_lens", "slot_mapping"):
            got, general = getattr(alone, name), getattr(beside, name)
            assert got.dtype == general.dtype, name
            assert torch.equal(got, general[:len(got)]), name
        assert alone.block_table.dtype == beside.block_table.dtype
        assert torch.equal(alone.block_table, beside.block_table[:3])
        assert (alone.max_query_len, alone.max_seq_len) == (1, 9)
    assert decodes.layouts[1].slot_mapping.tolist() == [11 * 4 + 1, 4 * 4 + 3, 13 * 4]
