"""The sampler's stages one by one: the plan a batch's params become (``build_plan``), the logit
processing it drives (``process_logits``), token choice (``choose_tokens``) and logprobs
(``gather_logprobs``). tests/executor/test_sampler.py covers the composed ``Sampler`` (distributions, seeds
across steps, logprobs through it); here each stage is checked on its own, with exact values."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cadence.executor import token_choice
from cadence.executor.sampler import Sampler
from cadence.executor.sampling_plan import SamplingRow, Workspace, build_plan, process_logits
from cadence.executor.token_choice import choose_tokens, gather_logprobs
from cadence.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
INF = math.inf


def row(params: SamplingParams = GREEDY, prompt: list[int] | None = None, output: list[int] | None = None,
        eos: int | None = None) -> SamplingRow:
    return SamplingRow(params, [1] if prompt is None else prompt, output or [], eos)


def process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return process_logits(logits, rows, build_plan(rows, logits.shape[1], CPU), Workspace())


def choose(logits: torch.Tensor, rows: list[SamplingRow], owned: bool = False) -> list[int]:
    return choose_tokens(logits, owned, rows, build_plan(rows, logits.shape[1], CPU), Workspace()).tolist()


# ---- build_plan ------------------------------------------------------------------------------


def test_an_all_greedy_batch_plans_nothing_but_argmax() -> None:
    plan = build_plan([row(), row(SamplingParams(temperature=1e-6))], 10, CPU)
    assert plan.random is None and plan.greedy_idx is None and plan.random_idx is None
    assert plan.bias is None and plan.min_tokens == [] and plan.penalties is None and plan.logprobs_k is None


def test_a_mixed_batch_plans_each_sampled_rows_settings_in_order() -> None:
    rows = [
        row(),
        row(SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)),
        row(SamplingParams(logprobs=2)),
        row(SamplingParams(top_k=10, seed=7)),  # top_k at the vocabulary size keeps everything: off
    ]
    plan = build_plan(rows, 10, CPU)
    assert plan.greedy_idx is not None and plan.random_idx is not None and plan.random is not None
    assert plan.greedy_idx.tolist() == [0] and plan.random_idx.tolist() == [1, 2, 3]
    random = plan.random
    assert random.temperature is not None and random.temperature.tolist() == [[0.5], [1.0], [1.0]]
    assert random.log_min_p is not None
    assert random.log_min_p[0, 0].item() == pytest.approx(math.log(0.1)) and random.log_min_p[1:].isneginf().all()
    assert random.top_k_index is not None and random.top_k_index.tolist() == [[2], [0], [0]]
    assert random.top_k_off is not None and random.top_k_off.tolist() == [[False], [True], [True]]
    assert random.top_k_max == 3
    assert random.top_p_rows is not None and random.top_p_rows.tolist() == [0]  # among the sampled rows
    assert random.top_p is not None and random.top_p.tolist() == pytest.approx([0.9])
    assert not random.top_p_all
    assert random.seeded == [(2, 3, 7)]  # (position among the sampled rows, batch row, seed)
    assert plan.logprobs_k == [0, 0, 2, 0]


def test_neutral_sampling_settings_plan_no_tensors() -> None:
    plan = build_plan([row(SamplingParams()), row(SamplingParams(top_k=-1))], 10, CPU)
    assert plan.greedy_idx is None and plan.random_idx is None  # not mixed: no index tensors
    random = plan.random
    assert random is not None
    assert random.temperature is None and random.log_min_p is None and random.top_k_index is None
    assert random.top_k_off is None and random.top_p_rows is None and random.top_p is None
    assert random.seeded == []


def test_bias_min_tokens_and_penalties_are_planned_per_row() -> None:
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={4: 1.5, 2: -3.0})),
        row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5, 6]), eos=9),
        row(SamplingParams(temperature=0.0, min_tokens=1), eos=None),  # nothing to mask
        row(SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={1: 2.0})),
    ]
    plan = build_plan(rows, 10, CPU)
    assert plan.bias is not None
    assert [t.tolist() for t in plan.bias] == [[0, 0, 3], [4, 2, 1], [1.5, -3.0, 2.0]]
    assert plan.min_tokens == [(1, 2, [5, 6, 9]), (2, 1, [])]
    penalties = plan.penalties
    assert penalties is not None and penalties.rows == [3]
    assert penalties.repetition is None  # every repetition penalty is 1
    assert penalties.frequency is not None and penalties.frequency.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert penalties.presence is not None and penalties.presence.tolist() == [0.0, 0.0, 0.0, 0.5]


def test_a_plan_matches_the_same_params_objects_only() -> None:
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(top_k=3)]
    rows = [row(params[0], eos=1), row(params[1], eos=2)]
    plan = build_plan(rows, 10, CPU)
    assert plan.matches([row(params[0], output=[4], eos=1), row(params[1], output=[5], eos=2)], 10, CPU)
    assert plan.matches([row(params[0], eos=1), row(params[1], eos=8)], 10, CPU)  # row 1 masks nothing
    assert not plan.matches([row(params[0], eos=3), row(params[1], eos=2)], 10, CPU)  # a masked eos changed
    assert not plan.matches([row(SamplingParams(temperature=0.0, min_tokens=2), eos=1), rows[1]], 10, CPU)
    assert not plan.matches(rows, 11, CPU)
    assert not plan.matches(rows[:1], 10, CPU)


# ---- process_logits --------------------------------------------------------------------------


def test_nothing_to_process_returns_the_logits_themselves() -> None:
    logits = torch.randn(2, 8)
    rows = [row(SamplingParams(temperature=0.7, top_k=2)), row(SamplingParams(min_tokens=3), output=[1])]
    assert process(logits, rows) is logits  # min_tokens without eos or stop ids masks nothing


def test_logit_bias_adds_to_its_rows_and_leaves_the_input() -> None:
    logits = torch.arange(12, dtype=torch.float32).view(2, 6)
    before = logits.clone()
    got = process(logits, [row(), row(SamplingParams(temperature=0.0, logit_bias={0: -100.0, 5: 0.25, 3: 2.0}))])
    assert torch.equal(logits, before)
    assert torch.equal(got, torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [-94.0, 7.0, 8.0, 11.0, 10.0, 11.25]]))


@pytest.mark.parametrize(("outputs", "masked"), [(0, True), (2, True), (3, False)])
def test_min_tokens_masks_eos_and_stop_ids_until_enough_are_out(outputs: int, masked: bool) -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1, 3])
    got = process(logits, [row(params, output=[0] * outputs, eos=4)])
    if not masked:
        assert got is logits
    else:
        assert torch.equal(got, torch.tensor([[1.0, -INF, 3.0, -INF, -INF]]))


def test_penalties_use_each_rows_own_factors_and_history() -> None:
    logits = torch.tensor([
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        [0.5, 0.25, 0.75, 1.0, 1.25, 1.5],
        [1.0, 2.0, -1.0, 0.0, 4.0, -3.0],
        [3.0, 1.0, 1.0, 0.0, -1.5, 0.5],
    ])
    rows = [
        # repetition over prompt and output: positive / 2, negative * 2
        row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0], output=[3, 4]),
        # no penalty: its history is not looked at
        row(prompt=[2], output=[1, 1, 1]),
        # frequency per occurrence and presence once, over the output only (prompt 0 and 5 untouched)
        row(SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0), prompt=[0, 5],
            output=[1, 1, 4, 2]),
        # repetition (0 stays 0) then a negative presence penalty, which rewards
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=-0.5), prompt=[3], output=[0]),
    ]
    expected = torch.tensor([
        [1.0, -1.0, 0.5, 1.5, -4.0, 1.0],
        [0.5, 0.25, 0.75, 1.0, 1.25, 1.5],
        [1.0, 2.0 - 2 * 0.5 - 1.0, -1.0 - 0.5 - 1.0, 0.0, 4.0 - 0.5 - 1.0, -3.0],
        [3.0 / 1.5 + 0.5, 1.0, 1.0, 0.0, -1.5, 0.5],
    ])
    assert torch.equal(process(logits, rows), expected)


def test_stages_run_in_order_bias_then_mask_then_penalties() -> None:
    logits = torch.tensor([[0.5, 1.0, -1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logit_bias={1: 2.0, 2: -1.0}, repetition_penalty=2.0, min_tokens=2)
    got = process(logits, [row(params, prompt=[1, 2], output=[0], eos=3)])
    # bias: [0.5, 3.0, -2.0, 2.0]; mask eos: [.., -inf]; repetition on {0, 1, 2}.
    assert torch.equal(got, torch.tensor([[0.25, 1.5, -4.0, -INF]]))


def test_workspace_buffers_are_reused_for_smaller_batches() -> None:
    ws = Workspace()
    big = ws.take("x", torch.empty(4, 8))
    small = ws.take("x", torch.empty(2, 8))
    assert small.shape == (2, 8) and small.data_ptr() == big.data_ptr()
    assert ws.take("y", torch.empty(2, 8)).data_ptr() != big.data_ptr()  # one buffer per role
    wider = ws.take("x", torch.empty(2, 9))
    assert wider.shape == (2, 9) and wider.dtype == torch.float32


# ---- choose_tokens ---------------------------------------------------------------------------


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(5, 32, generator=torch.Generator().manual_seed(3)) * 2


def test_greedy_rows_take_the_argmax(logits: torch.Tensor) -> None:
    assert choose(logits, [row()] * 5) == logits.argmax(-1).tolist()


def test_top_k_one_and_a_tiny_top_p_take_the_argmax_beside_other_rows(logits: torch.Tensor) -> None:
    """Only some sampled rows truncate (top_k_off, top_p on a subset of rows), next to greedy rows."""
    rows = [
        row(SamplingParams(temperature=3.0, top_k=1)),
        row(SamplingParams(temperature=3.0)),
        row(),
        row(SamplingParams(temperature=3.0, top_p=1e-6, seed=5)),
        row(SamplingParams(temperature=0.5, top_k=1, top_p=0.3)),
    ]
    argmax = logits.argmax(-1).tolist()
    torch.manual_seed(0)
    for _ in range(5):
        got = choose(logits, rows)
        assert [got[i] for i in (0, 2, 3, 4)] == [argmax[i] for i in (0, 2, 3, 4)]


def test_choosing_without_ownership_leaves_the_logits_and_draws_the_same(logits: torch.Tensor) -> None:
    rows = [row(SamplingParams(temperature=0.7, top_k=8, min_p=0.05, top_p=0.9, seed=s)) for s in range(5)]
    before = logits.clone()
    borrowed = choose(logits, rows, owned=False)
    assert torch.equal(logits, before)
    assert choose(logits.clone(), rows, owned=True) == borrowed


def test_a_seeded_row_draws_the_same_whatever_its_neighbours_and_the_global_seed(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=1.5, seed=1234)
    target = logits[0]
    alone = []
    for length in range(6):  # the seed stream advances with the output length
        torch.manual_seed(length)
        alone.append(choose(target[None].clone(), [row(params, output=[7] * length)])[0])
    assert len(set(alone)) > 1

    for length in range(6):
        torch.manual_seed(100 + length)
        position = length % 3
        batch = torch.cat([logits[1:1 + position], target[None], logits[1 + position:4]])
        rows = [row(SamplingParams(temperature=1.5)), row(), row(SamplingParams(seed=99, top_p=0.5))]
        rows.insert(position, row(params, output=[7] * length))
        assert choose(batch, rows)[position] == alone[length]


# ---- gather_logprobs -------------------------------------------------------------------------


def test_logprobs_are_exact_with_top_k_and_ranks() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [0.0, 2.0, 2.0, -1.0, 1.0], [5.0, 1.0, 1.0, 1.0, 1.0]])
    raw = torch.log_softmax(logits, -1)
    tokens = torch.tensor([2, 1, 4])
    got = gather_logprobs(raw, tokens, [2, 0, 1], Workspace())

    first, second, third = got
    assert first.token_ids == [2, 1, 2] and first.logprobs == raw[0, [2, 1, 2]].tolist()
    assert first.sampled_rank == 2
    assert second.token_ids == [1] and second.logprobs == [raw[1, 1].item()]
    assert second.sampled_rank == 1  # tied with token 2: only strictly better tokens rank above
    assert third.token_ids == [4, 0] and third.logprobs == raw[2, [4, 0]].tolist()
    assert third.sampled_rank == 2  # four-way tie behind token 0


def test_a_top_k_count_above_the_vocabulary_returns_every_token() -> None:
    raw = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0]]), -1)
    (entry,) = gather_logprobs(raw, torch.tensor([0]), [10], Workspace())
    assert entry.token_ids == [0, 1, 2, 0] and entry.sampled_rank == 3
    assert entry.logprobs == raw[0, [0, 1, 2, 0]].tolist()


# ---- top-p: bounded whatever the input -------------------------------------------------------


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test instead of hanging it should ``fn`` loop forever."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"did not finish within {seconds} s"
    return result[0]


@pytest.mark.parametrize("top_p", [1e-30, 1.5e-45], ids=["tiny", "smallest-float32"])
def test_a_tiny_top_p_takes_exactly_the_argmax_of_a_two_row_batch(top_p: float) -> None:
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(7))
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler()
    rows = [row(SamplingParams(temperature=1.0, top_p=top_p)), row(SamplingParams(temperature=5.0, top_p=top_p))]
    torch.manual_seed(0)
    for _ in range(20):
        assert within(30, lambda: sampler(logits, rows).token_ids) == argmax


def test_a_top_p_of_zero_forced_into_the_plan_ends_with_the_argmax() -> None:
    """SamplingParams refuses such a top_p; the sampler must end even so: a top_p of 0 rejects
    every draw, the most likely token included, until a row has nothing left to draw."""
    logits = torch.randn(5, 512, generator=torch.Generator().manual_seed(11)) * 2
    logits[3] = 1.0  # all tied: the first rejection empties the row
    logits[4] = -INF  # no probabilities at all (NaN after softmax)
    rows = [row(SamplingParams(top_p=0.5, seed=1)), row(), row(SamplingParams(top_p=0.9)),
            row(SamplingParams(top_p=0.3, seed=2)), row(SamplingParams(top_p=0.7))]
    plan = build_plan(rows, 512, CPU)
    assert plan.random is not None and plan.random.top_p is not None
    forced = dataclasses.replace(plan, random=dataclasses.replace(plan.random, top_p=torch.zeros(4),
                                                                  top_p_by_row=torch.zeros(4)))
    for seed in range(10):
        torch.manual_seed(seed)
        tokens = within(30, lambda: choose_tokens(logits.clone(), True, rows, forced, Workspace()).tolist())
        assert tokens == [*logits[:4].argmax(-1).tolist(), 0]


def test_rows_still_rejected_after_the_last_round_take_the_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    rows = [row(SamplingParams(top_p=0.9, seed=3)), row(SamplingParams(temperature=2.0)),
            row(SamplingParams(top_p=0.5))]
    torch.manual_seed(0)
    first = choose(logits, rows)  # with the usual bound: row 0 draws from a wide nucleus
    monkeypatch.setattr(token_choice, "_TOP_P_MAX_ROUNDS", 0)
    argmax = logits.argmax(-1).tolist()
    for _ in range(5):
        got = choose(logits, rows)
        assert (got[0], got[2]) == (argmax[0], argmax[2])
    assert first[0] != argmax[0]
