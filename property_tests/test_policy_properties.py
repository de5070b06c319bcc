"""Every installed policy (the built-ins, and any plugin installed beside them) over random arrival
streams, with a fake model.

All policies: the budget and seats hold, nothing is lost, duplicated or stuck (see
``policy_harness``). Then each policy's own promise:

- ``priority``: after every step, if a running request has a strictly lower priority than the best
  waiting one, the step's token budget is what kept the waiting one out (seats and KV blocks never
  do: it would have preempted).
- ``sjf``: a request overtakes an earlier arrival only while its aged length is smaller, so with
  aging nothing waits forever (every run also finishes everything).
- ``fair``: for two tenants backlogged over any run of steps, the service they got differs by at
  most ``2U``, ``U = w_p * L_input + w_q * max_num_seqs * max_tokens`` (docs/policies.md).
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st
from policy_harness import Arrival, Trace, arrivals, build_scheduler, pool_for, run

from cadence.policies.loader import installed_policies
from cadence.request import Request

# Every installed policy: a plugin installed beside cadence is held to the same limits.
POLICIES = installed_policies()
USERS = ["ann", "bob", "cy", None]



@settings(max_examples=600, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    chunked=st.sampled_from([None, "true", "false"]),
    workload=st.lists(arrivals(USERS), min_size=1, max_size=24),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 8),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
    engine_chunked=st.booleans(),
    prefix_caching=st.booleans(),
    aging=st.sampled_from(["0.5", "1", "4"]),
    # With the built-in step-time model, 20 ms leaves prefills a few tokens beside a decode or two.
    target_itl_ms=st.sampled_from([0.0, 20.0, 60.0]),
    max_prompts_per_step=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_every_policy_keeps_the_limits_and_its_promise(
    policy: str, chunked: str | None, workload: list[Arrival], block_size: int, spare_blocks: int,
    max_num_seqs: int, budget: int, engine_chunked: bool, prefix_caching: bool, aging: str,
    target_itl_ms: float, max_prompts_per_step: int, seed: int,
) -> None:
    if not engine_chunked:
        # The engine's config guarantees this when prompts may not be split.
        budget = max(budget, max(len(a.prompt) + a.max_tokens for a in workload))
        if chunked == "true" or (policy == "chunked-prefill" and chunked is None):
            chunked = "false"
    options = {} if chunked is None else {"chunked": chunked}
    if policy == "sjf":
        options["aging"] = aging
    scheduler = build_scheduler(policy, options, budget=budget, max_num_seqs=max_num_seqs,
                                num_blocks=pool_for(workload, block_size, spare_blocks), block_size=block_size,
                                prefix_caching=prefix_caching, engine_chunked=engine_chunked,
                                target_itl_ms=target_itl_ms, max_prompts_per_step=max_prompts_per_step)
    trace = run(scheduler, workload, seed)
    event(f"{policy}: {'preempted' if scheduler.num_preemptions else 'no preemption'}")
    if policy == "priority":
        check_priority(trace)
    if policy == "sjf":
        check_sjf_overtaking(trace, float(aging))
    if policy == "fair":
        check_fair_bound(trace)


fair_arrivals = st.builds(
    Arrival,
    step=st.integers(0, 3),
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=30),
    max_tokens=st.integers(1, 16),
    user=st.sampled_from(USERS[:3]),
)


@settings(max_examples=300, deadline=None)
@given(
    workload=st.lists(fair_arrivals, min_size=4, max_size=40),
    chunked=st.booleans(),
    block_size=st.sampled_from([1, 4]),
    spare_blocks=st.integers(0, 30),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
    weights=st.sampled_from([("1", "2"), ("1", "1"), ("2", "1")]),
    seed=st.integers(0, 2**16),
)
def test_fair_keeps_backlogged_tenants_within_the_vtc_bound(
    workload: list[Arrival], chunked: bool, block_size: int, spare_blocks: int, max_num_seqs: int, budget: int,
    weights: tuple[str, str], seed: int,
) -> None:
    # Heavy, bursty load from few tenants keeps them backlogged together for long runs of steps.
    options = {"chunked": str(chunked).lower(), "input_weight": weights[0], "output_weight": weights[1]}
    scheduler = build_scheduler("fair", options, budget=budget, max_num_seqs=max_num_seqs,
                                num_blocks=pool_for(workload, block_size, spare_blocks), block_size=block_size)
    trace = run(scheduler, workload, seed, eos_rate=0.02)
    gap, bound = check_fair_bound(trace)
    event(f"largest gap / 2U: {min(gap / bound, 1.0):.1f}" if bound else "no joint backlog")


# ---- the policies' promises ------------------------------------------------------------------


def check_priority(trace: Trace) -> None:
    requests = trace.requests
    for record in trace.steps:
        if not record.waiting_after:
            continue
        best = min((requests[i] for i in record.waiting_after), key=lambda r: (r.priority, r.arrival_time))
        outranked = [i for i in record.running_after if requests[i].priority > best.priority]
        if not outranked:
            continue
        # The only excuses are the step's budget (with chunking any tokens left would admit a chunk,
        # unless the latency target's time went to the running requests' chunks: they draw first)
        # and --max-prompts-per-step, once the step admitted that many (in priority order).
        budget_short = record.budget_left == 0 or (not trace.policy.chunked and record.budget_left < best.num_tokens)
        time_short = trace.scheduler.step_budget is not None and record.blocked == "latency_target"
        capped = record.blocked == "prompt_cap"
        assert budget_short or time_short or capped, (
            f"step {record.output.step_id}: {best.request_id} (priority {best.priority}) waits while {outranked} "
            f"of lower priority run, {record.budget_left} tokens left, admission stopped for {record.blocked}")


def check_sjf_overtaking(trace: Trace, aging: float) -> None:
    """``y`` arrived after ``x`` and was admitted first: its aged length was strictly smaller.

    The aged length is ``length + aging * (admissions before arrival)``, so a request can only be
    overtaken by later arrivals during its first ``length / aging`` admissions.
    """
    requests, admissions = trace.requests, 0
    born: dict[str, int] = {}
    admitted: set[str] = set()

    def arrival_order(request_id: str) -> tuple[int, int]:
        return trace.arrived_at_step[request_id], int(request_id)

    for step, record in enumerate(trace.steps):
        for request_id in record.waiting_before:
            if trace.arrived_at_step[request_id] == step:
                born[request_id] = admissions
        for new in record.output.new_requests:
            y = new.request_id
            admissions += 1
            if y in admitted:
                continue  # back from preemption
            admitted.add(y)
            for x in record.waiting_before:
                if x in admitted or arrival_order(x) > arrival_order(y):
                    continue
                score_x = _length(requests[x]) + aging * born[x]
                score_y = _length(requests[y]) + aging * born[y]
                assert score_y < score_x, f"{y} (aged length {score_y}) overtook {x} ({score_x})"


def check_fair_bound(trace: Trace, w_p: float | None = None, w_q: float | None = None) -> tuple[float, float]:
    """Largest service gap seen between two jointly backlogged tenants, and the bound ``2U``.

    The weights default to the ``fair`` policy's own (give them to measure another policy).
    """
    w_p = trace.policy.input_weight if w_p is None else w_p  # type: ignore[attr-defined]
    w_q = trace.policy.output_weight if w_q is None else w_q  # type: ignore[attr-defined]
    requests = trace.requests
    longest_prompt = max(r.num_prompt_tokens for r in requests.values())
    longest_output = max(r.max_tokens for r in requests.values())
    bound = 2 * (w_p * longest_prompt + w_q * trace.scheduler.config.max_num_seqs * longest_output)

    def tenant(request_id: str) -> str:
        return requests[request_id].user or ""

    tenants = sorted({tenant(i) for i in requests})
    charged: set[str] = set()
    largest = 0.0
    # Per pair: the running difference of service since the joint backlog began, and its range.
    runs: dict[tuple[str, str], list[float]] = {}
    for record in trace.steps:
        service = dict.fromkeys(tenants, 0.0)
        for new in record.output.new_requests:
            if new.request_id not in charged:
                charged.add(new.request_id)
                service[tenant(new.request_id)] += w_p * requests[new.request_id].num_prompt_tokens
        for request_id in record.sampled:
            service[tenant(request_id)] += w_q
        still_waiting = set(record.waiting_after)
        backlogged = {tenant(i) for i in record.waiting_before if i in still_waiting}
        for f in tenants:
            for g in tenants:
                if f >= g:
                    continue
                if f not in backlogged or g not in backlogged:
                    runs.pop((f, g), None)
                    continue
                diff, low, high = runs.get((f, g), [0.0, 0.0, 0.0])
                diff += service[f] - service[g]
                low, high = min(low, diff), max(high, diff)
                runs[(f, g)] = [diff, low, high]
                largest = max(largest, high - low)
                assert high - low <= bound, (f"tenants {f!r} and {g!r}: service gap {high - low} over a joint "
                                             f"backlog exceeds 2U = {bound} (step {record.output.step_id})")
    return largest, bound


def _length(request: Request) -> int:
    return request.num_prompt_tokens + request.max_tokens
