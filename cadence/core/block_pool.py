"""The KV block pool: blocks, the free list that orders their eviction, the prefix-cache maps,
and a request's blocks and hashes (their keys: :mod:`cadence.core.block_hash`).

One pool serves every KV cache group of a model (docs/architecture.md, "KV cache groups"): each
group's :class:`cadence.core.kv_allocator.KVAllocator` hands its blocks out and keeps its own
prefix-cache map here, so that evicting a free block drops its hash from the right map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from cadence.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent


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
    @property
    def cache_salt(self) -> str | None:
        """Keys the request's blocks apart (its LoRA adapter): its first block's hash includes it."""
        ...


class RequestBlocks:
    """One request's blocks in the pool, and the hashes of its full blocks."""

    __slots__ = ("blocks", "hashes", "num_cached", "num_released", "request")

    def __init__(self, request: KVRequest, hashes: list[int]) -> None:
        self.request = request  # read again by free()
        self.blocks: list[Block] = []
        # Hashes of the request's full blocks, extended as tokens become known; valid for the
        # request's life since its tokens only grow. One list for all of a model's groups.
        self.hashes = hashes
        # Leading blocks already offered to the prefix cache (registered, or duplicates of a
        # block that was).
        self.num_cached = 0
        # Leading blocks returned to the pool because no query can see them any more (a sliding
        # window); their places in ``blocks`` hold the null block.
        self.num_released = 0


@dataclass
class Allocation:
    """One allocation worked out (``KVAllocator.plan``) before anything is taken, so that the
    groups of a model can check their sum against the shared pool first."""

    request: KVRequest
    hit_blocks: list[Block]
    num_hit_tokens: int
    num_total_tokens: int
    num_needed: int  # new blocks
    num_free_hits: int  # hit blocks that leave the free list when taken

    @property
    def num_taken(self) -> int:
        """Blocks this takes out of the free list."""
        return self.num_needed + self.num_free_hits


class Block:
    """One KV block. ``block_hash`` is set iff the prefix-cache map points at this block."""

    __slots__ = ("block_hash", "block_id", "group", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.group = 0  # whose prefix-cache map holds block_hash
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
        self.extend(blocks)

    def append(self, block: Block) -> None:
        self.extend((block,))

    def extend(self, blocks: Sequence[Block]) -> None:
        """Link ``blocks`` at the tail, in order (the last one is evicted last), in one pass."""
        last = self.tail.prev_free
        assert last is not None  # sentinels are always linked; narrows the type
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self.tail
        self.tail.prev_free = last
        self.size += len(blocks)

    def popleft(self, n: int) -> list[Block]:
        """Unlink the ``n`` blocks at the head (the next evicted), in order, in one pass."""
        if n > self.size:
            raise ValueError(f"{n} blocks asked of a free list of {self.size}")
        taken = []
        block = self.head.next_free
        for _ in range(n):
            assert block is not None  # the size said so
            taken.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        assert block is not None
        self.head.next_free = block
        block.prev_free = self.head
        self.size -= n
        return taken

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None  # only blocks in the list are removed
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def ids(self) -> list[int]:
        """The blocks from head (next evicted) to tail. O(size): debugging and tests."""
        ids = []
        block = self.head.next_free
        while block is not None and block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids

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


class BlockPool:
    """``num_blocks`` blocks (block 0 is the null block, never handed out) shared by ``num_groups``
    KV cache groups, each with its own prefix-cache map; a request's block hashes are memoized
    here once for all groups (its tokens are the same in each).

    KV events are recorded for group 0 only: the data-parallel router asks which prompts are
    cached, and group 0 (full attention where a model has it) answers that.
    """

    def __init__(self, num_blocks: int, num_groups: int = 1, record_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeList(self.blocks[1:])
        self.cached: list[dict[int, Block]] = [{} for _ in range(num_groups)]
        self.hashes: dict[str, list[int]] = {}
        self.record_events = record_events
        self.events: list[KVEvent] = []

    @property
    def null_block(self) -> Block:
        return self.blocks[0]

    def take(self, n: int) -> list[Block]:
        """``n`` blocks from the free list's head (the caller checked its size), each with ref
        count 1; a block that carried a hash is evicted from its group's map."""
        taken = self.free.popleft(n)
        evicted = []
        for block in taken:
            if block.block_hash is not None:
                if block.group == 0:
                    evicted.append(block.block_hash)
                self.uncache(block)
            block.ref_cnt = 1
        if evicted and self.record_events:
            self.events.append(BlockRemoved(evicted))
        return taken

    def uncache(self, block: Block) -> None:
        """Drop ``block``'s hash from its group's map."""
        assert block.block_hash is not None  # callers check
        del self.cached[block.group][block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is held."""
        if self.free.size != self.num_blocks - 1:
            return False
        for cache in self.cached:
            for block in cache.values():
                block.block_hash = None
            cache.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def check(self, holders: list[int]) -> None:
        """Verify the pool against ``holders`` (how many request tables hold each block, over
        every group).

        :raises IntegrityError: naming the first invariant found broken.
        """
        free_ids = self.free.check_links(self.num_blocks)
        null = self.blocks[0]
        if 0 in free_ids or null.ref_cnt != 0 or null.block_hash is not None:
            _broken("the null block was handed out, freed or hashed")
        num_in_use = 0
        for block in self.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                _broken(f"block {block.block_id} has ref count {block.ref_cnt} but "
                        f"{holders[block.block_id]} request tables hold it")
            if (block.block_id in free_ids) != (block.ref_cnt == 0):
                _broken(f"block {block.block_id} (ref count {block.ref_cnt}) breaks 'in the free list "
                        "iff its ref count is 0'")
            num_in_use += block.ref_cnt > 0
            if block.block_hash is not None and self.cached[block.group].get(block.block_hash) is not block:
                _broken(f"block {block.block_id} carries a hash the cache does not map to it")
        if num_in_use + len(free_ids) != self.num_blocks - 1:
            _broken(f"{num_in_use} in use + {len(free_ids)} free != {self.num_blocks - 1} usable blocks")
        for group, cache in enumerate(self.cached):
            for h, block in cache.items():
                if block.block_hash != h or block.group != group:
                    _broken(f"hash {h} of group {group} maps to block {block.block_id}, which carries "
                            f"{block.block_hash} of group {block.group}")


def check_tables(requests: dict[str, RequestBlocks], group: int, holders: list[int]) -> None:
    """Check each request table of one group, adding to ``holders`` how many hold each block.

    :raises IntegrityError: naming the first invariant found broken.
    """
    for request_id, state in requests.items():
        seen: set[int] = set()
        if any(block.block_id != 0 for block in state.blocks[:state.num_released]):
            _broken(f"request {request_id!r} still holds a block it released")
        for block in state.blocks[state.num_released:]:
            if block.block_id in seen or block.block_id == 0:
                _broken(f"request {request_id!r} holds block {block.block_id} twice or the null block")
            seen.add(block.block_id)
            holders[block.block_id] += 1
        if state.num_cached > min(len(state.blocks), len(state.hashes)):
            _broken(f"request {request_id!r} counts more cached blocks than it holds or has hashed")
        for block, h in zip(state.blocks[state.num_released:state.num_cached],
                            state.hashes[state.num_released:], strict=False):
            if block.block_hash is not None and (block.block_hash != h or block.group != group):
                _broken(f"request {request_id!r} block {block.block_id} carries a foreign hash")


class PoolViews:
    """The read-only views of a pool and its settings that an allocator and the manager both offer."""

    _pool: BlockPool
    _block_size: int
    _caching: bool

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def enable_kv_events(self) -> bool:
        return self._pool.record_events

    @enable_kv_events.setter
    def enable_kv_events(self, on: bool) -> None:
        """Turn recording on before the first allocation: a subscriber learns only of later changes."""
        self._pool.record_events = on

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (cached-but-free blocks included)."""
        return self._pool.free.size

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        return 1.0 - self._pool.free.size / (self._pool.num_blocks - 1)

    def eviction_order(self, num: int) -> list[int | None]:
        """The group-0 hashes of the next ``num`` blocks an allocation would take (None: no hash), in
        order: what taking them would evict, as KV events report it."""
        hashes: list[int | None] = []
        block = self._pool.free.head.next_free
        while len(hashes) < num and block is not None and block is not self._pool.free.tail:
            hashes.append(block.block_hash if block.group == 0 else None)
            block = block.next_free
        return hashes

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events recorded since the last call (group 0's; always empty unless enabled)."""
        events, self._pool.events = self._pool.events, []
        return events


class IntegrityError(RuntimeError):
    """An invariant of the KV block pool is broken (a bug, never a user's error)."""


def _broken(message: str) -> NoReturn:
    raise IntegrityError(f"KV allocator integrity: {message}")
