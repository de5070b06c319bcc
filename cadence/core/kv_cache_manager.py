"""The KV cache manager: one allocator per KV cache group over one shared pool (vLLM V1's hybrid
KV cache manager; docs/architecture.md, "KV cache groups").

The scheduler's protocol is :class:`cadence.core.kv_allocator.KVAllocator`'s, with a block table
per group wherever the allocator has one::

    hit_ids, num_hit = manager.get_computed_blocks(request)    # hit_ids: one list per group
    new_ids = manager.allocate(request, num_new_tokens, hit_ids, num_hit)   # one list per group

A prefix hit is the longest one every group holds (a global group needs every block before it, a
sliding group only those its window sees); an allocation is all or nothing over the groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.core.block_pool import BlockPool, KVRequest, PoolViews
from cadence.core.kv_allocator import KVAllocator
from cadence.models.kv_groups import kv_capacity_tokens


class KVCacheManager(PoolViews):
    """Paged KV blocks for every KV cache group of a model, from one pool.

    ``windows`` holds each group's sliding window (None: global layers); the default is one group of
    global layers. Not thread-safe: the scheduler calls it from one task.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False, windows: Sequence[int | None] = (None,),
                 hash_algo: str = "sha256") -> None:
        if not windows:
            raise ValueError("a KV cache has at least one group")
        self._pool = BlockPool(num_blocks, len(windows), enable_kv_events)
        self.groups = [KVAllocator(num_blocks, block_size, enable_prefix_caching, sliding_window=window,
                                   pool=self._pool, group=g, hash_algo=hash_algo) for g, window in enumerate(windows)]
        self._block_size = block_size
        self._caching = enable_prefix_caching
        # One group without a window: a running request's next tokens take :meth:`grow`'s path.
        self._growable = len(self.groups) == 1 and self.groups[0].sliding_window is None
        # Running totals in tokens, for the prefix cache hit-rate metric.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- read-only views -------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def capacity_tokens(self) -> int:
        """The longest request the pool holds for sure, with every group holding all its blocks."""
        return kv_capacity_tokens(self._pool.num_blocks, self._block_size, len(self.groups))

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (empty lists for an unknown request)."""
        return [group.block_ids(request_id) for group in self.groups]

    # ---- the scheduler's calls -------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[list[int]], int]:
        """The longest prefix of ``request``'s tokens that every group has cached: each group's hit
        block ids, and the tokens they hold (see :meth:`KVAllocator.get_computed_blocks`)."""
        if not self._caching:
            return [[] for _ in self.groups], 0
        num_hit = (request.num_tokens - 1) // self._block_size
        hits: list[list[int]] = []
        # A shorter hit in one group can undo another's (a sliding group's hit of n blocks says
        # nothing of a shorter one): ask again until every group agrees.
        while len(hits) != len(self.groups) or any(len(ids) != num_hit for ids in hits):
            hits = []
            for group in self.groups:
                hits.append(group.find_hits(request, num_hit))
                num_hit = len(hits[-1])
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit * self._block_size
        return hits, num_hit * self._block_size

    def allocate(self, request: KVRequest, num_new_tokens: int, computed_block_ids: Sequence[Sequence[int]] = (),
                 num_computed_hit_tokens: int = 0) -> list[list[int]] | None:
        """Hold slots in every group, all or nothing (see :meth:`KVAllocator.allocate`); each
        group's new block ids, or ``None`` when the pool is too small for all of them."""
        group = self.groups[0]
        if (self._growable and num_new_tokens >= 0 and len(computed_block_ids) in (0, 1)
                and not any(computed_block_ids) and not num_computed_hit_tokens and group.holds(request.request_id)):
            return self.grow(request, request.num_computed_tokens + num_new_tokens)  # the common case, unplanned
        hits = computed_block_ids or [()] * len(self.groups)
        if len(hits) != len(self.groups):
            raise ValueError(f"{len(hits)} lists of hit blocks for {len(self.groups)} KV cache groups")
        plans = [group.plan(request, num_new_tokens, ids, num_computed_hit_tokens)
                 for group, ids in zip(self.groups, hits, strict=True)]
        if sum(plan.num_taken for plan in plans) > self._pool.free.size:
            return None
        for group, plan in zip(self.groups, plans, strict=True):
            group.take_hits(plan)
        return [group.fill(plan) for group, plan in zip(self.groups, plans, strict=True)]

    def grow(self, request: KVRequest, num_total_tokens: int) -> list[list[int]] | None:
        """:meth:`KVAllocator.grow`: :meth:`allocate` without hits, up to ``num_total_tokens``, of a
        request that holds blocks, in a manager of one group without a window."""
        if not self._growable:
            raise ValueError("grow() is for one KV cache group without a sliding window")
        new_ids = self.groups[0].grow(request, num_total_tokens)
        return None if new_ids is None else [new_ids]

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group (see :meth:`KVAllocator.free`)."""
        for group in self.groups:
            group.free(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is held."""
        return self._pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Verify every invariant of the pool and of each group's tables (tests and debug).

        :raises RuntimeError: naming the first invariant found broken.
        """
        holders = [0] * self._pool.num_blocks
        for group in self.groups:
            group.check_tables(holders)
        self._pool.check(holders)
