"""The KV cache manager of a model with sliding layers, alone or next to global ones (KV cache
groups of either kind over one pool), driven like a scheduler with chunked prefills, decodes,
prefix hits and finished requests: no group releases a block that one of its layers can still see,
a sliding group releases every block that none of its layers can see any more, and a global group
releases nothing until the request ends.

A shadow map ``slot -> (group, token)`` records what the fake model wrote through each group's
table, so a block released while visible, reused by another request while visible, or shared by
two groups shows up as a position whose slot holds another group's or another token.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from cadence.core.block_hash import hash_block
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.testing import FakeRequest

Workload = tuple[list[int | None], int, bool, list[list[int]], list[list[int]]]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """(each group's window, at least one sliding; block size; prefix caching; prompts (two-token
    vocabulary: prefixes repeat); and for each request the token counts it is scheduled in, step
    after step)."""
    windows: list[int | None] = draw(st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=1, max_size=4))
    windows.append(draw(st.integers(1, 40)))
    block_size = draw(st.integers(1, 8))
    prompts = draw(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=70), min_size=1, max_size=8))
    chunks = [draw(st.lists(st.integers(1, 16), min_size=1, max_size=12)) for _ in prompts]
    return draw(st.permutations(windows)), block_size, draw(st.booleans()), prompts, chunks


def _visible_from(req: FakeRequest, window: int | None) -> int:
    """The first position the request's next query (at ``num_computed_tokens``) sees."""
    return 0 if window is None else max(0, req.num_computed_tokens - window + 1)


def _longest_hit(manager: KVCacheManager, windows: list[int | None], req: FakeRequest) -> int:
    """The most blocks ``n`` (leaving the last token to compute) such that every global group has
    blocks ``0..n-1`` cached and every sliding group those that the query at ``n * bs`` sees."""
    bs = manager.block_size
    hashes: list[int] = []
    for start in range(0, (req.num_tokens - 1) // bs * bs, bs):
        hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[start:start + bs]))
    for n in range(len(hashes), 0, -1):
        if all(all(h in group._hash_to_block for h in hashes[_visible_block(n * bs, window, bs):n])
               for group, window in zip(manager.groups, windows, strict=True)):
            return n
    return 0


def _visible_block(position: int, window: int | None, bs: int) -> int:
    """The first block the query at ``position`` sees."""
    return 0 if window is None else max(0, position - window + 1) // bs


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_a_block_is_released_exactly_when_no_query_of_its_group_can_see_it(workload: Workload) -> None:
    windows, bs, caching, prompts, chunks = workload
    # Room for the longest request in every group and no more: blocks are reused and evicted, so
    # the groups' caches differ (a sliding group's early blocks go first).
    longest = max(-(-(len(prompt) + sum(steps)) // bs) for prompt, steps in zip(prompts, chunks, strict=True))
    num_blocks = len(windows) * longest + 1
    manager = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching, windows=windows)
    shadow: dict[int, tuple[int, int]] = {}
    # Requests run one after another, each its steps in turn, so later ones can hit earlier prefixes.
    for i, (prompt, steps) in enumerate(zip(prompts, chunks, strict=True)):
        req = FakeRequest(f"r{i}", list(prompt))
        expected_hit = _longest_hit(manager, windows, req) if caching else 0
        hit_ids, num_hit = manager.get_computed_blocks(req)
        assert num_hit == expected_hit * bs
        assert len(hit_ids) == len(windows) and all(len(ids) * bs == num_hit for ids in hit_ids)
        for step, n in enumerate(steps):
            if step == 0:
                assert manager.allocate(req, n, hit_ids, num_hit) is not None
                req.num_computed_tokens += num_hit
            else:
                assert manager.allocate(req, n) is not None
            tables = manager.block_ids(req.request_id)
            for group, (window, table) in enumerate(zip(windows, tables, strict=True)):
                first = _visible_from(req, window)
                # Held: every block with a position this step's queries see; released: every block before.
                assert 0 not in table[first // bs:]
                assert set(table[:first // bs]) <= {0}
                # What the visible positions hold is what this group wrote there (hits included).
                for pos in range(first, req.num_computed_tokens):
                    assert shadow[table[pos // bs] * bs + pos % bs] == (group, req.all_token_ids[pos])
            # The "model" writes this step's tokens (generating past the prompt: a fixed token).
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                if pos >= req.num_tokens:
                    req.all_token_ids.append(1)
                for group, table in enumerate(tables):
                    shadow[table[pos // bs] * bs + pos % bs] = (group, req.all_token_ids[pos])
            req.num_computed_tokens += n
            manager.check_integrity()
        manager.free(req.request_id)
        manager.check_integrity()
    assert manager.num_free_blocks == num_blocks - 1
