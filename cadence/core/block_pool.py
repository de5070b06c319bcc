"""The pieces of the KV block pool: blocks, the free list that orders their eviction, a request's
blocks and hashes, and the prefix-cache key of a full block (see :mod:`cadence.core.kv_allocator`,
which owns the pool)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

import msgspec

# One encoder for the process: hashing runs on the hot path.
_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = ()) -> int:
    """The 64-bit prefix-cache key of one full block.

    Chains ``parent_hash`` (``None`` for a request's first block) so that a block is only equal to
    another whose whole prefix is equal. sha256 over msgpack is stable across processes and
    Python versions (unlike ``hash()`` of strings), so a KV-aware router can compute the same keys.
    A list and a tuple of the same ids hash the same (msgpack encodes both as an array).
    """
    digest = hashlib.sha256(_encode((parent_hash, token_ids, extra_keys))).digest()
    return int.from_bytes(digest[:8], "little")


class KVRequest(Protocol):
    """The part of a request the allocator reads; :class:`cadence.request.RequestView` has it."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...


class RequestBlocks:
    """One request's blocks in the pool, and the hashes of its full blocks."""

    __slots__ = ("blocks", "hashes", "num_cached", "num_released", "request")

    def __init__(self, request: KVRequest) -> None:
        self.request = request  # read again by free()
        self.blocks: list[Block] = []
        # Hashes of the request's full blocks, extended as tokens become known; valid for the
        # request's life since its tokens only grow.
        self.hashes: list[int] = []
        # Leading blocks already offered to the prefix cache (registered, or duplicates of a
        # block that was).
        self.num_cached = 0
        # Leading blocks returned to the pool because no query can see them any more (a sliding
        # window); their places in ``blocks`` hold the null block.
        self.num_released = 0


class Block:
    """One KV block. ``block_hash`` is set iff the prefix-cache map points at this block."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeList:
    """Intrusive doubly linked list between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self.tail.prev_free
        assert last is not None  # sentinels are always linked; narrows the type
        block.prev_free = last
        block.next_free = self.tail
        last.next_free = block
        self.tail.prev_free = block
        self.size += 1

    def popleft(self) -> Block:
        block = self.head.next_free
        assert block is not None and block is not self.tail  # callers check size first
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None  # only blocks in the list are removed
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def check_links(self, max_blocks: int) -> set[int]:
        """The ids of the blocks in the list, after checking that the links and the size agree.

        :raises IntegrityError: for a cut, cyclic or double-linked list, or a wrong size.
        """
        ids: set[int] = set()
        prev = self.head
        block = prev.next_free
        while block is not self.tail:
            if block is None or len(ids) >= max_blocks:
                _broken("the free list is cut or cyclic")
            if block.prev_free is not prev:
                _broken(f"free block {block.block_id} has a wrong prev pointer")
            if block.block_id in ids:
                _broken(f"block {block.block_id} is in the free list twice")
            ids.add(block.block_id)
            prev, block = block, block.next_free
        if self.tail.prev_free is not prev:
            _broken("the free list's tail sentinel has a wrong prev pointer")
        if len(ids) != self.size:
            _broken(f"the free list holds {len(ids)} blocks but counts {self.size}")
        return ids


class IntegrityError(RuntimeError):
    """An invariant of the KV block pool is broken (a bug, never a user's error)."""


def _broken(message: str) -> NoReturn:
    raise IntegrityError(f"KV allocator integrity: {message}")
