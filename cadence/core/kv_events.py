"""What the KV allocator publishes about its prefix cache, and the net effect of a run of it.

The allocator records an event whenever blocks enter or leave the prefix cache (when
``enable_kv_events`` is on); the engine core folds each step's events into one
:class:`~cadence.messages.KVCacheDelta` for the data-parallel router (block hashes only).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from cadence.messages import KVCacheDelta


class _KVEvent(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_KVEvent):
    """Consecutive blocks of one request entered the prefix cache.

    ``token_ids`` holds ``len(block_hashes) * block_size`` ids, block after block; the first
    block's parent is ``parent_block_hash`` (``None``: it starts a sequence, and its hash includes
    the request's ``cache_salt``, its LoRA adapter's, if any).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None = None


class BlockRemoved(_KVEvent):
    """These hashes left the prefix cache (their blocks were reused)."""

    block_hashes: list[int]


class AllBlocksCleared(_KVEvent):
    """``reset_prefix_cache()`` dropped every hash."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_events(tokens: Sequence[int], hashes: list[int], indices: list[int], block_size: int,
                  cache_salt: str | None = None) -> list[BlockStored]:
    """One :class:`BlockStored` per run of consecutive block ``indices`` of a request whose tokens
    are ``tokens``, whose full blocks hash to ``hashes`` and whose first block's hash includes
    ``cache_salt``."""
    events = []
    start = 0
    for k in range(1, len(indices) + 1):
        if k == len(indices) or indices[k] != indices[k - 1] + 1:
            first, last = indices[start], indices[k - 1]
            events.append(BlockStored(
                block_hashes=hashes[first:last + 1],
                parent_block_hash=hashes[first - 1] if first > 0 else None,
                token_ids=list(tokens[first * block_size:(last + 1) * block_size]),
                block_size=block_size,
                cache_salt=cache_salt,
            ))
            start = k
    return events


def fold_kv_events(events: list[KVEvent]) -> KVCacheDelta | None:
    """The net effect of ``events`` (in order) on the set of cached hashes; None if there were none."""
    if not events:
        return None
    stored: dict[int, None] = {}  # dicts: sets in insertion order, so the frames are reproducible
    removed: dict[int, None] = {}
    cleared = False
    for event in events:
        if isinstance(event, AllBlocksCleared):
            stored.clear()
            removed.clear()
            cleared = True
            continue
        added, dropped = (stored, removed) if isinstance(event, BlockStored) else (removed, stored)
        for block_hash in event.block_hashes:
            dropped.pop(block_hash, None)
            added[block_hash] = None
    return KVCacheDelta(stored=list(stored), removed=list(removed), cleared=cleared)
