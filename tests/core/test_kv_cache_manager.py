"""Exact-value tests of the KV cache manager: KV cache groups over one pool (the Hypothesis
property in property_tests/test_sliding_window_allocator.py explores the rest)."""

from __future__ import annotations

import pytest

from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.kv_events import BlockRemoved, BlockStored
from cadence.core.testing import FakeRequest

BS = 4
GLOBAL_AND_SLIDING = (None, 4)  # group 0: global layers; group 1: layers with a window of 4


def admit(manager: KVCacheManager, req: FakeRequest) -> list[list[int]] | None:
    """The scheduler's handshake for a request holding no blocks; computes its whole prompt."""
    hit_ids, num_hit = manager.get_computed_blocks(req)
    new_ids = manager.allocate(req, req.num_tokens - num_hit, hit_ids, num_hit)
    if new_ids is not None:
        req.num_computed_tokens = req.num_tokens
    manager.check_integrity()
    return new_ids


def decode(manager: KVCacheManager, req: FakeRequest, token: int) -> list[list[int]] | None:
    req.all_token_ids.append(token)
    new_ids = manager.allocate(req, 1)
    req.num_computed_tokens += 1
    manager.check_integrity()
    return new_ids


def test_each_group_takes_its_own_blocks_and_a_sliding_one_gives_back_what_left_its_window() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=BS, windows=GLOBAL_AND_SLIDING)
    a = FakeRequest("a", list(range(8)))
    assert admit(manager, a) == [[1, 2], [3, 4]]
    assert manager.num_free_blocks == 4
    # The query at position 8 sees positions 5..8: the sliding group's first block (3) goes back,
    # to the free list's tail, before the new blocks are taken from its head.
    assert decode(manager, a, 8) == [[5], [6]]
    assert manager.block_ids("a") == [[1, 2, 5], [0, 4, 6]]
    assert manager.num_free_blocks == 3
    manager.free("a")
    assert manager.num_free_blocks == 8
    manager.check_integrity()


def test_an_allocation_is_all_or_nothing_over_the_groups() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS, windows=GLOBAL_AND_SLIDING)
    assert manager.capacity_tokens == 8  # 4 usable blocks, 2 groups holding all of theirs
    assert admit(manager, FakeRequest("a", list(range(12)))) is None  # 3 blocks in each group
    assert manager.num_free_blocks == 4
    assert manager.block_ids("a") == [[], []]
    assert admit(manager, FakeRequest("b", list(range(8)))) == [[1, 2], [3, 4]]


def test_a_prefix_hit_needs_only_the_blocks_in_the_sliding_groups_window() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=BS, windows=GLOBAL_AND_SLIDING)
    prompt = list(range(16))
    a = FakeRequest("a", list(prompt))
    assert admit(manager, a) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # Decoding releases the sliding group's blocks 5, 6, 7 (still cached) to the free list's tail.
    assert decode(manager, a, 99) == [[9], [10]]
    # b takes 11 and 5 from the head: the sliding group's first block of the prompt is evicted.
    assert admit(manager, FakeRequest("b", [100, 101, 102, 103])) == [[11], [5]]
    # A request with a's prompt hits all four blocks: the global group holds them all, and the query
    # at position 16 sees only positions 13..16 (block 3, id 8) in the sliding group.
    c = FakeRequest("c", [*prompt, 7])
    hit_ids, num_hit = manager.get_computed_blocks(c)
    assert (hit_ids, num_hit) == ([[1, 2, 3, 4], [0, 0, 0, 8]], 16)
    assert manager.allocate(c, 1, hit_ids, num_hit) == [[6], [7]]
    assert manager.block_ids("c") == [[1, 2, 3, 4, 6], [0, 0, 0, 8, 7]]
    manager.check_integrity()
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (16 + 4 + 17, 16)


def test_a_hit_is_as_long_as_the_shortest_group_holds() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=BS, windows=GLOBAL_AND_SLIDING)
    prompt = list(range(16))
    a = FakeRequest("a", list(prompt))
    admit(manager, a)
    manager.free("a")
    # A request over 2 of a's blocks and then others: both groups hold those 2.
    b = FakeRequest("b", [*prompt[:8], 50, 51, 52, 53, 54])
    assert manager.get_computed_blocks(b) == ([[1, 2], [0, 6]], 8)


def test_kv_events_speak_for_the_first_group_only() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS, enable_kv_events=True, windows=GLOBAL_AND_SLIDING)
    admit(manager, FakeRequest("a", list(range(8))))
    (stored,) = manager.take_events()  # the sliding group's two blocks are not announced
    assert isinstance(stored, BlockStored)
    assert (len(stored.block_hashes), stored.token_ids) == (2, list(range(8)))
    manager.free("a")
    admit(manager, FakeRequest("b", [9, 9, 9, 9, 9, 9, 9, 9]))  # evicts every block of both groups
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2


def test_grow_takes_and_caches_a_running_requests_blocks_all_or_nothing() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    a = FakeRequest("a", list(range(6)))
    assert admit(manager, a) == [[1, 2]] and manager.num_free_blocks == 2
    a.all_token_ids += [6, 7, 8, 9, 10]
    # Slots up to 8 fill block 2 (cached now); up to 9 take one block; up to 17 would need two more.
    assert manager.grow(a, 8) == [[]] and manager.grow(a, 9) == [[3]]
    assert manager.grow(a, 17) is None and manager.block_ids("a") == [[1, 2, 3]] and manager.num_free_blocks == 1
    b = FakeRequest("b", [*range(8), 99])
    assert manager.get_computed_blocks(b)[1] == 8  # both of a's full blocks are in the prefix cache
    manager.check_integrity()
    two_groups = KVCacheManager(num_blocks=9, block_size=BS, windows=GLOBAL_AND_SLIDING)
    admit(two_groups, c := FakeRequest("c", list(range(6))))
    with pytest.raises(ValueError, match="one KV cache group"):
        two_groups.grow(c, 8)
