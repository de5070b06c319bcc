"""Exact-value tests of the KV block allocator (the state machine in property_tests/ explores the rest)."""

from __future__ import annotations

import pytest

from cadence.core.block_hash import hash_block
from cadence.core.kv_allocator import KVAllocator
from cadence.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.testing import FakeRequest


def admit(alloc: KVAllocator, req: FakeRequest, num_new: int | None = None) -> list[int] | None:
    """The scheduler's handshake for a request holding no blocks; computes what it schedules."""
    hit_ids, num_hit = alloc.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    new_ids = alloc.allocate(req, num_new, hit_ids, num_hit)
    if new_ids is not None:
        req.num_computed_tokens += num_hit + num_new
    alloc.check_integrity()
    return new_ids


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    alloc = KVAllocator(num_blocks=5, block_size=4)
    assert alloc.num_free_blocks == 4
    assert alloc.usage == 0.0
    assert admit(alloc, FakeRequest("a", tokens(1, 16))) == [1, 2, 3, 4]
    assert alloc.num_free_blocks == 0
    assert alloc.usage == 1.0
    assert admit(alloc, FakeRequest("b", [7])) is None
    assert 0 not in alloc.block_ids("a")
    alloc.check_integrity()


def test_free_releases_in_reverse_to_the_tail():
    alloc = KVAllocator(num_blocks=9, block_size=4)
    assert admit(alloc, FakeRequest("a", tokens(1, 8))) == [1, 2]
    assert admit(alloc, FakeRequest("b", tokens(11, 10))) == [3, 4, 5]
    alloc.free("a")
    assert alloc.free_block_ids() == [6, 7, 8, 2, 1]
    alloc.free("b")
    assert alloc.free_block_ids() == [6, 7, 8, 2, 1, 5, 4, 3]
    assert alloc.block_ids("a") == []
    alloc.check_integrity()


def test_lru_eviction_takes_the_head_first_and_evicts_chain_tails_before_prefixes():
    alloc = KVAllocator(num_blocks=9, block_size=4)
    a, b = FakeRequest("a", tokens(1, 8)), FakeRequest("b", tokens(11, 8))
    admit(alloc, a)
    admit(alloc, b)
    alloc.free("a")
    alloc.free("b")
    # Free list: [5, 6, 7, 8, 2, 1, 4, 3]; five blocks evict a's tail (2) but not its head (1).
    assert admit(alloc, FakeRequest("c", tokens(21, 20))) == [5, 6, 7, 8, 2]
    assert alloc.get_computed_blocks(FakeRequest("a2", [*tokens(1, 8), 0])) == ([1], 4)
    assert alloc.get_computed_blocks(FakeRequest("b2", [*tokens(11, 8), 0])) == ([3, 4], 8)


def test_hit_is_capped_so_the_last_token_is_computed():
    alloc = KVAllocator(num_blocks=10, block_size=4)
    admit(alloc, FakeRequest("a", tokens(1, 12)))
    alloc.free("a")
    # Exactly three full blocks match, but the last token must still be computed.
    assert alloc.get_computed_blocks(FakeRequest("b", tokens(1, 12))) == ([1, 2], 8)
    assert alloc.get_computed_blocks(FakeRequest("c", tokens(1, 13))) == ([1, 2, 3], 12)
    assert alloc.get_computed_blocks(FakeRequest("d", tokens(1, 9))) == ([1, 2], 8)
    assert alloc.get_computed_blocks(FakeRequest("e", tokens(1, 4))) == ([], 0)
    assert alloc.get_computed_blocks(FakeRequest("f", [1])) == ([], 0)


def test_hit_shares_live_blocks_and_takes_free_ones_from_the_middle_of_the_list():
    alloc = KVAllocator(num_blocks=10, block_size=4)
    a = FakeRequest("a", tokens(1, 10))
    admit(alloc, a)  # [1, 2, 3]; 1 and 2 full and cached
    b = FakeRequest("b", [*tokens(1, 8), 40, 41])
    assert admit(alloc, b) == [4]
    assert alloc.block_ids("b") == [1, 2, 4]
    assert b.num_computed_tokens == 10
    alloc.free("a")
    assert alloc.free_block_ids() == [5, 6, 7, 8, 9, 3]  # 1 and 2 are still held by b
    alloc.free("b")
    assert alloc.free_block_ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    c = FakeRequest("c", [*tokens(1, 4), 50])
    assert admit(alloc, c) == [5]
    assert alloc.block_ids("c") == [1, 5]
    assert alloc.free_block_ids() == [6, 7, 8, 9, 3, 4, 2]


def test_allocate_is_all_or_nothing_counting_free_hit_blocks():
    alloc = KVAllocator(num_blocks=6, block_size=4)
    admit(alloc, FakeRequest("a", tokens(1, 12)))  # [1, 2, 3]
    alloc.free("a")
    admit(alloc, FakeRequest("d", tokens(31, 8)))  # [4, 5]
    assert alloc.free_block_ids() == [3, 2, 1]
    b = FakeRequest("b", tokens(1, 17))
    hit_ids, num_hit = alloc.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2, 3], 12)
    # 2 new blocks fit in 3 free ones, but taking the 3 free hit blocks leaves none for them.
    assert alloc.allocate(b, 5, hit_ids, num_hit) is None
    assert alloc.free_block_ids() == [3, 2, 1]
    assert alloc.block_ids("b") == []
    assert alloc.get_computed_blocks(b) == ([1, 2, 3], 12)
    alloc.check_integrity()
    alloc.free("d")
    hit_ids, num_hit = alloc.get_computed_blocks(b)
    assert alloc.allocate(b, 5, hit_ids, num_hit) == [5, 4]
    assert alloc.block_ids("b") == [1, 2, 3, 5, 4]
    alloc.check_integrity()


def test_running_request_allocation_fails_whole():
    alloc = KVAllocator(num_blocks=4, block_size=2)
    a = FakeRequest("a", tokens(1, 4))
    admit(alloc, a)
    assert alloc.allocate(a, 4) is None  # needs 2 more blocks, 1 free
    assert alloc.block_ids("a") == [1, 2]
    assert alloc.allocate(a, 2) == [3]


def test_hash_chains_the_parent():
    root = hash_block(None, (5, 6, 7, 8))
    other_parent = hash_block(hash_block(None, (9, 9, 9, 9)), (5, 6, 7, 8))
    assert root != other_parent
    assert hash_block(None, [5, 6, 7, 8]) == root  # list or tuple alike
    assert hash_block(None, (5, 6, 7, 8), ("salt",)) != root
    assert isinstance(root, int) and 0 <= root < 2**64


def test_same_tokens_after_a_different_prefix_do_not_hit():
    alloc = KVAllocator(num_blocks=12, block_size=4, enable_kv_events=True)
    admit(alloc, FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    alloc.take_events()
    # b's second block has a's second block's tokens, after another first block.
    b = FakeRequest("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert alloc.get_computed_blocks(b) == ([], 0)
    assert admit(alloc, b) == [4, 5, 6]
    [stored] = alloc.take_events()
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 2  # stored, not deduplicated against a's block 2
    assert alloc.get_computed_blocks(FakeRequest("c", [1, 2, 3, 4, 5, 6, 7, 8, 1])) == ([1, 2], 8)


def test_the_same_tokens_under_another_salt_do_not_hit():
    """A LoRA adapter's blocks (salted with it) are never another adapter's or the base model's."""
    alloc = KVAllocator(num_blocks=12, block_size=4)
    admit(alloc, FakeRequest("a", tokens(1, 9), cache_salt="lora:1:a"))
    assert alloc.get_computed_blocks(FakeRequest("base", tokens(1, 9))) == ([], 0)
    assert alloc.get_computed_blocks(FakeRequest("b", tokens(1, 9), cache_salt="lora:2:b")) == ([], 0)
    assert alloc.get_computed_blocks(FakeRequest("a2", tokens(1, 9), cache_salt="lora:1:a")) == ([1, 2], 8)
    admit(alloc, FakeRequest("base2", tokens(1, 9)))
    assert alloc.get_computed_blocks(FakeRequest("base3", tokens(1, 9))) == ([4, 5], 8)


def test_duplicate_block_keeps_the_existing_mapping():
    alloc = KVAllocator(num_blocks=8, block_size=4, enable_kv_events=True)
    a, b = FakeRequest("a", tokens(1, 5)), FakeRequest("b", tokens(1, 5))
    assert alloc.get_computed_blocks(b) == ([], 0)  # looked up before a is cached
    admit(alloc, a)  # [1, 2]
    assert alloc.allocate(b, 5) == [3, 4]
    h1 = hash_block(None, tokens(1, 4))
    assert alloc.take_events() == [BlockStored([h1], None, tokens(1, 4), 4)]
    assert alloc.get_computed_blocks(FakeRequest("c", tokens(1, 5))) == ([1], 4)
    alloc.check_integrity()
    alloc.free("a")
    alloc.free("b")
    # Free list [5, 6, 7, 2, 1, 4, 3]: reusing 5 blocks evicts block 1 (the mapped one).
    admit(alloc, FakeRequest("d", tokens(100, 20)))
    assert alloc.take_events()[0] == BlockRemoved([h1])
    # Block 3 holds the same tokens but was never registered: no hit.
    assert alloc.get_computed_blocks(FakeRequest("c", tokens(1, 5))) == ([], 0)


def test_decode_registers_a_block_when_it_fills():
    alloc = KVAllocator(num_blocks=8, block_size=4, enable_kv_events=True)
    req = FakeRequest("a", [1, 2, 3])
    assert admit(alloc, req) == [1]
    assert alloc.take_events() == []
    req.all_token_ids.append(4)
    assert alloc.allocate(req, 1) == []
    req.num_computed_tokens += 1
    assert alloc.take_events() == [BlockStored([hash_block(None, (1, 2, 3, 4))], None, [1, 2, 3, 4], 4)]
    req.all_token_ids.append(5)
    assert alloc.allocate(req, 1) == [2]
    alloc.check_integrity()


def _two_decoding(prompt_b: list[int]) -> tuple[KVAllocator, FakeRequest, FakeRequest]:
    """Requests a (3 tokens) and b, each holding its blocks, then 6 more tokens each (a decode run's)."""
    alloc = KVAllocator(num_blocks=10, block_size=4)
    a, b = FakeRequest("a", tokens(1, 3)), FakeRequest("b", prompt_b)
    admit(alloc, a)
    admit(alloc, b)
    for req in (a, b):
        req.all_token_ids.extend([7] * 6)
    return alloc, a, b


def test_grow_unordered_leaves_what_the_grow_calls_in_the_steps_order_leave():
    one_by_one, a, b = _two_decoding(tokens(50, 6))
    # a fills its first block at 4 tokens and takes one at 5 and 9; b fills at 8 and 12 and takes at 9.
    for req, num in ((a, 4), (a, 5), (b, 8), (a, 9), (b, 9), (b, 12)):
        one_by_one.grow(req, num)
    in_one_go, c, d = _two_decoding(tokens(50, 6))
    assert in_one_go.grow_unordered([c, d], [0, 0, 1], [9, 12])
    one_by_one.check_integrity()
    in_one_go.check_integrity()
    assert [in_one_go.block_ids(r) for r in "ab"] == [one_by_one.block_ids(r) for r in "ab"] == [[1, 4, 5], [2, 3, 6]]
    assert in_one_go.free_block_ids() == one_by_one.free_block_ids()
    for alloc in (one_by_one, in_one_go):  # a's first two blocks are full and cached, b's three
        assert alloc.get_computed_blocks(FakeRequest("e", [1, 2, 3, *[7] * 6])) == ([1, 4], 8)
        assert alloc.get_computed_blocks(FakeRequest("f", [*tokens(50, 6), *[7] * 7])) == ([2, 3, 6], 12)


def test_grow_unordered_refuses_where_the_order_matters_and_takes_nothing():
    twins, a, b = _two_decoding(tokens(1, 3))  # the same tokens: both would offer the same two hashes
    cached, c, d = _two_decoding(tokens(50, 6))
    admit(cached, FakeRequest("e", [1, 2, 3, 7, 7]))  # caches the block that c would fill
    for alloc, requests in ((twins, [a, b]), (cached, [c, d])):
        free, tables = alloc.free_block_ids(), [alloc.block_ids(r.request_id) for r in requests]
        assert not alloc.grow_unordered(requests, [0, 1], [8, 9])
        assert alloc.free_block_ids() == free and [alloc.block_ids(r.request_id) for r in requests] == tables
        alloc.check_integrity()


def test_blocks_are_cached_only_over_known_tokens():
    alloc = KVAllocator(num_blocks=8, block_size=4, enable_kv_events=True)
    req = FakeRequest("a", tokens(1, 6))
    # Room for 12 tokens (lookahead), of which only 6 are known: one full known block.
    assert alloc.allocate(req, 12) == [1, 2, 3]
    [stored] = alloc.take_events()
    assert stored.block_hashes == [hash_block(None, tokens(1, 4))]


def test_free_uncaches_blocks_whose_tokens_never_ran():
    alloc = KVAllocator(num_blocks=8, block_size=2, enable_kv_events=True)
    a = FakeRequest("a", tokens(1, 7))
    assert admit(alloc, a, num_new=3) == [1, 2]  # tokens 0-2 computed, block 1 cached
    assert alloc.allocate(a, 4) == [3, 4]  # caches blocks 2 and 3 for tokens not yet run...
    alloc.take_events()
    alloc.free("a")  # ...then a is preempted before the step runs them
    h = hash_block(None, [1, 2])
    assert alloc.take_events() == [BlockRemoved([hash_block(hash_block(h, [3, 4]), [5, 6]),
                                                 hash_block(h, [3, 4])])]
    assert alloc.get_computed_blocks(FakeRequest("b", tokens(1, 7))) == ([1], 2)
    alloc.check_integrity()


def test_stale_hits_and_bad_arguments_are_refused():
    alloc = KVAllocator(num_blocks=4, block_size=2)
    admit(alloc, FakeRequest("a", [1, 2, 3]))  # [1, 2]; block 1 cached
    alloc.free("a")
    b = FakeRequest("b", [1, 2, 3])
    hit_ids, num_hit = alloc.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1], 2)
    with pytest.raises(ValueError, match="does not match"):
        alloc.allocate(b, 1, hit_ids, 4)
    with pytest.raises(ValueError, match=">= 0"):
        alloc.allocate(b, -1)
    admit(alloc, FakeRequest("c", [7, 7, 7, 7, 7, 7]))  # takes 3, 2, 1: evicts the hit
    alloc.free("c")
    with pytest.raises(ValueError, match="evicted"):
        alloc.allocate(b, 1, hit_ids, num_hit)
    d = FakeRequest("d", [7, 7, 7])
    admit(alloc, d)
    with pytest.raises(ValueError, match="already holds blocks"):
        alloc.allocate(d, 1, [3], 2)
    alloc.check_integrity()


def test_free_of_an_unknown_or_freed_request_is_a_no_op():
    alloc = KVAllocator(num_blocks=4, block_size=2)
    alloc.free("nobody")
    admit(alloc, FakeRequest("a", [1, 2, 3]))
    alloc.free("a")
    alloc.free("a")
    assert alloc.num_free_blocks == 3
    alloc.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    alloc = KVAllocator(num_blocks=6, block_size=2, enable_kv_events=True)
    admit(alloc, FakeRequest("a", [1, 2, 3, 4, 5]))
    assert alloc.reset_prefix_cache() is False
    alloc.free("a")
    alloc.take_events()
    assert alloc.reset_prefix_cache() is True
    assert alloc.take_events() == [AllBlocksCleared()]
    assert alloc.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5])) == ([], 0)
    alloc.check_integrity()


def test_prefix_caching_off_never_hashes():
    alloc = KVAllocator(num_blocks=6, block_size=2, enable_prefix_caching=False, enable_kv_events=True)
    admit(alloc, FakeRequest("a", [1, 2, 3, 4, 5]))
    alloc.free("a")
    assert alloc.get_computed_blocks(FakeRequest("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert alloc.take_events() == []
    assert alloc.prefix_cache_queries == 0


def test_prefix_cache_counters_count_tokens():
    alloc = KVAllocator(num_blocks=8, block_size=2)
    admit(alloc, FakeRequest("a", [1, 2, 3, 4, 5]))
    admit(alloc, FakeRequest("b", [1, 2, 3, 4, 6]))
    assert (alloc.prefix_cache_queries, alloc.prefix_cache_hits) == (10, 4)


def test_events_are_only_recorded_when_enabled():
    alloc = KVAllocator(num_blocks=6, block_size=2)
    admit(alloc, FakeRequest("a", [1, 2, 3, 4, 5]))
    assert alloc.take_events() == []


def test_check_integrity_names_a_broken_invariant():
    alloc = KVAllocator(num_blocks=6, block_size=2)
    admit(alloc, FakeRequest("a", [1, 2, 3]))
    alloc._blocks[1].ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref count"):
        alloc.check_integrity()
    alloc._blocks[1].ref_cnt -= 1
    alloc._hash_to_block[12345] = alloc._blocks[2]
    with pytest.raises(RuntimeError, match="maps to block 2"):
        alloc.check_integrity()


def test_constructor_rejects_unusable_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        KVAllocator(num_blocks=1, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVAllocator(num_blocks=4, block_size=0)
