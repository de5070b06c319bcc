"""The KV block pool's pieces: the intrusive free list."""

from __future__ import annotations

import pytest

from cadence.core.block_pool import Block, FreeList, IntegrityError

# ---- FreeList --------------------------------------------------------------------------------


def order(free: FreeList) -> list[int]:
    """The list from head to tail, following next pointers."""
    ids = []
    block = free.head.next_free
    while block is not None and block is not free.tail:
        ids.append(block.block_id)
        block = block.next_free
    return ids


def backwards(free: FreeList) -> list[int]:
    ids = []
    block = free.tail.prev_free
    while block is not None and block is not free.head:
        ids.append(block.block_id)
        block = block.prev_free
    return ids


def pool(n: int) -> list[Block]:
    return [Block(i) for i in range(n)]


def test_free_list_keeps_append_order_and_pops_the_head() -> None:
    blocks = pool(5)
    free = FreeList(blocks[1:])
    assert order(free) == [1, 2, 3, 4] and backwards(free) == [4, 3, 2, 1]
    assert free.size == 4
    assert free.popleft(1) == [blocks[1]]
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    free.append(blocks[1])  # freed again: to the tail, evicted last
    assert order(free) == [2, 3, 4, 1] and backwards(free) == [1, 4, 3, 2]
    assert free.size == 4
    assert free.check_links(5) == {1, 2, 3, 4}


def test_free_list_removes_from_the_middle_and_both_ends() -> None:
    blocks = pool(6)
    free = FreeList(blocks[1:])
    free.remove(blocks[3])
    assert order(free) == [1, 2, 4, 5] and backwards(free) == [5, 4, 2, 1]
    free.remove(blocks[1])
    free.remove(blocks[5])
    assert order(free) == [2, 4] and free.size == 2
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert free.popleft(1) == [blocks[2]]
    assert free.popleft(1) == [blocks[4]]
    assert free.size == 0 and order(free) == [] and backwards(free) == []
    assert free.head.next_free is free.tail and free.tail.prev_free is free.head
    assert free.check_links(6) == set()
    free.append(blocks[3])
    assert order(free) == [3] and free.check_links(6) == {3}


def test_free_list_links_and_unlinks_many_at_once_as_one_by_one() -> None:
    blocks = pool(8)
    free = FreeList(blocks[1:4])
    free.extend(blocks[4:7])  # to the tail, in order
    assert order(free) == [1, 2, 3, 4, 5, 6] and backwards(free) == [6, 5, 4, 3, 2, 1] and free.size == 6
    assert free.popleft(4) == blocks[1:5]  # the head first
    assert all(b.prev_free is None and b.next_free is None for b in blocks[1:5])
    assert order(free) == [5, 6] and backwards(free) == [6, 5] and free.check_links(8) == {5, 6}
    free.extend([])
    assert free.popleft(0) == [] and free.size == 2
    assert free.popleft(2) == blocks[5:7] and order(free) == [] and free.check_links(8) == set()
    free.extend([blocks[7], blocks[2]])
    assert order(free) == [7, 2] and backwards(free) == [2, 7] and free.size == 2
    with pytest.raises(ValueError, match="3 blocks asked of a free list of 2"):
        free.popleft(3)
    assert free.check_links(8) == {7, 2}  # a refusal unlinks nothing


def test_free_list_sentinels_are_not_blocks_of_the_pool() -> None:
    free = FreeList([])
    assert free.size == 0 and free.check_links(1) == set()
    assert free.head.block_id == free.tail.block_id == -1


# ---- check_links -----------------------------------------------------------------------------


def test_check_links_detects_a_wrong_prev_pointer() -> None:
    blocks = pool(4)
    free = FreeList(blocks[1:])
    blocks[3].prev_free = blocks[1]
    with pytest.raises(IntegrityError, match="free block 3 has a wrong prev pointer"):
        free.check_links(4)


def test_check_links_detects_a_cut_list() -> None:
    blocks = pool(4)
    free = FreeList(blocks[1:])
    blocks[2].next_free = None
    with pytest.raises(IntegrityError, match="cut or cyclic"):
        free.check_links(4)


def test_check_links_detects_a_cycle() -> None:
    blocks = pool(4)
    free = FreeList(blocks[1:])
    blocks[3].next_free = blocks[1]  # back to the first: its prev pointer cannot agree
    with pytest.raises(IntegrityError, match="free block 1 has a wrong prev pointer"):
        free.check_links(4)


def test_check_links_stops_after_max_blocks() -> None:
    # Never loops forever: a list longer than the pool is reported as cut or cyclic.
    free = FreeList(pool(5)[1:])
    assert free.check_links(4) == {1, 2, 3, 4}
    with pytest.raises(IntegrityError, match="cut or cyclic"):
        free.check_links(3)


def test_check_links_detects_a_block_linked_twice() -> None:
    blocks = pool(3)
    free = FreeList(blocks[1:])
    free.append(blocks[1])  # a double free: block 1 is linked a second time at the tail
    with pytest.raises(IntegrityError):
        free.check_links(10)


def test_check_links_detects_a_wrong_size_and_a_wrong_tail() -> None:
    blocks = pool(4)
    free = FreeList(blocks[1:])
    free.size += 1
    with pytest.raises(IntegrityError, match="holds 3 blocks but counts 4"):
        free.check_links(4)
    free.size -= 1
    free.tail.prev_free = blocks[1]
    with pytest.raises(IntegrityError, match="tail sentinel has a wrong prev pointer"):
        free.check_links(4)


def test_integrity_error_is_a_runtime_error() -> None:
    assert issubclass(IntegrityError, RuntimeError)
    assert repr(Block(7)) == "Block(7, ref=0, hash=None)"
