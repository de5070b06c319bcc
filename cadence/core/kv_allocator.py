"""One KV cache group's paged block allocator with prefix caching (vLLM V1's single-type manager).

A pool of ``num_blocks`` fixed-size blocks (:class:`cadence.core.block_pool.BlockPool`, shared with the
model's other KV cache groups under :class:`cadence.core.kv_cache_manager.KVCacheManager`); block 0
is the null block and is never handed out. Free blocks sit in an intrusive doubly linked list:
allocation pops the head, freeing appends to the tail, so the least recently freed block is evicted
first. A freed block keeps its hash and stays findable by prefix lookups until it is reused; a
lookup hit on a free block takes it out of the middle of the list in O(1).

Only full blocks are cached, under keys (:mod:`cadence.core.block_hash`, by ``hash_algo``) that
chain the parent's key, the token ids and extra keys: equal tokens after another prefix never match.

The scheduler owns one allocator and calls it synchronously inside a step. The protocol for a
request that holds no blocks (new, or back from preemption with ``num_computed_tokens == 0``)::

    hit_ids, num_hit = allocator.get_computed_blocks(request)
    new_ids = allocator.allocate(request, num_new_tokens, hit_ids, num_hit)
    if new_ids is not None:           # admitted; nothing changed when None
        request.num_computed_tokens += num_hit   # the caller advances the counter, not us

and for a running one ``allocator.allocate(request, num_new_tokens)``. Call ``free(request_id)``
when a request finishes, is aborted or is preempted, and also for one that was only looked up and
never admitted (the lookup memoizes its block hashes under its id).

With ``sliding_window`` (the group's layers see only their last ``window`` keys: Mistral 7B v0.1,
Gemma's sliding layers), the blocks before the window of a request's next query (at
``num_computed_tokens``) return to the pool at its next allocation, the null block taking their
places; they keep their hashes for prefix hits. A prefix hit then needs only the blocks that the
first computed query sees: those before it are the null block in the hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.config import check_hash_algo
from cadence.core.block_hash import block_hashes
from cadence.core.block_pool import (
    Allocation,
    Block,
    BlockPool,
    IntegrityError,
    KVRequest,
    PoolViews,
    RequestBlocks,
    check_tables,
)
from cadence.core.kv_events import BlockRemoved, stored_events

# ---- the allocator -------------------------------------------------------------------------


class KVAllocator(PoolViews):
    """Paged KV blocks of one KV cache group for every request, with prefix caching and LRU eviction.

    Alone (the default) it owns its pool; pass ``pool`` and ``group`` to share one with the other groups
    of a model (``num_blocks`` is then the pool's size). Not thread-safe: the scheduler calls it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, sliding_window: int | None = None, *,
                 pool: BlockPool | None = None, group: int = 0, hash_algo: str = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self._pool = pool or BlockPool(num_blocks, record_events=enable_kv_events)
        if self._pool.num_blocks != num_blocks:
            raise ValueError(f"num_blocks={num_blocks} but the shared pool has {self._pool.num_blocks}")
        self._window = sliding_window  # None: keep every block
        self._group = group
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._hash_algo = check_hash_algo(hash_algo)
        self._blocks = self._pool.blocks
        self._free = self._pool.free
        self._hash_to_block = self._pool.cached[group]
        self._requests: dict[str, RequestBlocks] = {}
        # Running totals in tokens, for the prefix cache hit-rate metric.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- read-only views -------------------------------------------------------------------

    @property
    def sliding_window(self) -> int | None:
        return self._window

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (``[]`` for an unknown request)."""
        state = self._requests.get(request_id)
        return [] if state is None else [b.block_id for b in state.blocks]

    def free_block_ids(self) -> list[int]:
        """The free list from head (next evicted) to tail. O(num_blocks): debugging and tests."""
        return self._free.ids()

    # ---- the scheduler's calls -------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """The longest prefix of ``request``'s tokens whose KV this group has cached.

        Returns ``(block_ids, num_hit_tokens)`` with ``num_hit_tokens == len(block_ids) *
        block_size``, capped at ``num_tokens - 1`` rounded down to whole blocks so that the last
        token is always computed (its logits are needed); see :meth:`find_hits`. Changes nothing
        but the ``prefix_cache_*`` counters (and a memo of the request's block hashes, dropped by
        :meth:`free`). Pass the result straight to :meth:`allocate`: any allocation in between
        may evict the blocks. ``([], 0)`` when prefix caching is off.
        """
        if not self._caching:
            return [], 0
        hit_ids = self.find_hits(request, (request.num_tokens - 1) // self._block_size)
        num_hit_tokens = len(hit_ids) * self._block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_ids, num_hit_tokens

    def find_hits(self, request: KVRequest, max_blocks: int) -> list[int]:
        """The block ids of the longest hit of at most ``max_blocks`` blocks, without counting it.

        Without a window, a hit is a chain of cached blocks from the first. With one, a hit of
        ``n`` blocks needs only the blocks that the query at ``n * block_size`` sees; the blocks
        before them are the null block (0) in the answer, and need not be cached.
        """
        if not self._caching or max_blocks <= 0:
            return []
        hashes = self._state(request).hashes
        lookup = self._hash_to_block.get
        if self._window is None:
            hit_ids: list[int] = []
            # Hash lazily: a miss usually comes early, so most of a long prompt is never hashed.
            for i in range(max_blocks):
                if i == len(hashes):
                    self._extend_hashes(request, hashes, i + 1)
                block = lookup(hashes[i])
                if block is None:
                    break
                hit_ids.append(block.block_id)
            return hit_ids
        self._extend_hashes(request, hashes, max_blocks)
        found = [lookup(h) for h in hashes[:max_blocks]]
        best, run_start = 0, 0  # the longest hit so far; where the run of cached blocks up to it starts
        for n, block in enumerate(found, 1):
            if block is None:
                run_start = n
            if run_start <= self._num_dead(n):
                best = n
        num_dead = self._num_dead(best)
        return [0] * num_dead + [b.block_id for b in found[num_dead:best] if b is not None]

    def allocate(self, request: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = (),
                 num_computed_hit_tokens: int = 0) -> list[int] | None:
        """Hold slots for ``num_computed_tokens + num_computed_hit_tokens + num_new_tokens`` tokens.

        ``computed_block_ids``/``num_computed_hit_tokens`` are :meth:`get_computed_blocks`' answer
        and are only accepted while the request holds no blocks; the hit blocks are prepended to
        its table (ref count + 1). Both counts are read before the caller advances
        ``num_computed_tokens`` by the hit.

        All or nothing: returns ``None`` and takes nothing when the free pool (minus the free
        hit blocks this would take out of it) is too small. Otherwise returns the ids of the
        newly allocated blocks only (the table is :meth:`block_ids`). Reusing a free block that
        carried a hash evicts that hash. Afterwards every block that is full of known tokens is
        registered in the prefix cache, so a later request (even in the same step) can hit it.
        Blocks out of the window return to the pool first, whatever the answer.

        :raises ValueError: on a negative count, hits for a request that already holds blocks,
            a hit count that disagrees with the block ids, or hit blocks that were evicted since
            the lookup.
        """
        plan = self.plan(request, num_new_tokens, computed_block_ids, num_computed_hit_tokens)
        if plan.num_taken > self._free.size:
            return None
        self.take_hits(plan)
        return self.fill(plan)

    def plan(self, request: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = (),
             num_computed_hit_tokens: int = 0) -> Allocation:
        """:meth:`allocate`'s first part: release what left the window, check the hits and count
        the blocks needed. Then, if the pool has :attr:`Allocation.num_taken` free blocks,
        :meth:`take_hits` and :meth:`fill` (after every group has taken its hits, so that no
        group's new blocks evict another's free hits)."""
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
            num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0 and b.block_id != 0)
        num_total = request.num_computed_tokens + num_computed_hit_tokens + num_new_tokens
        num_needed = max(0, -(-num_total // self._block_size) - num_held - len(hit_blocks))
        return Allocation(request, hit_blocks, num_computed_hit_tokens, num_total, num_needed, num_free_hits)

    def take_hits(self, plan: Allocation) -> None:
        """Prepend the planned hit blocks to the request's table (see :meth:`plan`)."""
        request = plan.request
        state = self._state(request)
        state.request = request
        if not plan.hit_blocks:
            return
        for block in plan.hit_blocks:
            if block.block_id == 0:
                state.num_released += 1  # before the window: never needed
                continue
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1
        state.blocks.extend(plan.hit_blocks)
        state.num_cached = max(state.num_cached, len(plan.hit_blocks))

    def fill(self, plan: Allocation) -> list[int]:
        """Take the planned new blocks and offer the full ones to the prefix cache (see :meth:`plan`)."""
        request = plan.request
        state = self._requests[request.request_id]
        new_blocks = self._pool.take(plan.num_needed)
        state.blocks.extend(new_blocks)
        if self._window is not None and plan.hit_blocks:  # hit blocks may lie before the window already
            self._release_out_of_window(state, request.num_computed_tokens + plan.num_hit_tokens)
        self._cache_up_to(request, state, plan.num_total_tokens)
        return [b.block_id for b in new_blocks]

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks here (it has been allocated for and not freed since)."""
        return request_id in self._requests

    def grow(self, request: KVRequest, num_total_tokens: int) -> list[int] | None:
        """:meth:`allocate` without hits, up to ``num_total_tokens``, of a request that :meth:`holds`
        blocks, in a group without a window (a running request's next tokens), without the planning:
        the new block ids, or None, taking nothing, when the pool is too small."""
        state = self._requests[request.request_id]
        state.request = request
        num_needed = -(-num_total_tokens // self._block_size) - len(state.blocks)
        new_blocks = []
        if num_needed > 0:
            if num_needed > self._free.size:
                return None
            new_blocks = self._pool.take(num_needed)
            state.blocks.extend(new_blocks)
        self._cache_up_to(request, state, num_total_tokens)
        return [b.block_id for b in new_blocks]

    def grow_unordered(self, requests: Sequence[KVRequest], takers: Sequence[int], totals: Sequence[int]) -> bool:
        """What :meth:`grow` calls in any order would leave where ``requests[k]`` takes a block for each
        ``k`` in ``takers`` (in turn) and ends with ``totals[k]`` slots (tokens), if their order cannot
        matter: no block to offer the prefix cache has its hash cached already or twice (a take evicts
        only cached hashes, never a held block). Else False, taking nothing. The pool has the blocks."""
        states = [self._requests[request.request_id] for request in requests]
        offered: list[int] = []
        for request, state, num in zip(requests, states, totals, strict=True):
            num_full = min(num, request.num_tokens) // self._block_size if self._caching else 0
            self._extend_hashes(request, state.hashes, num_full)
            offered += state.hashes[state.num_cached:num_full]
        if len(set(offered)) != len(offered) or not self._hash_to_block.keys().isdisjoint(offered):
            return False
        for k, block in zip(takers, self._pool.take(len(takers)), strict=True):
            states[k].blocks.append(block)
        for request, state, num in zip(requests, states, totals, strict=True):
            state.request = request
            self._cache_up_to(request, state, num)
        return True

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
        self._pool.hashes.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        blocks = state.blocks
        num_written = state.request.num_computed_tokens // self._block_size
        released, unwritten = [], []
        for i in range(len(blocks) - 1, state.num_released - 1, -1):
            block = blocks[i]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if i >= num_written and block.block_hash is not None:
                    unwritten.append(block.block_hash)
                    self._pool.uncache(block)
                released.append(block)
        self._free.extend(released)
        if unwritten and self._group == 0 and self._pool.record_events:
            self._pool.events.append(BlockRemoved(unwritten))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is held."""
        return self._pool.reset_prefix_cache()

    # ---- internals -------------------------------------------------------------------------

    def _state(self, request: KVRequest) -> RequestBlocks:
        state = self._requests.get(request.request_id)
        if state is None:
            hashes = self._pool.hashes.setdefault(request.request_id, [])
            state = self._requests[request.request_id] = RequestBlocks(request, hashes)
        return state

    def _num_dead(self, num_computed_blocks: int) -> int:
        """Blocks before the window of the query that follows ``num_computed_blocks`` blocks."""
        window = self._window or 0
        return max(0, num_computed_blocks * self._block_size - window + 1) // self._block_size if window else 0

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
        num_dead = self._num_dead(len(hit_ids))
        # Cheap guard against a lookup gone stale (another allocation evicted a hit block).
        for i, (block, expected) in enumerate(zip(hit_blocks, state.hashes, strict=False)):
            if block.block_id == 0 and i < num_dead and (i == 0 or hit_blocks[i - 1].block_id == 0):
                continue  # before the window: the hit needs no block there
            if block.block_hash != expected or block.group != self._group:
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

    def _extend_hashes(self, request: KVRequest, hashes: list[int], n: int) -> None:
        """Hash the request's full blocks up to block ``n`` (exclusive), from where the memo ends."""
        if len(hashes) < n:
            hashes.extend(block_hashes(request.all_token_ids, self._block_size, n, request.cache_salt,
                                       start=len(hashes), parent=hashes[-1] if hashes else None, algo=self._hash_algo))

    def _cache_up_to(self, request: KVRequest, state: RequestBlocks, num_total_tokens: int) -> None:
        """Offer the prefix cache every block full of known tokens among the first ``num_total_tokens``."""
        if self._caching:
            num_full = min(num_total_tokens, request.num_tokens) // self._block_size
            if num_full > state.num_cached:
                self._cache_full_blocks(request, state, num_full)

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
                block.group = self._group
                cache[h] = block
                stored.append(i)
        if stored and self._group == 0 and self._pool.record_events:
            self._pool.events.extend(stored_events(request.all_token_ids, hashes, stored, self._block_size,
                                                    request.cache_salt))
        state.num_cached = num_full

    # ---- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Verify every invariant of the pool and of this group's tables; O(num_blocks + table
        sizes), for tests and debug. Alone only: a shared pool is checked by its manager.

        :raises RuntimeError: naming the first invariant found broken.
        """
        holders = [0] * self._pool.num_blocks
        self.check_tables(holders)
        self._pool.check(holders)

    def check_tables(self, holders: list[int]) -> None:
        """Check each request table of this group, adding to ``holders`` how many hold each block."""
        check_tables(self._requests, self._group, holders)
        if not self._caching and self._hash_to_block:
            raise IntegrityError("KV allocator integrity: prefix caching is off but blocks are cached")
