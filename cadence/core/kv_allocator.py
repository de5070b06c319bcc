"""The paged KV block allocator with prefix caching (vLLM V1's KVCacheManager + BlockPool, small).

A pool of ``num_blocks`` fixed-size blocks; block 0 is the null block and is never handed out.
Free blocks sit in an intrusive doubly linked list: allocation pops the head, freeing appends to
the tail, so the least recently freed block is evicted first. A freed block keeps its hash and
stays findable by prefix lookups until it is reused; a lookup hit on a free block takes it out of
the middle of the list in O(1).

Only full blocks are cached. A block's hash chains its parent's hash, its token ids and extra
keys, so equal tokens after a different prefix never match.

The scheduler owns one allocator and calls it synchronously inside a step. The protocol for a
request that holds no blocks (new, or back from preemption with ``num_computed_tokens == 0``)::

    hit_ids, num_hit = allocator.get_computed_blocks(request)
    new_ids = allocator.allocate(request, num_new_tokens, hit_ids, num_hit)
    if new_ids is not None:           # admitted; nothing changed when None
        request.num_computed_tokens += num_hit   # the caller advances the counter, not us

and for a running one ``allocator.allocate(request, num_new_tokens)``. Call ``free(request_id)``
when a request finishes, is aborted or is preempted, and also for one that was only looked up and
never admitted (the lookup memoizes its block hashes under its id).

With ``sliding_window`` (every layer sees only its last ``window`` keys: Mistral 7B v0.1), the
blocks before the window of a request's next query (at ``num_computed_tokens``) return to the pool
at its next allocation, the null block taking their places; they keep their hashes for prefix hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from cadence.core.block_pool import Block, FreeList, IntegrityError, KVRequest, RequestBlocks, hash_block
from cadence.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent, stored_events

# ---- the allocator -------------------------------------------------------------------------


class KVAllocator:
    """Paged KV blocks for every request, with prefix caching and LRU eviction.

    Not thread-safe: the scheduler calls it from one task.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, sliding_window: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self._window = sliding_window  # None: keep every block (global layers, or layers that differ)
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._record_events = enable_kv_events
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeList(self._blocks[1:])
        self._hash_to_block: dict[int, Block] = {}
        self._requests: dict[str, RequestBlocks] = {}
        self._events: list[KVEvent] = []
        # Running totals in tokens, for the prefix cache hit-rate metric.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- read-only views -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def enable_kv_events(self) -> bool:
        return self._record_events

    @enable_kv_events.setter
    def enable_kv_events(self, on: bool) -> None:
        """Turn recording on before the first allocation: a subscriber learns only of later changes."""
        self._record_events = on

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (cached-but-free blocks included)."""
        return self._free.size

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        return 1.0 - self._free.size / (self._num_blocks - 1)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (``[]`` for an unknown request)."""
        state = self._requests.get(request_id)
        return [] if state is None else [b.block_id for b in state.blocks]

    def free_block_ids(self) -> list[int]:
        """The free list from head (next evicted) to tail. O(num_blocks): debugging and tests."""
        ids = []
        block = self._free.head.next_free
        while block is not None and block is not self._free.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events recorded since the last call (always empty unless enabled)."""
        events, self._events = self._events, []
        return events

    # ---- the scheduler's calls -------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """The longest chain of cached blocks equal to the start of ``request``'s tokens.

        Returns ``(block_ids, num_hit_tokens)`` with ``num_hit_tokens == len(block_ids) *
        block_size``, capped at ``num_tokens - 1`` rounded down to whole blocks so that the last
        token is always computed (its logits are needed). Changes nothing but the
        ``prefix_cache_*`` counters (and a memo of the request's block hashes, dropped by
        :meth:`free`). Pass the result straight to :meth:`allocate`: any allocation in between
        may evict the blocks. ``([], 0)`` when prefix caching is off.
        """
        if not self._caching:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestBlocks(request)
        num_tokens = request.num_tokens
        max_blocks = (num_tokens - 1) // self._block_size
        hit_ids: list[int] = []
        if max_blocks > 0:
            hashes = state.hashes
            lookup = self._hash_to_block.get
            # Hash lazily: a miss usually comes early, so most of a long prompt is never hashed.
            for i in range(max_blocks):
                if i == len(hashes):
                    self._extend_hashes(request, hashes, i + 1)
                block = lookup(hashes[i])
                if block is None:
                    break
                hit_ids.append(block.block_id)
        num_hit_tokens = len(hit_ids) * self._block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_ids, num_hit_tokens

    def allocate(self, request: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = (),
                 num_computed_hit_tokens: int = 0) -> list[int] | None:
        """Hold slots for ``num_computed_tokens + num_computed_hit_tokens + num_new_tokens`` tokens.

        ``computed_block_ids``/``num_computed_hit_tokens`` are :meth:`get_computed_blocks`' answer
        and are only accepted while the request holds no blocks; the hit blocks are prepended to
        its table (ref count + 1). Both counts are read before the caller advances
        ``num_computed_tokens`` by the hit.

        All or nothing: returns ``None`` and changes nothing when the free pool (minus the free
        hit blocks this would take out of it) is too small. Otherwise returns the ids of the
        newly allocated blocks only (the table is :meth:`block_ids`). Reusing a free block that
        carried a hash evicts that hash. Afterwards every block that is full of known tokens is
        registered in the prefix cache, so a later request (even in the same step) can hit it.

        :raises ValueError: on a negative count, hits for a request that already holds blocks,
            a hit count that disagrees with the block ids, or hit blocks that were evicted since
            the lookup.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        if state is not None and self._window is not None:
            self._release_out_of_window(state, request.num_computed_tokens)
        num_held = len(state.blocks) if state is not None else 0
        hit_blocks: list[Block] = []
        num_free_hits = 0
        if computed_block_ids or num_computed_hit_tokens:
            hit_blocks = self._validate_hits(request, state, computed_block_ids, num_computed_hit_tokens)
            # A free hit block leaves the free pool when touched, so it counts against it.
            num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        num_total = request.num_computed_tokens + num_computed_hit_tokens + num_new_tokens
        num_needed = max(0, -(-num_total // self._block_size) - num_held - len(hit_blocks))
        if num_needed + num_free_hits > self._free.size:
            return None

        if state is None:
            state = self._requests[request.request_id] = RequestBlocks(request)
        state.request = request
        blocks = state.blocks
        for block in hit_blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1
        blocks.extend(hit_blocks)
        state.num_cached = max(state.num_cached, len(hit_blocks))
        new_blocks = self._take_free_blocks(num_needed)
        blocks.extend(new_blocks)
        if self._window is not None and hit_blocks:  # hit blocks may lie before the window already
            self._release_out_of_window(state, request.num_computed_tokens + num_computed_hit_tokens)
        if self._caching:
            num_full = min(num_total, request.num_tokens) // self._block_size
            if num_full > state.num_cached:
                self._cache_full_blocks(request, state, num_full)
        return [b.block_id for b in new_blocks]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finished, aborted or preempted); unknown ids are a no-op.

        Blocks are released last first, so a chain's tail sits nearer the free list's head and is
        evicted before the prefix it depends on. Released blocks keep their hash (still cached),
        except those past the request's ``num_computed_tokens`` as read now: they were registered
        by an allocation whose tokens will never run (a request preempted in the same step that
        allocated for it), so their KV was never written. Call this before resetting
        ``num_computed_tokens`` on preemption, or the request's cached prefix is lost. Also drops
        the request's hash memo, so call it for a request that was only looked up.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        blocks = state.blocks
        num_written = state.request.num_computed_tokens // self._block_size
        append = self._free.append
        unwritten = []
        for i in range(len(blocks) - 1, state.num_released - 1, -1):
            block = blocks[i]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if i >= num_written and block.block_hash is not None:
                    unwritten.append(block.block_hash)
                    del self._hash_to_block[block.block_hash]
                    block.block_hash = None
                append(block)
        if unwritten and self._record_events:
            self._events.append(BlockRemoved(unwritten))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is held."""
        if self._free.size != self._num_blocks - 1:
            return False
        for block in self._hash_to_block.values():
            block.block_hash = None
        self._hash_to_block.clear()
        if self._record_events:
            self._events.append(AllBlocksCleared())
        return True

    # ---- internals -------------------------------------------------------------------------

    def _validate_hits(self, request: KVRequest, state: RequestBlocks | None, hit_ids: Sequence[int],
                       num_hit_tokens: int) -> list[Block]:
        if len(hit_ids) * self._block_size != num_hit_tokens:
            raise ValueError(f"num_computed_hit_tokens={num_hit_tokens} does not match "
                             f"{len(hit_ids)} hit blocks of {self._block_size} tokens")
        if not hit_ids:
            return []
        if state is not None and state.blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks; prefix hits are "
                             "only taken on its first allocation")
        if state is None or len(state.hashes) < len(hit_ids):
            raise ValueError("prefix hits must come from get_computed_blocks() for this request")
        hit_blocks = [self._blocks[i] for i in hit_ids]
        # Cheap guard against a lookup gone stale (another allocation evicted a hit block).
        for block, expected in zip(hit_blocks, state.hashes, strict=False):
            if block.block_hash != expected:
                raise ValueError(f"prefix hit block {block.block_id} was evicted after "
                                 "get_computed_blocks(); allocate right after the lookup")
        return hit_blocks

    def _release_out_of_window(self, state: RequestBlocks, num_computed: int) -> None:
        """Return the blocks before the window of the request's next query (at ``num_computed``)."""
        num_dead = max(0, num_computed - (self._window or 0) + 1) // self._block_size
        for i in range(state.num_released, min(num_dead, len(state.blocks))):
            block, state.blocks[i] = state.blocks[i], self._blocks[0]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)  # still cached: a later prefix hit may take it back
            state.num_released = i + 1
        if self._caching and state.num_released > state.num_cached:  # released before offered: never offered
            self._extend_hashes(state.request, state.hashes, state.num_released)
            state.num_cached = state.num_released

    def _take_free_blocks(self, n: int) -> list[Block]:
        taken = []
        evicted = []
        popleft = self._free.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                del self._hash_to_block[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        if evicted and self._record_events:
            self._events.append(BlockRemoved(evicted))
        return taken

    def _extend_hashes(self, request: KVRequest, hashes: list[int], n: int) -> None:
        """Hash the request's full blocks up to block ``n`` (exclusive), from where the memo ends."""
        bs = self._block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), n):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def _cache_full_blocks(self, request: KVRequest, state: RequestBlocks, num_full: int) -> None:
        hashes = state.hashes
        self._extend_hashes(request, hashes, num_full)
        cache = self._hash_to_block
        stored = []
        for i in range(state.num_cached, num_full):
            h = hashes[i]
            # One block per hash: a duplicate (two requests computed the same prefix at once)
            # stays unhashed and simply returns to the pool when freed.
            if h not in cache:
                block = state.blocks[i]
                block.block_hash = h
                cache[h] = block
                stored.append(i)
        if stored and self._record_events:
            self._events.extend(stored_events(request.all_token_ids, hashes, stored, self._block_size))
        state.num_cached = num_full

    # ---- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Verify every invariant of the pool; O(num_blocks + table sizes), for tests and debug.

        :raises RuntimeError: naming the first invariant found broken.
        """
        free_ids = self._check_free_list()
        holders = self._check_tables()
        num_in_use = 0
        for block in self._blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                _broken(f"block {block.block_id} has ref count {block.ref_cnt} but "
                        f"{holders[block.block_id]} request tables hold it")
            if (block.block_id in free_ids) != (block.ref_cnt == 0):
                _broken(f"block {block.block_id} (ref count {block.ref_cnt}) breaks 'in the free list "
                        "iff its ref count is 0'")
            num_in_use += block.ref_cnt > 0
            if block.block_hash is not None and self._hash_to_block.get(block.block_hash) is not block:
                _broken(f"block {block.block_id} carries a hash the cache does not map to it")
        if num_in_use + len(free_ids) != self._num_blocks - 1:
            _broken(f"{num_in_use} in use + {len(free_ids)} free != {self._num_blocks - 1} usable blocks")
        for h, block in self._hash_to_block.items():
            if block.block_hash != h:
                _broken(f"hash {h} maps to block {block.block_id}, which carries {block.block_hash}")
        if not self._caching and self._hash_to_block:
            _broken("prefix caching is off but blocks are cached")

    def _check_free_list(self) -> set[int]:
        free_ids = self._free.check_links(self._num_blocks)
        null = self._blocks[0]
        if 0 in free_ids or null.ref_cnt != 0 or null.block_hash is not None:
            _broken("the null block was handed out, freed or hashed")
        return free_ids

    def _check_tables(self) -> list[int]:
        """How many request tables hold each block; checks each table on the way."""
        holders = [0] * self._num_blocks
        for request_id, state in self._requests.items():
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
                if block.block_hash is not None and block.block_hash != h:
                    _broken(f"request {request_id!r} block {block.block_id} carries a foreign hash")
        return holders


def _broken(message: str) -> NoReturn:
    raise IntegrityError(f"KV allocator integrity: {message}")
