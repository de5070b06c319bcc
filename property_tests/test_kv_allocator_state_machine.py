"""The KV allocator driven like a scheduler would, against a shadow model of every KV slot.

Small pools, block sizes 1-4 and a three-token vocabulary make prefix hits, evictions, duplicates
and failed allocations frequent. The fake "model" writes each computed token into a shadow map
``slot -> token`` through the request's block table, so a prefix hit that returned the wrong
blocks, or a block reused while still cached or held, shows up as a token mismatch.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cadence.config import HASH_ALGOS
from cadence.core.block_hash import hash_block
from cadence.core.kv_allocator import KVAllocator
from cadence.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.testing import FakeRequest

VOCAB = 3
PICK = st.integers(0, 2**16)  # index into a sorted candidate list, modulo its length


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, salt: str | None, algo: str) -> list[int]:
    """The test's own hashes of the first ``num_blocks`` full blocks (the first salted, as a LoRA
    adapter's are), block by block with ``algo``."""
    hashes: list[int] = []
    parent = None
    for i in range(num_blocks):
        extra = (salt,) if i == 0 and salt else ()
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra, algo)
        hashes.append(parent)
    return hashes


class KVAllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: KVAllocator
        self.running: dict[str, FakeRequest] = {}
        self.waiting: list[FakeRequest] = []  # hold no blocks: never admitted, or preempted
        self.prompts: list[list[int]] = []
        # slot -> (adapter salt, token) the model last wrote there: an adapter's KV is its own
        self.shadow: dict[int, tuple[str | None, int]] = {}
        self.block_tokens: dict[int, tuple[tuple[str | None, int], ...]] = {}  # hash -> what that block holds
        self.cached_from_events: set[int] = set()
        self.next_id = 0

    @initialize(num_blocks=st.integers(8, 40), block_size=st.integers(1, 4),
                caching=st.sampled_from([True, True, True, False]), events=st.booleans(),
                algo=st.sampled_from(HASH_ALGOS))
    def setup(self, num_blocks: int, block_size: int, caching: bool, events: bool, algo: str) -> None:
        self.alloc = KVAllocator(num_blocks, block_size, enable_prefix_caching=caching,
                                 enable_kv_events=events, hash_algo=algo)
        self.bs = block_size
        self.algo = algo

    # ---- helpers: what a scheduler and a model runner do ----------------------------------

    def snapshot(self) -> tuple:
        a = self.alloc
        return (
            a.free_block_ids(),
            {h: b.block_id for h, b in a._hash_to_block.items()},
            {rid: a.block_ids(rid) for rid in a._requests},
            [(b.ref_cnt, b.block_hash) for b in a._blocks],
            len(a._pool.events),
        )

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def compute(self, req: FakeRequest, n: int) -> None:
        """The model writes the KV of the next ``n`` tokens into their slots."""
        table = self.alloc.block_ids(req.request_id)
        start = req.num_computed_tokens
        assert len(table) * self.bs >= start + n
        for pos in range(start, start + n):
            self.shadow[self.slot(table, pos)] = (req.cache_salt, req.all_token_ids[pos])
        req.num_computed_tokens += n
        num_full = req.num_computed_tokens // self.bs
        for i, h in enumerate(chain_hashes(req.all_token_ids, self.bs, num_full, req.cache_salt, self.algo)):
            self.block_tokens[h] = tuple((req.cache_salt, t) for t in req.all_token_ids[i * self.bs:(i + 1) * self.bs])

    def check_hit(self, req: FakeRequest, hit_ids: list[int], num_hit: int) -> None:
        assert num_hit == len(hit_ids) * self.bs
        assert num_hit <= req.num_tokens - 1
        assert 0 not in hit_ids
        for i, block_id in enumerate(hit_ids):
            for j in range(self.bs):
                assert self.shadow.get(block_id * self.bs + j) == (req.cache_salt, req.all_token_ids[i * self.bs + j])
        if not self.alloc.enable_prefix_caching:
            assert hit_ids == []
            return
        # The hit is the longest cached chain below the cap.
        cap = (req.num_tokens - 1) // self.bs
        hashes = chain_hashes(req.all_token_ids, self.bs, min(cap, len(hit_ids) + 1), req.cache_salt,
                              self.algo)
        cache = self.alloc._hash_to_block
        assert [cache[h].block_id for h in hashes[:len(hit_ids)]] == hit_ids
        assert len(hashes) == len(hit_ids) or hashes[-1] not in cache
        if hit_ids:
            event("prefix hit")

    def admit(self, req: FakeRequest, chunk: int) -> None:
        hit_ids, num_hit = self.alloc.get_computed_blocks(req)
        self.check_hit(req, hit_ids, num_hit)
        n = min(chunk, req.num_tokens - num_hit)
        before = self.snapshot()
        free_before = set(self.alloc.free_block_ids())
        new_ids = self.alloc.allocate(req, n, hit_ids, num_hit)
        if new_ids is None:
            assert self.snapshot() == before
            event("admission refused")
            self.waiting.append(req)
            return
        assert set(new_ids) <= free_before
        assert self.alloc.block_ids(req.request_id) == hit_ids + new_ids
        req.num_computed_tokens = num_hit
        self.compute(req, n)
        self.running[req.request_id] = req

    def grow(self, req: FakeRequest, n: int) -> None:
        """Allocate for a running request; preempt it when the pool is short."""
        before = self.snapshot()
        num_held = len(self.alloc.block_ids(req.request_id))
        new_ids = self.alloc.allocate(req, n)
        if new_ids is None:
            assert self.snapshot() == before
            self.release(req, preempt=True)
            return
        assert self.alloc.block_ids(req.request_id)[num_held:] == new_ids
        self.compute(req, n)

    def release(self, req: FakeRequest, preempt: bool) -> None:
        table = self.alloc.block_ids(req.request_id)
        del self.running[req.request_id]
        still_held = {b for r in self.running for b in self.alloc.block_ids(r)}
        released = [b for b in reversed(table) if b not in still_held]
        self.alloc.free(req.request_id)
        free = self.alloc.free_block_ids()
        assert free[len(free) - len(released):] == released
        if preempt:
            req.num_computed_tokens = 0
            self.waiting.append(req)
            event("preempted")

    def pick(self, candidates: list[FakeRequest], index: int) -> FakeRequest:
        return sorted(candidates, key=lambda r: r.request_id)[index % len(candidates)]

    def prefilling(self) -> list[FakeRequest]:
        return [r for r in self.running.values() if r.num_computed_tokens < r.num_tokens]

    def decoding(self) -> list[FakeRequest]:
        return [r for r in self.running.values() if r.num_computed_tokens == r.num_tokens]

    # ---- rules ---------------------------------------------------------------------------

    @rule(base=PICK, prefix_len=st.integers(0, 16),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=12), chunk=st.integers(1, 12),
          salt=st.sampled_from([None, None, "lora:1:a", "lora:2:b"]))
    def add_request(self, base: int, prefix_len: int, suffix: list[int], chunk: int, salt: str | None) -> None:
        prompt = self.prompts[base % len(self.prompts)][:prefix_len] if self.prompts else []
        prompt = (prompt + suffix) or [0]
        self.prompts.append(prompt)
        self.next_id += 1
        self.admit(FakeRequest(f"r{self.next_id}", prompt, cache_salt=salt), chunk)

    @precondition(lambda self: self.waiting)
    @rule(index=PICK, chunk=st.integers(1, 12))
    def resume(self, index: int, chunk: int) -> None:
        req = self.pick(self.waiting, index)
        self.waiting.remove(req)
        self.admit(req, chunk)

    @precondition(lambda self: self.prefilling())
    @rule(index=PICK, chunk=st.integers(1, 12))
    def continue_prefill(self, index: int, chunk: int) -> None:
        req = self.pick(self.prefilling(), index)
        self.grow(req, min(chunk, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.decoding())
    @rule(index=PICK, token=st.integers(0, VOCAB - 1))
    def decode(self, index: int, token: int) -> None:
        req = self.pick(self.decoding(), index)
        req.all_token_ids.append(token)  # sampled last step
        self.grow(req, 1)

    @precondition(lambda self: self.decoding())
    @rule(index=PICK, token=st.integers(0, VOCAB - 1), drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                        max_size=6), data=st.data())
    def speculate(self, index: int, token: int, drafts: list[int], data: st.DataObject) -> None:
        """Speculative decoding: slots for the sampled token and its drafts, whose KV the model writes;
        a prefix of the drafts is accepted and the rejected ones' positions are taken back (their
        slots stay with the request and are overwritten by its next tokens)."""
        req = self.pick(self.decoding(), index)
        req.all_token_ids.append(token)  # sampled last step
        before = self.snapshot()
        num_held = len(self.alloc.block_ids(req.request_id))
        new_ids = self.alloc.allocate(req, 1 + len(drafts))
        if new_ids is None:
            assert self.snapshot() == before
            self.grow(req, 1)  # decodes without drafts (or is preempted)
            return
        assert self.alloc.block_ids(req.request_id)[num_held:] == new_ids
        table = self.alloc.block_ids(req.request_id)
        start = req.num_computed_tokens
        for pos, draft in enumerate(drafts, start + 1):
            self.shadow[self.slot(table, pos)] = (req.cache_salt, draft)
        accepted = data.draw(st.integers(0, len(drafts)), label="accepted")
        req.all_token_ids.extend(drafts[:accepted])
        self.compute(req, 1 + accepted)  # rewrites what the step wrote for these positions
        event("drafts all accepted" if accepted == len(drafts) else "drafts rejected")

    @precondition(lambda self: self.running)
    @rule(index=PICK, chunk=st.integers(1, 12), token=st.integers(0, VOCAB - 1))
    def preempt_in_the_step_that_allocated(self, index: int, chunk: int, token: int) -> None:
        """A scheduler may allocate for a request, then preempt it before the step runs."""
        req = self.pick(list(self.running.values()), index)
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(token)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self.alloc.allocate(req, n) is not None:
            event("preempted after allocating")
            self.release(req, preempt=True)

    @precondition(lambda self: self.running)
    @rule(index=PICK)
    def finish(self, index: int) -> None:
        self.release(self.pick(list(self.running.values()), index), preempt=False)

    @precondition(lambda self: self.running)
    @rule(index=PICK)
    def preempt(self, index: int) -> None:
        self.release(self.pick(list(self.running.values()), index), preempt=True)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.alloc.reset_prefix_cache() == (not self.running)

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.alloc.check_integrity()

    @invariant()
    def running_requests_read_their_own_tokens(self) -> None:
        for req in self.running.values():
            table = self.alloc.block_ids(req.request_id)
            for pos in range(req.num_computed_tokens):
                assert self.shadow[self.slot(table, pos)] == (req.cache_salt, req.all_token_ids[pos])

    @invariant()
    def capacity(self) -> None:
        held = {b for r in self.running for b in self.alloc.block_ids(r)}
        assert all(0 < b < self.alloc.num_blocks for b in held)
        assert len(held) + self.alloc.num_free_blocks == self.alloc.num_blocks - 1
        for req in self.waiting:
            assert self.alloc.block_ids(req.request_id) == []
        if not self.running:
            assert self.alloc.num_free_blocks == self.alloc.num_blocks - 1
            assert self.alloc.usage == 0.0

    @invariant()
    def cached_blocks_hold_the_tokens_hashed(self) -> None:
        for h, block in self.alloc._hash_to_block.items():
            base = block.block_id * self.bs
            assert h in self.block_tokens, f"block {block.block_id} is cached but its tokens never ran"
            assert tuple(self.shadow.get(base + j) for j in range(self.bs)) == self.block_tokens[h]

    @invariant()
    def events_replay_to_the_cache(self) -> None:
        for ev in self.alloc.take_events():
            if isinstance(ev, BlockStored):
                tokens = ev.token_ids
                assert len(tokens) == len(ev.block_hashes) * self.bs
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    extra = (ev.cache_salt,) if parent is None and ev.cache_salt else ()  # a sequence's first block
                    parent = hash_block(parent, tokens[i * self.bs:(i + 1) * self.bs], extra, self.algo)
                    assert parent == h
                    assert h not in self.cached_from_events
                    self.cached_from_events.add(h)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.cached_from_events
                self.cached_from_events.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.cached_from_events.clear()
        if self.alloc.enable_kv_events:
            assert self.cached_from_events == set(self.alloc._hash_to_block)


TestKVAllocatorStateMachine = KVAllocatorMachine.TestCase
TestKVAllocatorStateMachine.settings = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
