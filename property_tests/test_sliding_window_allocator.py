"""The KV allocator of a model whose every layer slides (``sliding_window``), driven like a scheduler
with chunked prefills, decodes, prefix hits and finished requests: it never releases a block that a
query can still see, and releases every block that no query can see any more.

A shadow map ``slot -> token`` records what the fake model wrote through each request's table, so a
block released while visible, or reused by another request while visible, shows up as a position
whose slot holds another token.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from cadence.core.kv_allocator import KVAllocator
from cadence.core.testing import FakeRequest


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, bool, list[list[int]], list[list[int]]]:
    """(window, block size, prefix caching, prompts (two-token vocabulary: prefixes repeat), and
    for each request the token counts it is scheduled in, step after step)."""
    window = draw(st.integers(1, 40))
    block_size = draw(st.integers(1, 8))
    prompts = draw(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=70), min_size=1, max_size=5))
    chunks = [draw(st.lists(st.integers(1, 16), min_size=1, max_size=12)) for _ in prompts]
    return window, block_size, draw(st.booleans()), prompts, chunks


def _visible_from(req: FakeRequest, window: int) -> int:
    """The first position the request's next query (at ``num_computed_tokens``) sees."""
    return max(0, req.num_computed_tokens - window + 1)


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_a_block_is_released_exactly_when_no_query_can_see_it(
        workload: tuple[int, int, bool, list[list[int]], list[list[int]]]) -> None:
    window, bs, caching, prompts, chunks = workload
    alloc = KVAllocator(400, bs, enable_prefix_caching=caching, sliding_window=window)
    shadow: dict[int, int] = {}
    # Requests run one after another, each its steps in turn, so later ones can hit earlier prefixes.
    for i, (prompt, steps) in enumerate(zip(prompts, chunks, strict=True)):
        req = FakeRequest(f"r{i}", list(prompt))
        hit_ids, num_hit = alloc.get_computed_blocks(req)
        for step, n in enumerate(steps):
            if step == 0:
                assert alloc.allocate(req, n, hit_ids, num_hit) is not None
                req.num_computed_tokens += num_hit
            else:
                assert alloc.allocate(req, n) is not None
            table = alloc.block_ids(req.request_id)
            first = _visible_from(req, window)
            # Held: every block with a position this step's queries see; released: every block before.
            assert 0 not in table[first // bs:]
            assert set(table[:first // bs]) <= {0}
            # What the visible positions hold is what was written there (hits included).
            for pos in range(first, req.num_computed_tokens):
                assert shadow[table[pos // bs] * bs + pos % bs] == req.all_token_ids[pos]
            # The "model" writes this step's tokens (generating past the prompt: a fixed token).
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                if pos >= req.num_tokens:
                    req.all_token_ids.append(1)
                shadow[table[pos // bs] * bs + pos % bs] = req.all_token_ids[pos]
            req.num_computed_tokens += n
            alloc.check_integrity()
        alloc.free(req.request_id)
        alloc.check_integrity()
    assert alloc.num_free_blocks == 399
