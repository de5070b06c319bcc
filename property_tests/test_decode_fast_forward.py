"""The simulator's fast-forward (``cadence/sim/decode_run.py``) changes nothing a simulation reports.

Runs of decode-only steps taken in one call, and cut short by arrivals, must leave every step record,
every token's time, every finish and preemption exactly as the steps one by one: over random
workloads (bursts, arrivals on step boundaries, shared prefixes, the same prompt twice), KV pools
small enough to preempt, block sizes down to one token, prefix caching on and off, the step budget's
running refits, the policies that allow it and fleets behind the routers that route by load.
"""

from __future__ import annotations

from dataclasses import fields
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from cadence.core.cost_model import CostModel
from cadence.sim import decode_run, run_loop
from cadence.sim.simulator import EngineLimits, SimResult, simulate
from cadence.sim.workload import RequestSpec

_COST_MODELS = [
    CostModel.constant(0.001),  # every step ends on a millisecond: arrivals land on step boundaries
    CostModel.default(),
    CostModel({"const": 0.004, "decode_seqs": 0.0007, "kv_tokens": 3.1e-7, "prefill_tokens": 1.3e-4,
               "prefill_attn": 2e-9, "sampled": 1e-4}),
    # Rows under a quantized kernel's limit of 3 cost more: steps on both sides of it, in and out of runs.
    CostModel({"const": 0.004, "decode_seqs": 0.0003, "kv_tokens": 3.1e-7, "prefill_tokens": 1.3e-4,
               "kernel_rows": 0.0009, "sampled": 1e-4}, {"kernel_row_limit": 3}),
]


@st.composite
def _workloads(draw: st.DrawFn, max_len: int) -> list[RequestSpec]:
    prefix = tuple(range(5, 5 + draw(st.integers(0, 24))))  # shared by the requests that take it
    specs: list[RequestSpec] = []
    for i in range(draw(st.integers(1, 14))):
        arrival = draw(st.integers(0, 80)) / 1000  # on the millisecond grid, often together
        own = draw(st.integers(1, 30))
        prompt = (*prefix, *range(1000 * (i + 1), 1000 * (i + 1) + own)) if draw(st.booleans()) else None
        twins = [s.prompt_token_ids for s in specs if s.prompt_token_ids is not None]
        if twins and draw(st.booleans()):  # an earlier prompt again: both generate blocks of the same hashes
            prompt = draw(st.sampled_from(twins))
        length = len(prompt) if prompt is not None else own
        output = draw(st.integers(1, max(1, min(60, max_len - length))))
        specs.append(RequestSpec(arrival, length, output, priority=draw(st.integers(0, 2)),
                                 request_id=f"r{i}", prompt_token_ids=prompt))
    return specs


def _same(a: SimResult, b: SimResult) -> None:
    assert a.steps == b.steps
    assert a.num_preemptions == b.num_preemptions
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.records, b.records, strict=True):
        assert [getattr(x, f.name) for f in fields(x)] == [getattr(y, f.name) for f in fields(y)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16]),
    caching=st.booleans(),
    target_itl_ms=st.sampled_from([0.0, 6.0]),  # 6 ms: prefill chunks sized by the refitted step times
    policy=st.sampled_from(["fcfs", "sjf", "priority", "chunked-prefill", "fair"]),
    cost=st.sampled_from(range(len(_COST_MODELS))),
    engines=st.integers(1, 3),
    router=st.sampled_from(["least-loaded", "round-robin", "power-of-two", "prefix-aware"]),
)
def test_fast_forward_reports_what_the_steps_one_by_one_report(
        data: st.DataObject, block_size: int, caching: bool, target_itl_ms: float, policy: str, cost: int,
        engines: int, router: str) -> None:
    max_len = 96
    workload = data.draw(_workloads(max_len))
    needed = max(-(-(s.prompt_tokens + s.output_tokens) // block_size) for s in workload)
    limits = EngineLimits(num_kv_blocks=needed + 1 + data.draw(st.integers(0, 3 * needed)), block_size=block_size,
                          max_model_len=max_len, enable_prefix_caching=caching,
                          max_num_seqs=data.draw(st.integers(1, 8)),
                          max_num_batched_tokens=data.draw(st.sampled_from([8, 32, 96])),
                          max_prompts_per_step=data.draw(st.sampled_from([0, 1, 3])), target_itl_ms=target_itl_ms)
    runs = []
    with (mock.patch.object(run_loop, "commit", wraps=run_loop.commit) as bulk,
          mock.patch.object(decode_run, "_grow_in_turn", wraps=decode_run._grow_in_turn) as in_turn):
        for fast_forward in (False, True):
            runs.append(simulate(workload, limits, policy, _COST_MODELS[cost], engines=engines, router=router,
                                 max_steps=20_000, fast_forward=fast_forward))
    event(f"steps taken in bulk: {'some' if bulk.call_count else 'none'}")
    # Blocks whose hashes another request cached first: the run's allocations one by one, in order.
    event(f"allocations of a run in turn: {'some' if in_turn.call_count else 'none'}")
    _same(*runs)


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.tuples(st.booleans(), st.integers(0, 200), st.integers(1, 40)), min_size=2, max_size=16),
    spare_blocks=st.integers(0, 12),
    engines=st.integers(2, 3),
)
def test_a_prefix_aware_fleet_routes_as_step_by_step_while_runs_evict_its_prefixes(
        kinds: list[tuple[bool, int, int]], spare_blocks: int, engines: int) -> None:
    """Requests that share a prefix (and leave it cached) among long decodes whose blocks evict it,
    in pools with little to spare: the router must hear of each eviction before it routes by it."""
    prefix = tuple(range(5, 13))
    workload = [RequestSpec(arrival / 1000, 9 if shares else 4, output, request_id=f"r{i}",
                            prompt_token_ids=(*prefix, 100 + i) if shares else tuple(range(1000 * (i + 1),
                                                                                             1000 * (i + 1) + 4)))
                for i, (shares, arrival, output) in enumerate(kinds)]
    needed = max(-(-(s.prompt_tokens + s.output_tokens) // 4) for s in workload)
    limits = EngineLimits(num_kv_blocks=needed + 1 + spare_blocks, block_size=4, max_model_len=64,
                          max_num_seqs=8, max_num_batched_tokens=64, target_itl_ms=0.0)
    runs = [simulate(workload, limits, "fcfs", _COST_MODELS[0], engines=engines, router="prefix-aware",
                     max_steps=20_000, fast_forward=fast_forward) for fast_forward in (False, True)]
    _same(*runs)
