"""Speculative decoding in the scheduler, step by step without a model: how many drafts a decode
verifies (budget, max_tokens, its adaptive limit, the policy, the batch size, free blocks), what a
verification emits, and that rejected drafts' positions are taken back with no block lost."""

from __future__ import annotations

import pytest

from cadence.config import SchedulerConfig, SpeculativeConfig
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.scheduler import Scheduler
from cadence.core.speculation import PAUSE_STEPS, SpecDecoding, StepCostFit
from cadence.messages import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from cadence.policies.base import PolicyContext
from cadence.policies.fcfs import FCFSPolicy
from cadence.request import Request, RequestView
from cadence.sampling_params import SamplingParams

BS = 4
EOS = 0


def make(*, budget: int = 64, num_blocks: int = 40, k: int = 3, batch: int = 4,
         policy: type[FCFSPolicy] = FCFSPolicy) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    spec = SpecDecoding(SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=batch))
    return Scheduler(config, KVCacheManager(num_blocks, BS), policy(PolicyContext(budget, 8, True, 0), {}),
                     speculation=spec)


def add(scheduler: Scheduler, request_id: str = "r", prompt_len: int = 6, max_tokens: int = 20,
        max_model_len: int = 64) -> Request:
    first = 100 + 20 * len(scheduler.requests)  # no two prompts share a block
    request = Request(request_id, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                      EOS, 0.0, max_model_len)
    scheduler.add_request(request)
    return request


def run(scheduler: Scheduler, step: SchedulerOutput,
        sampled: dict[str, tuple[int, int, list[int]]]) -> dict[str, list[int]]:
    """Play the worker: each request in ``sampled`` accepted that many drafts, sampled that token and
    proposes those drafts, as many as the step asks; returns each request's emitted tokens."""
    ids = [rid for rid in step.num_scheduled_tokens if rid in sampled]
    out = ModelRunnerOutput(step.step_id, ids, [sampled[rid][1] for rid in ids],
                            num_accepted_drafts=[sampled[rid][0] for rid in ids] if step.spec_token_ids else None,
                            draft_token_ids=[sampled[rid][2][:step.draft_counts.get(rid, 0)] for rid in ids])
    outputs = scheduler.update_from_output(out)
    assert_blocks(scheduler)
    return {o.request_id: o.new_token_ids for o in outputs}


def assert_blocks(scheduler: Scheduler) -> None:
    """Between steps every running request holds exactly the blocks of what it computed, plus those
    its drafted positions took (kept for its next tokens), and nothing else is held."""
    allocator = scheduler.allocator
    allocator.check_integrity()
    held = {b for r in scheduler.running for b in allocator.block_ids(r.request_id)[0]}
    assert len(held) + allocator.num_free_blocks == allocator.num_blocks - 1
    for r in scheduler.running:
        assert r.num_computed_tokens <= r.num_tokens - 1 or r.num_output_tokens == 0


def stats(scheduler: Scheduler) -> SpecDecodeStats:
    assert scheduler.speculation is not None
    return scheduler.speculation.stats()


def with_step_cost_known() -> tuple[Scheduler, SpecDecoding]:
    """A scheduler (up to 4 drafts) whose step cost fit has seen steps of a = 2.5 ms plus b = 2 ms a
    token: a drafted token costs 2 / 4.5 = 44% of a one-token step."""
    scheduler = make(k=4)
    speculation = scheduler.speculation
    assert speculation is not None
    for tokens, ms in [(1, 4.5), (5, 12.5)] * 4:
        speculation.observe(tokens, ms / 1000)
    return scheduler, speculation


def test_a_verification_emits_the_accepted_drafts_then_the_sampled_token() -> None:
    scheduler = make()
    request = add(scheduler)
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"r": 6} and not step.spec_token_ids
    assert run(scheduler, step, {"r": (0, 50, [51, 52, 53, 54])}) == {"r": [50]}

    step = scheduler.schedule()  # 1 token + 3 drafts (k = 3 of the 4 proposed), budget like a prefill
    assert step.num_scheduled_tokens == {"r": 4} and step.spec_token_ids == {"r": [51, 52, 53]}
    assert request.num_computed_tokens == 10  # through the drafts while the step runs
    assert scheduler.allocator.block_ids("r")[0] == [1, 2, 3]  # slots for the drafted positions
    assert run(scheduler, step, {"r": (1, 60, [61, 62])}) == {"r": [51, 60]}
    assert request.output_token_ids == [50, 51, 60]
    assert request.num_computed_tokens == 8  # the two rejected drafts' positions taken back
    assert stats(scheduler) == SpecDecodeStats(1, 3, 1, 2, [1, 0, 0])

    step = scheduler.schedule()  # one draft accepted last time: at most two now
    assert step.spec_token_ids == {"r": [61, 62]}
    assert run(scheduler, step, {"r": (2, 63, [64])}) == {"r": [61, 62, 63]}
    assert stats(scheduler) == SpecDecodeStats(2, 5, 3, 5, [2, 1, 0])
    step = scheduler.schedule()  # all accepted: the limit grows back
    assert step.spec_token_ids == {"r": [64]}


def test_drafts_are_asked_for_while_their_chance_of_acceptance_pays_for_their_token() -> None:
    scheduler, speculation = with_step_cost_known()
    assert speculation.cost.token_share(1) == pytest.approx(2 / 4.5)  # a drafted token costs 44% of a step
    request = add(scheduler, max_tokens=60)
    asked, verified = [], []
    for alpha in (0.9, 0.6, 0.3):  # 0.9 ** 4 = 0.66 > 0.44; 0.6 > 0.44 > 0.6 ** 2; 0.3 < 0.44
        request.drafts.accepted, request.drafts.tried = alpha, 1.0
        step = scheduler.schedule()
        asked.append(step.draft_counts["r"])
        verified.append(len(step.spec_token_ids.get("r", [])))
        run(scheduler, step, {"r": (0, 60, [51, 52, 53, 54])})
    assert asked == [4, 1, 1]  # the last: a probe, after which it pauses
    assert verified == [0, 4, 1]  # what the step before asked for
    for _ in range(PAUSE_STEPS):
        request.drafts.accepted, request.drafts.tried = 0.3, 1.0
        step = scheduler.schedule()
        assert step.draft_counts == {"r": 0}
        run(scheduler, step, {"r": (0, 60, [51, 52, 53, 54])})
    request.drafts.accepted, request.drafts.tried = 0.3, 1.0
    step = scheduler.schedule()
    assert step.spec_token_ids == {} and step.draft_counts == {"r": 1}  # the next probe
    run(scheduler, step, {"r": (0, 60, [51, 52, 53, 54])})
    assert scheduler.schedule().spec_token_ids == {"r": [51]}


def test_a_rejected_probe_doubles_the_next_pause_and_an_accepted_one_resets_it() -> None:
    scheduler, _ = with_step_cost_known()
    request = add(scheduler, max_tokens=400, max_model_len=150)
    probes = []
    for i in range(90):
        request.drafts.accepted, request.drafts.tried = 0.3, 1.0  # worth no draft but a probe
        step = scheduler.schedule()
        if step.draft_counts["r"]:
            probes.append(i)
        verified = len(step.spec_token_ids.get("r", []))
        run(scheduler, step, {"r": (verified if i == 60 else 0, 60, [51, 52, 53, 54])})  # step 60 accepts
    # Pauses of 8, 16, 32 and 64 steps after rejected probes; the probe accepted at step 60 ends the
    # pause it was in: a probe at once, then pauses of 8 and 16 steps again.
    assert probes == [0, 9, 26, 59, 61, 70, 87]


def test_no_drafts_are_asked_for_while_more_requests_are_unfinished_than_the_batch_limit() -> None:
    scheduler = make(budget=12, batch=2)
    for name in "abc":
        add(scheduler, name)
    step = scheduler.schedule()  # "a" and "b" take the budget; "c" waits, to join the next step
    assert set(step.num_scheduled_tokens) == {"a", "b"} and not step.draft_counts


def test_a_draft_models_time_prices_each_draft_position() -> None:
    scheduler, speculation = with_step_cost_known()
    request = add(scheduler, max_tokens=60)
    request.drafts.accepted, request.drafts.tried = 0.9, 1.0
    step = scheduler.schedule()  # the prompt's 6 tokens: 14.5 ms of the model
    assert step.draft_counts == {"r": 4}  # 0.9 ** 4 = 0.66 > 2 / 4.5
    run(scheduler, step, {"r": (0, 50, [51, 52, 53, 54])})
    scheduler.observe_step_time(0.0185, draft_seconds=0.004)  # and 4 ms drafting 4 positions
    assert speculation.draft_round_s == pytest.approx(0.001)
    assert speculation.cost.token_share(1) == pytest.approx(2 / 4.5)  # the model's own time, as before
    request.drafts.accepted, request.drafts.tried = 0.9, 1.0
    # A position now costs a token (2 ms) and a draft forward (1 ms) of a 4.5 ms step: 0.9 ** 4 < 0.67.
    assert scheduler.schedule().draft_counts == {"r": 3}


def test_acceptance_is_estimated_from_the_verifications() -> None:
    scheduler = make()
    request = add(scheduler)
    run(scheduler, scheduler.schedule(), {"r": (0, 50, [51, 52, 53])})
    run(scheduler, scheduler.schedule(), {"r": (1, 60, [61, 62, 63])})  # one accepted, one rejected
    assert (request.drafts.accepted, request.drafts.tried) == pytest.approx((0.8 * 2 + 1, 0.8 * 3 + 2))
    run(scheduler, scheduler.schedule(), {"r": (3, 70, [])})  # all three accepted: none rejected
    assert (request.drafts.accepted, request.drafts.tried) == pytest.approx((0.64 * 2 + 0.8 + 3, 0.64 * 3 + 1.6 + 3))


def test_the_step_cost_is_unknown_until_steps_of_different_sizes_were_seen() -> None:
    fit = StepCostFit()
    for _ in range(20):
        fit.observe(1, 0.005)
    assert fit.token_share(1) is None
    fit.observe(9, 0.021)
    assert fit.token_share(9) == pytest.approx(0.018 / 0.021, rel=1e-6)  # a = 3 ms, b = 2 ms


def test_an_eos_among_accepted_drafts_ends_the_request_there() -> None:
    scheduler = make()
    add(scheduler)
    run(scheduler, scheduler.schedule(), {"r": (0, 50, [51, EOS, 53])})
    step = scheduler.schedule()
    assert step.spec_token_ids == {"r": [51, EOS, 53]}
    assert run(scheduler, step, {"r": (3, 54, [])}) == {"r": [51, EOS]}
    assert not scheduler.requests
    assert scheduler.allocator.num_free_blocks == scheduler.allocator.num_blocks - 1


def test_drafts_fit_the_budget_and_max_tokens() -> None:
    scheduler = make(budget=8, k=8)
    add(scheduler, "a", max_tokens=4)
    add(scheduler, "b", max_tokens=30)
    run(scheduler, scheduler.schedule(), {"a": (0, 50, [1, 2, 3, 4, 5])})  # "a" prefilled; "b" got 2 tokens
    step = scheduler.schedule()
    # "a" has 3 tokens to go: its token and 2 drafts; "b" takes the rest of the budget.
    assert step.spec_token_ids == {"a": [1, 2]} and step.num_scheduled_tokens == {"a": 3, "b": 4}
    run(scheduler, step, {"a": (2, 3, [])})
    assert not scheduler.requests.get("a")


def test_a_policy_caps_speculation_per_request() -> None:
    class NoDraftsForB(FCFSPolicy):
        def num_speculative_tokens(self, request: RequestView, num_drafts: int) -> int:
            return 0 if request.request_id == "b" else min(num_drafts, 1)

    scheduler = make(policy=NoDraftsForB)
    add(scheduler, "a")
    add(scheduler, "b")
    run(scheduler, scheduler.schedule(), {"a": (0, 50, [51, 52]), "b": (0, 60, [61, 62])})
    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [51]} and step.num_scheduled_tokens == {"a": 2, "b": 1}


def test_no_drafts_while_more_requests_run_than_the_batch_limit() -> None:
    scheduler = make(batch=2)
    for name in "abc":
        add(scheduler, name, max_tokens=10)
    run(scheduler, scheduler.schedule(), {name: (0, 50, [51]) for name in "abc"})
    step = scheduler.schedule()
    assert not step.spec_token_ids and not step.draft_counts
    run(scheduler, step, {"a": (0, EOS, [51]), "b": (0, 52, [53]), "c": (0, 52, [53])})  # "a" ends: 2 run
    step = scheduler.schedule()  # drafts asked for again, verified in the step after
    assert not step.spec_token_ids and step.draft_counts == {"b": 3, "c": 3}
    run(scheduler, step, {"b": (0, 54, [55]), "c": (0, 54, [55])})
    assert scheduler.schedule().spec_token_ids == {"b": [55], "c": [55]}


def test_drafts_take_only_blocks_the_running_requests_do_not_need() -> None:
    # 5 usable blocks of 4 tokens. "a" (7 prompt tokens) decodes into its second block; "b" (8) needs a
    # third for its decode, which takes the last free block: none is left for the drafts of "a".
    scheduler = make(num_blocks=6)
    add(scheduler, "a", prompt_len=7)
    add(scheduler, "b", prompt_len=8)
    run(scheduler, scheduler.schedule(), {"a": (0, 50, [51, 52, 53]), "b": (0, 60, [])})
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 1} and not step.spec_token_ids
    assert scheduler.num_preemptions == 0 and scheduler.allocator.num_free_blocks == 0
    run(scheduler, step, {"a": (0, 51, [52, 53]), "b": (0, EOS, [])})  # "b" ends: its blocks are free
    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [52, 53]} and step.num_scheduled_tokens == {"a": 3}
    assert scheduler.num_preemptions == 0
