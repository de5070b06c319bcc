"""KV cache groups: which layers share a block table, for uniform and hybrid models."""

from __future__ import annotations

from transformers import Gemma3TextConfig

from cadence.models.kv_groups import KVCacheGroups, kv_cache_groups, kv_cache_groups_of, kv_capacity_tokens


def test_layers_that_all_see_the_same_context_form_one_group() -> None:
    assert kv_cache_groups([None] * 4) == KVCacheGroups((None,), ((0, 1, 2, 3),), 4)
    assert kv_cache_groups([512] * 3) == KVCacheGroups((512,), ((0, 1, 2),), 3)


def test_gemma3_270m_splits_into_one_global_group_and_five_sliding_ones_of_three_layers() -> None:
    config = Gemma3TextConfig(num_hidden_layers=18, sliding_window=512)  # every sixth layer is global
    groups = kv_cache_groups_of(config)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.group_size == 3
    assert groups.group_of_layer == [1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5, 0]
    assert groups.slot_of_layer == [0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2]


def test_without_the_hybrid_manager_every_layer_shares_one_table_that_keeps_every_block() -> None:
    groups = kv_cache_groups([16, None, 16], hybrid=False)
    assert groups == KVCacheGroups((None,), ((0, 1, 2),), 3)


def test_a_kind_whose_count_is_not_a_multiple_ends_with_a_short_group() -> None:
    groups = kv_cache_groups([8, 8, None, 8, 8, None, 8])
    assert groups == KVCacheGroups((None, 8, 8, 8), ((2, 5), (0, 1), (3, 4), (6,)), 2)


def test_the_capacity_is_what_every_group_holds_at_once() -> None:
    assert kv_capacity_tokens(num_blocks=13, block_size=16, num_groups=1) == 12 * 16
    assert kv_capacity_tokens(num_blocks=13, block_size=16, num_groups=6) == 2 * 16
