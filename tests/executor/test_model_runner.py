"""The model runner's input preparation and persistent batch, through ``ModelRunner.execute_model``.

A spy model and a spy attention backend take the place of the real ones (the runner only calls
``backend.build_metadata(layout, device)`` and ``model(input_ids, positions, kv_caches, metadata,
logits_indices)``), so every step's token ids, positions, slots, block table, lengths and sampled
rows are checked exactly. The spy model's logits put all the mass on ``(input id + position) % V`` of
each sampled row, so greedy sampling tells which row the runner sampled, and the next decode step
shows which token the runner appended.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cadence.backends.base import BatchLayout
from cadence.executor.model_runner import CachedRequestState, ModelRunner
from cadence.executor.sampler import Sampler, SamplerOutput
from cadence.executor.sampling_plan import SamplingRow
from cadence.messages import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from cadence.sampling_params import SamplingParams

V = 64
BLOCK_SIZE = 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


# ---- spies -----------------------------------------------------------------------------------


@dataclass
class Forward:
    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]
    kv_caches: Any
    metadata: Any


class SpyBackend:
    """Records each step's layout; the metadata it returns is the layout itself."""

    def __init__(self) -> None:
        self.layouts: list[BatchLayout] = []

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> BatchLayout:
        self.layouts.append(layout)
        return layout


class SpyModel:
    """Logits of each sampled row: 1 at ``(input id + position) % V``, 0 elsewhere."""

    def __init__(self) -> None:
        self.calls: list[Forward] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, metadata: Any,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        assert input_ids.dtype == positions.dtype == logits_indices.dtype == torch.long
        self.calls.append(Forward(input_ids.tolist(), positions.tolist(), logits_indices.tolist(), kv_caches,
                                  metadata))
        chosen = (input_ids[logits_indices] + positions[logits_indices]) % V
        logits = torch.zeros(len(chosen), V)
        logits[torch.arange(len(chosen)), chosen] = 1.0
        return logits


class SpySampler(Sampler):
    """Records the rows the runner hands to the sampler."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[SamplingRow]] = []

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        self.rows.append(list(rows))
        return super().__call__(logits, rows)


def next_token(token: int, position: int) -> int:
    return (token + position) % V


class Harness:
    def __init__(self, layer_groups: list[int] | None = None) -> None:
        self.model = SpyModel()
        self.backend = SpyBackend()
        self.sampler = SpySampler()
        self.kv_caches = [(torch.zeros(1), torch.zeros(1)) for _ in layer_groups or [0]]
        self.runner = ModelRunner(self.model, self.backend, self.kv_caches, BLOCK_SIZE, CPU,  # type: ignore[arg-type]
                                  self.sampler, layer_groups)

    def run(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(step)

    @property
    def forward(self) -> Forward:
        return self.model.calls[-1]

    @property
    def layout(self) -> BatchLayout:
        return self.backend.layouts[-1]


def new(request_id: str, token_ids: list[int], block_ids: list[int], num_prompt_tokens: int | None = None,
        num_computed_tokens: int = 0, params: SamplingParams = GREEDY, eos: int | None = None) -> NewRequestData:
    return NewRequestData(
        request_id=request_id,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
        sampling_params=params,
        eos_token_id=eos,
        block_ids=[block_ids],  # one KV cache group
        num_computed_tokens=num_computed_tokens,
    )


def cached(request_id: str, num_computed_tokens: int, new_block_ids: Sequence[int] = ()) -> CachedRequestData:
    return CachedRequestData(request_id, [list(new_block_ids)], num_computed_tokens)


def step(step_id: int, scheduled: dict[str, int], new_requests: Sequence[NewRequestData] = (),
         cached_requests: Sequence[CachedRequestData] = (), finished: Sequence[str] = (),
         preempted: Sequence[str] = (), grammar_bitmask: GrammarBitmask | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        new_requests=list(new_requests),
        cached_requests=list(cached_requests),
        num_scheduled_tokens=scheduled,
        finished_request_ids=list(finished),
        preempted_request_ids=list(preempted),
        grammar_bitmask=grammar_bitmask,
    )


def assert_layout(layout: BatchLayout, *, query_start_loc: list[int], seq_lens: list[int],
                  block_table: list[list[int]], slot_mapping: list[int]) -> None:
    assert layout.query_start_loc.tolist() == query_start_loc
    assert layout.seq_lens.tolist() == seq_lens
    assert layout.block_table.tolist() == block_table
    assert layout.slot_mapping.tolist() == slot_mapping
    query_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    assert layout.max_query_len == max(query_lens)
    assert layout.max_seq_len == max(seq_lens)
    assert layout.query_start_loc.dtype == layout.seq_lens.dtype == layout.block_table.dtype == torch.int32
    assert layout.slot_mapping.dtype == torch.int64


# Prompts used throughout: "a" fits one block with room to decode, "b" fills a block and spills over.
A = [10, 11, 12]
B = [20, 21, 22, 23, 24]


def prefill_a_and_b(h: Harness) -> ModelRunnerOutput:
    return h.run(step(1, {"a": 3, "b": 5}, [new("a", A, [3]), new("b", B, [5, 2])]))


# ---- new requests ----------------------------------------------------------------------------


def test_prefill_of_new_requests_lays_out_tokens_positions_slots_and_blocks() -> None:
    h = Harness()
    out = prefill_a_and_b(h)

    assert h.forward.input_ids == A + B
    assert h.forward.positions == [0, 1, 2, 0, 1, 2, 3, 4]
    # slot = block_id * block_size + offset: a in block 3; b in block 5, then position 4 in block 2.
    assert_layout(h.layout, query_start_loc=[0, 3, 8], seq_lens=[3, 5], block_table=[[3, 0], [5, 2]],
                  slot_mapping=[12, 13, 14, 20, 21, 22, 23, 8])
    assert h.forward.logits_indices == [2, 7]  # each request's last token
    assert h.forward.kv_caches is h.kv_caches and h.forward.metadata == [h.layout]  # one layer

    assert out.step_id == 1
    assert out.request_ids == ["a", "b"]
    assert out.sampled_token_ids == [next_token(12, 2), next_token(24, 4)] == [14, 28]
    assert out.logprobs is None

    a, b = h.runner.states["a"], h.runner.states["b"]
    assert (a.prompt_token_ids, a.output_token_ids, a.block_ids, a.num_computed_tokens) == (A, [14], [[3]], 3)
    assert (b.prompt_token_ids, b.output_token_ids, b.block_ids, b.num_computed_tokens) == (B, [28], [[5, 2]], 5)


def test_each_kv_cache_group_has_its_own_block_table_and_each_layer_gets_its_groups_metadata() -> None:
    """Layers 0 and 2 in group 0, layer 1 in group 1 (a hybrid model): one layout per group, with
    the same tokens and lengths and the group's own blocks; deltas extend each group's table."""
    h = Harness(layer_groups=[0, 1, 0])
    h.run(step(1, {"a": 3, "b": 5}, [NewRequestData("a", A, 3, GREEDY, None, [[3], [4]], 0),
                                     NewRequestData("b", B, 5, GREEDY, None, [[5, 2], [7, 9]], 0)]))
    first, second = h.backend.layouts
    assert_layout(first, query_start_loc=[0, 3, 8], seq_lens=[3, 5], block_table=[[3, 0], [5, 2]],
                  slot_mapping=[12, 13, 14, 20, 21, 22, 23, 8])
    assert_layout(second, query_start_loc=[0, 3, 8], seq_lens=[3, 5], block_table=[[4, 0], [7, 9]],
                  slot_mapping=[16, 17, 18, 28, 29, 30, 31, 36])
    assert h.forward.metadata == [first, second, first]

    h.run(step(2, {"a": 1, "b": 1}, cached_requests=[CachedRequestData("a", [[8], [6]], 3),
                                                     CachedRequestData("b", [[], []], 5)]))
    first, second = h.backend.layouts[2:]
    assert first.block_table.tolist() == [[3, 8], [5, 2]] and first.slot_mapping.tolist() == [15, 9]
    assert second.block_table.tolist() == [[4, 6], [7, 9]] and second.slot_mapping.tolist() == [19, 37]
    assert h.forward.metadata == [first, second, first]


def test_batch_order_is_the_order_of_num_scheduled_tokens() -> None:
    """Not the order of new_requests: the scheduler's dict fixes the rows."""
    h = Harness()
    out = h.run(step(1, {"b": 5, "a": 3}, [new("a", A, [3]), new("b", B, [5, 2])]))
    assert h.forward.input_ids == B + A
    assert h.forward.positions == [0, 1, 2, 3, 4, 0, 1, 2]
    assert_layout(h.layout, query_start_loc=[0, 5, 8], seq_lens=[5, 3], block_table=[[5, 2], [3, 0]],
                  slot_mapping=[20, 21, 22, 23, 8, 12, 13, 14])
    assert h.forward.logits_indices == [4, 7]
    assert out.request_ids == ["b", "a"] and out.sampled_token_ids == [28, 14]


def test_a_new_request_over_a_prefix_cache_hit_computes_only_the_rest() -> None:
    h = Harness()
    prompt = [40, 41, 42, 43, 44, 45]
    out = h.run(step(1, {"p": 2}, [new("p", prompt, [7, 9], num_computed_tokens=4)]))
    assert h.forward.input_ids == [44, 45]
    assert h.forward.positions == [4, 5]
    assert_layout(h.layout, query_start_loc=[0, 2], seq_lens=[6], block_table=[[7, 9]], slot_mapping=[36, 37])
    assert out.sampled_token_ids == [next_token(45, 5)]


# ---- running requests ------------------------------------------------------------------------


def test_decode_steps_feed_the_tokens_the_runner_sampled_itself() -> None:
    h = Harness()
    prefill_a_and_b(h)  # a -> 14, b -> 28

    out = h.run(step(2, {"a": 1, "b": 1}, cached_requests=[cached("a", 3), cached("b", 5)]))
    assert h.forward.input_ids == [14, 28]  # no token ids from the scheduler: the runner's own
    assert h.forward.positions == [3, 5]
    assert_layout(h.layout, query_start_loc=[0, 1, 2], seq_lens=[4, 6], block_table=[[3, 0], [5, 2]],
                  slot_mapping=[15, 9])
    assert h.forward.logits_indices == [0, 1]
    assert out.request_ids == ["a", "b"] and out.sampled_token_ids == [next_token(14, 3), next_token(28, 5)]

    # a's fifth token needs a new block, which the scheduler sends as a delta.
    out = h.run(step(3, {"a": 1, "b": 1}, cached_requests=[cached("a", 4, [7]), cached("b", 6)]))
    assert h.forward.input_ids == [17, 33]
    assert h.forward.positions == [4, 6]
    assert_layout(h.layout, query_start_loc=[0, 1, 2], seq_lens=[5, 7], block_table=[[3, 7], [5, 2]],
                  slot_mapping=[28, 10])
    assert out.sampled_token_ids == [next_token(17, 4), next_token(33, 6)] == [21, 39]

    a = h.runner.states["a"]
    assert a.output_token_ids == [14, 17, 21] and a.block_ids == [[3, 7]] and a.num_computed_tokens == 5
    assert h.runner.states["b"].output_token_ids == [28, 33, 39]


def test_chunked_prefill_samples_only_once_the_prompt_is_done() -> None:
    h = Harness()
    c = [30, 31, 32, 33, 34, 35]
    out = h.run(step(1, {"a": 3, "c": 4}, [new("a", A, [3]), new("c", c, [6])]))
    assert h.forward.input_ids == A + c[:4]
    assert h.forward.positions == [0, 1, 2, 0, 1, 2, 3]
    assert_layout(h.layout, query_start_loc=[0, 3, 7], seq_lens=[3, 4], block_table=[[3], [6]],
                  slot_mapping=[12, 13, 14, 24, 25, 26, 27])
    assert h.forward.logits_indices == [2]  # c's chunk does not reach its end
    assert out.request_ids == ["a"] and out.sampled_token_ids == [14]
    assert h.runner.states["c"].output_token_ids == [] and h.runner.states["c"].num_computed_tokens == 4

    # c's second chunk (a new block) beside a's decode, in the scheduler's order: c first.
    out = h.run(step(2, {"c": 2, "a": 1}, cached_requests=[cached("c", 4, [9]), cached("a", 3)]))
    assert h.forward.input_ids == [34, 35, 14]
    assert h.forward.positions == [4, 5, 3]
    assert_layout(h.layout, query_start_loc=[0, 2, 3], seq_lens=[6, 4], block_table=[[6, 9], [3, 0]],
                  slot_mapping=[36, 37, 15])
    assert h.forward.logits_indices == [1, 2]
    assert out.request_ids == ["c", "a"]
    assert out.sampled_token_ids == [next_token(35, 5), next_token(14, 3)] == [40, 17]


def test_a_step_of_partial_prefills_only_runs_the_model_and_samples_nothing() -> None:
    h = Harness()
    out = h.run(step(4, {"c": 4}, [new("c", [30, 31, 32, 33, 34, 35], [6])]))
    assert h.forward.input_ids == [30, 31, 32, 33] and h.forward.logits_indices == []
    assert (out.step_id, out.request_ids, out.sampled_token_ids, out.logprobs) == (4, [], [], None)
    assert h.sampler.rows == []  # the sampler is not called
    assert h.runner.states["c"].num_computed_tokens == 4


# ---- requests leaving and coming back --------------------------------------------------------


def test_finished_requests_are_dropped_before_the_step_runs() -> None:
    h = Harness()
    prefill_a_and_b(h)
    # "gone" never reached the worker (aborted while waiting): dropping it is not an error.
    out = h.run(step(2, {"a": 1}, cached_requests=[cached("a", 3)], finished=["b", "gone"]))
    assert set(h.runner.states) == {"a"}
    assert h.forward.input_ids == [14]
    assert out.request_ids == ["a"]


def test_an_empty_step_updates_the_batch_without_running_the_model() -> None:
    h = Harness()
    prefill_a_and_b(h)
    out = h.run(step(2, {}, finished=["a"], preempted=["b"]))
    assert (out.step_id, out.request_ids, out.sampled_token_ids) == (2, [], [])
    assert h.runner.states == {}
    assert len(h.model.calls) == len(h.backend.layouts) == 1  # the first step's only


@pytest.mark.parametrize("num_computed_tokens", [0, 4], ids=["recompute", "prefix-hit"])
def test_a_preempted_request_comes_back_whole_with_its_outputs(num_computed_tokens: int) -> None:
    h = Harness()
    h.run(step(1, {"a": 3}, [new("a", A, [3])]))  # -> 14
    h.run(step(2, {"a": 1}, cached_requests=[cached("a", 3)]))  # -> 17
    h.run(step(3, {}, preempted=["a"]))
    assert "a" not in h.runner.states

    # Back as a new request: prompt + outputs so far, new blocks, maybe a prefix-cache hit.
    tokens = [*A, 14, 17]
    out = h.run(step(4, {"a": 5 - num_computed_tokens},
                     [new("a", tokens, [8, 11], num_prompt_tokens=3, num_computed_tokens=num_computed_tokens)]))
    positions = list(range(num_computed_tokens, 5))
    assert h.forward.input_ids == tokens[num_computed_tokens:]
    assert h.forward.positions == positions
    assert h.layout.slot_mapping.tolist() == [[8, 11][p // 4] * 4 + p % 4 for p in positions]
    assert h.layout.block_table.tolist() == [[8, 11]] and h.layout.seq_lens.tolist() == [5]
    assert out.sampled_token_ids == [next_token(17, 4)]
    # The sampler sees the outputs as outputs (penalties, seeds, min-tokens count them).
    (row,) = h.sampler.rows[-1]
    assert row.prompt_token_ids == A and row.output_token_ids == [14, 17]
    state = h.runner.states["a"]
    assert state.prompt_token_ids == A and state.output_token_ids == [14, 17, 21]


def test_a_request_preempted_and_resumed_in_the_same_step_starts_afresh() -> None:
    """The worker drops the preempted request before it adds the new ones."""
    h = Harness()
    h.run(step(1, {"a": 3}, [new("a", A, [3])]))  # -> 14
    out = h.run(step(2, {"a": 4}, [new("a", [*A, 14], [5], num_prompt_tokens=3)], preempted=["a"]))
    assert h.forward.input_ids == [*A, 14] and h.forward.positions == [0, 1, 2, 3]
    assert h.layout.slot_mapping.tolist() == [20, 21, 22, 23]
    assert out.sampled_token_ids == [next_token(14, 3)]
    assert h.runner.states["a"].output_token_ids == [14, 17] and h.runner.states["a"].block_ids == [[5]]


# ---- what reaches the sampler ----------------------------------------------------------------


def test_sampling_rows_carry_params_eos_and_history_of_the_sampled_requests_only() -> None:
    h = Harness()
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    h.run(step(1, {"a": 3, "c": 2}, [new("a", A, [3], params=params, eos=7), new("c", [1, 2, 3], [4])]))
    (row,) = h.sampler.rows[-1]  # c is mid-prefill
    assert row.params is params and row.eos_token_id == 7
    assert row.prompt_token_ids == A and row.output_token_ids == []
    h.run(step(2, {"a": 1, "c": 1}, cached_requests=[cached("a", 3), cached("c", 2)]))
    rows = h.sampler.rows[-1]
    assert [r.output_token_ids for r in rows] == [[14], []]
    assert rows[0].params is params and rows[1].params is GREEDY


def test_logprobs_of_a_sampled_row_come_back_in_the_output() -> None:
    h = Harness()
    out = h.run(step(1, {"a": 3, "b": 5}, [new("a", A, [3], params=SamplingParams(temperature=0.0, logprobs=0)),
                                          new("b", B, [5, 2])]))
    assert out.logprobs is not None and len(out.logprobs) == 2
    first, second = out.logprobs
    # One-hot logits over V tokens: log_softmax of the hot one is 1 - log(e + V - 1).
    hot = float(torch.log_softmax(torch.eye(V)[0], -1)[0])
    assert first.token_ids == [14] and first.logprobs == pytest.approx([hot], abs=1e-6)
    assert first.sampled_rank == 1
    assert second.token_ids == [28] and second.sampled_rank == 1  # did not ask: the sampled token only


def test_a_grammar_bitmask_is_applied_to_the_sampled_rows_by_request_id() -> None:
    pytest.importorskip("xgrammar")
    h = Harness()
    h.run(step(1, {"a": 3}, [new("a", A, [3])]))  # -> 14
    # c's partial prefill comes first but has no logits row: a's is row 0.
    allowed = 40
    bitmask = torch.zeros(1, V // 32, dtype=torch.int32)
    bitmask[0, allowed // 32] = 1 << (allowed % 32)
    out = h.run(step(2, {"c": 2, "a": 1}, [new("c", [1, 2, 3], [4])], [cached("a", 3)],
                     grammar_bitmask=GrammarBitmask(["a"], bitmask)))
    assert out.request_ids == ["a"]
    assert out.sampled_token_ids == [allowed]  # not the unconstrained argmax, 17
    assert h.runner.states["a"].output_token_ids == [14, allowed]


# ---- the cached request state ----------------------------------------------------------------


def test_cached_state_splits_prompt_and_outputs_and_copies_the_message() -> None:
    data = new("r", [1, 2, 3, 4, 5], [6, 7], num_prompt_tokens=3, num_computed_tokens=2, eos=0)
    state = CachedRequestState.from_new(data)
    assert (state.prompt_token_ids, state.output_token_ids) == ([1, 2, 3], [4, 5])
    assert state.num_tokens == 5 and state.num_computed_tokens == 2 and state.eos_token_id == 0
    state.append([9])
    state.block_ids[0].append(8)
    assert data.token_ids == [1, 2, 3, 4, 5] and data.block_ids == [[6, 7]]


@pytest.mark.parametrize(("start", "stop", "expected"), [
    (0, 3, [1, 2, 3]), (1, 5, [2, 3, 4, 5]), (2, 4, [3, 4]), (3, 5, [4, 5]), (4, 5, [5]), (0, 5, [1, 2, 3, 4, 5]),
])
def test_token_slice_spans_prompt_and_outputs(start: int, stop: int, expected: list[int]) -> None:
    state = CachedRequestState.from_new(new("r", [1, 2, 3, 4, 5], [1, 2], num_prompt_tokens=3))
    assert state.token_slice(start, stop) == expected


def test_sampling_row_is_kept_until_a_token_is_appended() -> None:
    state = CachedRequestState.from_new(new("r", [1, 2, 3, 4], [1], num_prompt_tokens=3, eos=2))
    row = state.sampling_row()
    assert state.sampling_row() is row
    assert (row.prompt_token_ids, row.output_token_ids, row.eos_token_id) == ([1, 2, 3], [4], 2)
    state.append([6])
    fresh = state.sampling_row()
    assert fresh is not row and fresh.output_token_ids == [4, 6]
    assert row.output_token_ids == [4]  # the earlier row is a snapshot
