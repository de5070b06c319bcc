"""The engine's own step timing: what the engine-overhead figure of the benchmarks is made of."""

from __future__ import annotations

import pytest

from cadence import LLM, SamplingParams
from cadence.core.step_timing import StepTiming, TimingTotals


def test_totals_by_batch_size_and_overhead_fraction() -> None:
    timing = StepTiming()
    timing.record(64, wall_s=0.100, forward_s=0.090)
    timing.record(64, wall_s=0.100, forward_s=0.094)
    timing.record(8, wall_s=0.050, forward_s=0.025)
    assert timing.total.num_steps == 3
    big = timing.at_least(64)
    assert (big.num_steps, big.wall_s, big.forward_s) == (2, pytest.approx(0.2), pytest.approx(0.184))
    assert big.overhead_fraction == pytest.approx(0.08)
    assert timing.at_least(1).num_steps == 3 and timing.at_least(65).num_steps == 0
    assert TimingTotals().overhead_fraction == 0.0
    assert "engine overhead 8.0%" in big.summary()
    timing.reset()
    assert timing.total.num_steps == 0 and not timing.by_batch_size


def test_engine_records_every_step_with_its_batch_size(make_tiny_model) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32")
    prompts = [[5, 9, 2, 7], [4, 4, 6], [11, 12, 13]]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    timing = llm.engine_core.timing
    # Requests reach the engine one by one, so the first steps may run fewer; but every step gives
    # each of its requests one token (short prompts prefill whole), 6 tokens for each of 3 requests.
    assert sum(size * part.num_steps for size, part in timing.by_batch_size.items()) == 18
    assert max(timing.by_batch_size) == 3
    assert timing.total.num_steps == sum(part.num_steps for part in timing.by_batch_size.values())
    assert 0 < timing.total.forward_s < timing.total.wall_s
