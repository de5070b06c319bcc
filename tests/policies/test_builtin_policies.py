"""The built-in policies' decisions, called directly on hand-made request views (no scheduler):
``order_waiting``, ``order_running``, ``num_tokens``, ``pick_victim``, ``preempt_for``, the state the
notifications keep (sjf's aging, fair's counters), and their options. ``tests/policies/test_policies.py`` loads
them by name and checks option errors through the loader; ``property_tests/`` runs them in a scheduler."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from cadence.policies.base import PolicyContext
from cadence.policies.chunked_prefill import ChunkedPrefillPolicy
from cadence.policies.fair import FairPolicy, tenant_of
from cadence.policies.fcfs import FCFSPolicy
from cadence.policies.priority import PriorityPolicy
from cadence.policies.sjf import ShortestJobFirstPolicy
from cadence.request import RequestStatus, RequestView

CONTEXT = PolicyContext(max_num_batched_tokens=32, max_num_seqs=4, enable_chunked_prefill=True,
                        long_prefill_token_threshold=0)
NO_CHUNKING = PolicyContext(max_num_batched_tokens=32, max_num_seqs=4, enable_chunked_prefill=False,
                            long_prefill_token_threshold=0)
Builtin = type[FCFSPolicy] | type[PriorityPolicy] | type[ShortestJobFirstPolicy] | type[FairPolicy]
ALL: list[Builtin] = [FCFSPolicy, ChunkedPrefillPolicy, PriorityPolicy, ShortestJobFirstPolicy, FairPolicy]


@dataclass
class View:
    """A request as a policy sees it (``RequestView``)."""

    request_id: str
    num_prompt_tokens: int = 4
    max_tokens: int = 8
    priority: int = 0
    arrival_time: float = 0.0
    user: str | None = None
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    extra_args: dict[str, str | int | float | bool] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def decoding(request_id: str, **kwargs: object) -> View:
    """A running request with one token left to compute."""
    view = View(request_id, status=RequestStatus.RUNNING, num_output_tokens=1, **kwargs)  # type: ignore[arg-type]
    view.num_computed_tokens = view.num_tokens - 1
    return view


def ids(views: Iterable[RequestView]) -> list[str]:
    return [v.request_id for v in views]


def test_views_here_are_request_views() -> None:
    view: RequestView = View("a")  # structurally: mypy checks View against the Protocol
    assert (view.num_tokens, view.status) == (4, RequestStatus.WAITING)


# ---- names, options ---------------------------------------------------------------------------


def test_names_and_accepted_options() -> None:
    assert {cls.name: tuple(cls.accepted_options()) for cls in ALL} == {
        "fcfs": ("chunked",), "chunked-prefill": ("chunked",), "priority": ("chunked",),
        "sjf": ("chunked", "aging"), "fair": ("chunked", "input_weight", "output_weight")}


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize(("given", "chunked"), [("TRUE", True), ("yes", True), ("1", True), ("On", True),
                                                ("false", False), ("No", False), ("0", False), ("off", False)])
def test_chunked_takes_the_usual_spellings_of_true_and_false(cls: Builtin, given: str,
                                                             chunked: bool) -> None:
    policy = cls(CONTEXT, {"chunked": given})
    assert policy.chunked is chunked and policy.options == {"chunked": given}


def test_chunking_follows_the_engine_unless_given_and_chunked_prefill_always_chunks() -> None:
    assert [cls(CONTEXT).chunked for cls in ALL] == [True] * 5
    assert [cls(NO_CHUNKING).chunked for cls in ALL if cls is not ChunkedPrefillPolicy] == [False] * 4
    assert [cls(NO_CHUNKING, {"chunked": "false"}).chunked for cls in ALL] == [False] * 5
    with pytest.raises(ValueError, match="policy 'chunked-prefill' with chunked=true splits prompts"):
        ChunkedPrefillPolicy(NO_CHUNKING)
    with pytest.raises(ValueError, match="policy 'fair' with chunked=true"):
        FairPolicy(NO_CHUNKING, {"chunked": "true"})


def test_an_unknown_option_lists_what_the_policy_accepts() -> None:
    with pytest.raises(ValueError, match=r"policy 'priority' does not take option\(s\) \['aging', 'weight'\]; "
                                         r"it accepts \['chunked'\]"):
        PriorityPolicy(CONTEXT, {"weight": "1", "aging": "2"})
    with pytest.raises(ValueError, match=r"it accepts \['aging', 'chunked'\]"):
        ShortestJobFirstPolicy(CONTEXT, {"input_weight": "1"})


@pytest.mark.parametrize(("cls", "key"), [(ShortestJobFirstPolicy, "aging"), (FairPolicy, "input_weight"),
                                          (FairPolicy, "output_weight")])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "-0.5", "", "1e", "two"])
def test_numeric_options_must_be_finite_and_not_negative(cls: Builtin, key: str, bad: str) -> None:
    with pytest.raises(ValueError, match=rf"policy '{cls.name}': option {key}='{bad}' must be a number >= 0$"):
        cls(CONTEXT, {key: bad})


def test_numeric_options_and_their_defaults() -> None:
    assert ShortestJobFirstPolicy(CONTEXT).aging == 1.0
    assert ShortestJobFirstPolicy(CONTEXT, {"aging": "0"}).aging == 0.0
    assert ShortestJobFirstPolicy(CONTEXT, {"aging": "2.5"}).aging == 2.5
    fair = FairPolicy(CONTEXT)
    assert (fair.input_weight, fair.output_weight) == (1.0, 2.0)
    fair = FairPolicy(CONTEXT, {"input_weight": "0.5", "output_weight": "1e1"})
    assert (fair.input_weight, fair.output_weight) == (0.5, 10.0)


# ---- sizes (the base class, every policy) -----------------------------------------------------


def test_whole_prefills_wait_unless_the_prompt_could_never_fit() -> None:
    fcfs = FCFSPolicy(CONTEXT, {"chunked": "false"})
    assert fcfs.num_tokens(View("a", num_prompt_tokens=20), token_budget=20) == 20
    assert fcfs.num_tokens(View("a", num_prompt_tokens=20), token_budget=19) == 0  # waits for a whole step
    assert fcfs.num_tokens(View("a", num_prompt_tokens=20), token_budget=12, num_cached_tokens=8) == 12
    # Longer than the entire step budget (32): split, or it could never run.
    assert fcfs.num_tokens(View("a", num_prompt_tokens=40), token_budget=10) == 10
    assert FCFSPolicy(NO_CHUNKING).num_tokens(View("a", num_prompt_tokens=40), token_budget=10) == 0
    # A running request (the rest of a split prompt, or a decode) takes what fits.
    assert fcfs.num_tokens(View("a", num_prompt_tokens=20, num_computed_tokens=5,
                                status=RequestStatus.RUNNING), token_budget=6) == 6
    assert fcfs.num_tokens(decoding("d"), token_budget=0) == 0


def test_chunked_sizes_fill_the_budget_up_to_the_long_prefill_threshold() -> None:
    chunked = ChunkedPrefillPolicy(CONTEXT)
    assert chunked.num_tokens(View("a", num_prompt_tokens=20), token_budget=7) == 7
    assert chunked.num_tokens(View("a", num_prompt_tokens=20), token_budget=64, num_cached_tokens=16) == 4
    capped = ChunkedPrefillPolicy(PolicyContext(32, 4, enable_chunked_prefill=True, long_prefill_token_threshold=8))
    assert capped.num_tokens(View("a", num_prompt_tokens=20), token_budget=16) == 8
    assert capped.num_tokens(View("a", num_prompt_tokens=20), token_budget=5) == 5
    assert capped.num_tokens(View("a", num_prompt_tokens=20, num_computed_tokens=15), token_budget=16) == 5
    assert capped.num_tokens(decoding("d"), token_budget=16) == 1


# ---- fcfs, chunked-prefill --------------------------------------------------------------------


def test_fcfs_keeps_the_queue_order_and_never_preempts_for_a_waiting_request() -> None:
    waiting = [View("p", arrival_time=5.0), View("a", arrival_time=1.0), View("b", arrival_time=2.0)]
    for policy in (FCFSPolicy(CONTEXT), ChunkedPrefillPolicy(CONTEXT)):
        ordered = policy.order_waiting(waiting)
        assert ids(ordered) == ["p", "a", "b"] and ordered is not waiting  # a preempted one stays in front
        running = [View("x", status=RequestStatus.RUNNING, priority=9), decoding("y")]
        assert policy.preempt_for(View("urgent", priority=-5), running) is None
        assert policy.pick_victim(running, running[0]).request_id == "y"  # the most recently admitted


def test_chunked_policies_serve_decodes_before_prefill_chunks() -> None:
    running = [View("p1", num_prompt_tokens=30, num_computed_tokens=10, status=RequestStatus.RUNNING),
               decoding("d1"), View("p2", num_prompt_tokens=30, status=RequestStatus.RUNNING), decoding("d2")]
    assert ids(FCFSPolicy(CONTEXT, {"chunked": "false"}).order_running(running)) == ["p1", "d1", "p2", "d2"]
    for policy in (ChunkedPrefillPolicy(CONTEXT), FCFSPolicy(CONTEXT, {"chunked": "true"}),
                   FairPolicy(CONTEXT, {"chunked": "true"})):
        assert ids(policy.order_running(running)) == ["d1", "d2", "p1", "p2"]
    assert ids(ChunkedPrefillPolicy(CONTEXT, {"chunked": "false"}).order_running(running)) == ["p1", "d1", "p2", "d2"]


# ---- priority ---------------------------------------------------------------------------------


def test_priority_admits_by_priority_then_arrival_keeping_queue_order_on_ties() -> None:
    waiting = [View("late-high", priority=0, arrival_time=9.0), View("low", priority=3, arrival_time=0.0),
               View("tie-2", priority=1, arrival_time=4.0), View("tie-1", priority=1, arrival_time=4.0),
               View("early-high", priority=0, arrival_time=1.0), View("negative", priority=-1, arrival_time=10.0)]
    policy = PriorityPolicy(CONTEXT)
    for view in waiting:
        policy.on_arrival(view)
    assert ids(policy.order_waiting(waiting)) == [
        "negative", "early-high", "late-high", "tie-2", "tie-1", "low"]


def test_priority_orders_running_by_rank_then_decodes_first_when_chunked() -> None:
    running = [View("low-prefill", priority=2, status=RequestStatus.RUNNING), decoding("low-decode", priority=2),
               View("high-prefill", priority=0, status=RequestStatus.RUNNING), decoding("mid-decode", priority=1)]
    assert ids(PriorityPolicy(CONTEXT, {"chunked": "false"}).order_running(running)) == [
        "high-prefill", "mid-decode", "low-prefill", "low-decode"]
    assert ids(PriorityPolicy(CONTEXT, {"chunked": "true"}).order_running(running)) == [
        "mid-decode", "low-decode", "high-prefill", "low-prefill"]


def test_priority_victims_are_the_lowest_ranked_most_recently_admitted() -> None:
    policy = PriorityPolicy(CONTEXT)
    a = decoding("a", priority=1, arrival_time=0.0)
    b = decoding("b", priority=5, arrival_time=1.0)
    c = decoding("c", priority=5, arrival_time=1.0)  # equal rank to b, admitted after it
    d = decoding("d", priority=5, arrival_time=0.5)  # same priority, arrived earlier: ranks higher
    assert policy.pick_victim([a, b, c, d], needy=a).request_id == "c"
    assert policy.pick_victim([a, d], needy=d).request_id == "d"  # the needy one itself yields
    assert policy.pick_victim([a], needy=a).request_id == "a"
    # For a waiting request: only a strictly lower priority (a larger value) gives way.
    assert policy.preempt_for(View("w", priority=4), [a, b, c, d]).request_id == "c"  # type: ignore[union-attr]
    assert policy.preempt_for(View("w", priority=5), [a, b, c, d]) is None
    assert policy.preempt_for(View("w", priority=0), [a]).request_id == "a"  # type: ignore[union-attr]
    assert policy.preempt_for(View("w", priority=1), [a]) is None
    assert policy.preempt_for(View("w", priority=-9), []) is None


# ---- sjf --------------------------------------------------------------------------------------


def test_sjf_scores_prompt_plus_max_tokens_and_breaks_ties_by_arrival() -> None:
    policy = ShortestJobFirstPolicy(CONTEXT, {"aging": "0"})
    waiting = [View("long", num_prompt_tokens=30, max_tokens=10, arrival_time=0.0),
               View("short-late", num_prompt_tokens=2, max_tokens=2, arrival_time=3.0),
               View("short-early", num_prompt_tokens=3, max_tokens=1, arrival_time=2.0),
               View("mid", num_prompt_tokens=10, max_tokens=1, arrival_time=1.0)]
    for view in waiting:
        policy.on_arrival(view)
    assert [policy.score(v) for v in waiting] == [40.0, 4.0, 4.0, 11.0]
    assert ids(policy.order_waiting(waiting)) == ["short-early", "short-late", "mid", "long"]
    assert policy.score(View("never-seen", num_prompt_tokens=5, max_tokens=5)) == 10.0  # no age


def test_sjf_ages_a_waiting_request_by_the_admissions_since_its_arrival() -> None:
    policy = ShortestJobFirstPolicy(CONTEXT, {"aging": "2"})
    long_job = View("long", num_prompt_tokens=14, max_tokens=6, arrival_time=0.0)  # length 20
    policy.on_arrival(long_job)
    shorts = []
    for i in range(4):
        short = View(f"s{i}", num_prompt_tokens=3, max_tokens=2, arrival_time=1.0 + i)  # length 5
        policy.on_arrival(short)  # after i admissions
        shorts.append(short)
        assert policy.score(long_job) == 20.0 - 2 * i
        assert next(iter(policy.order_waiting([long_job, short]))) is short
        policy.on_scheduled(short, 5)  # admitted
        policy.on_scheduled(short, 1)  # scheduled again while running: not an admission
    # Four admissions in all; each short one aged by those after its arrival.
    assert policy.score(long_job) == 20.0 - 2 * 4
    assert [policy.score(v) for v in shorts] == [5.0 - 2 * (4 - i) for i in range(4)]


def test_sjf_long_job_overtakes_once_aged_enough() -> None:
    policy = ShortestJobFirstPolicy(CONTEXT, {"aging": "5"})
    long_job = View("long", num_prompt_tokens=12, max_tokens=8, arrival_time=0.0)  # length 20
    policy.on_arrival(long_job)
    order = []
    for i in range(5):
        short = View(f"s{i}", num_prompt_tokens=3, max_tokens=2, arrival_time=1.0 + i)  # length 5
        policy.on_arrival(short)
        first = next(iter(policy.order_waiting([long_job, short])))
        order.append(first.request_id)
        policy.on_scheduled(first, first.num_prompt_tokens)
        if first is long_job:
            break
    # Scores of the long job: 20, 15, 10, 5 (a tie with a fresh short one: it arrived first) -> admitted.
    assert order == ["s0", "s1", "s2", "long"]


def test_sjf_preemption_keeps_a_requests_age_and_finishing_forgets_it() -> None:
    policy = ShortestJobFirstPolicy(CONTEXT, {"aging": "1"})
    a, b, c = (View(name, num_prompt_tokens=4, max_tokens=4, arrival_time=t) for name, t in
               [("a", 0.0), ("b", 1.0), ("c", 2.0)])
    policy.on_arrival(a)
    policy.on_scheduled(a, 4)  # admissions: 1
    policy.on_arrival(b)
    policy.on_scheduled(b, 4)  # 2
    policy.on_preempted(a)  # back to waiting, arrived when 0 admissions had happened
    policy.on_arrival(c)
    assert [policy.score(v) for v in (a, c)] == [8.0 - 2, 8.0]
    policy.on_scheduled(a, 4)  # re-admitted: an admission again
    assert policy.score(c) == 8.0 - 1
    policy.on_finished(a)
    assert policy.score(a) == 8.0  # forgotten: no age


def test_sjf_and_fair_never_preempt_for_a_waiting_request() -> None:
    running = [decoding("x", priority=9)]
    assert ShortestJobFirstPolicy(CONTEXT).preempt_for(View("w", priority=0), running) is None
    assert FairPolicy(CONTEXT).preempt_for(View("w", priority=0), running) is None
    assert ShortestJobFirstPolicy(CONTEXT).pick_victim([decoding("x"), decoding("y")], decoding("x")).request_id == "y"


# ---- fair -------------------------------------------------------------------------------------


def test_requests_without_a_user_share_the_anonymous_tenant() -> None:
    assert [tenant_of(View("a", user=u)) for u in ("ann", None, "")] == ["ann", "", ""]


def test_fair_takes_the_oldest_request_of_the_least_served_tenant_charging_its_prompt() -> None:
    policy = FairPolicy(CONTEXT)
    a1 = View("a1", user="a", num_prompt_tokens=4, arrival_time=0.0)
    a2 = View("a2", user="a", num_prompt_tokens=4, arrival_time=1.0)
    a3 = View("a3", user="a", num_prompt_tokens=4, arrival_time=2.0)
    b1 = View("b1", user="b", num_prompt_tokens=10, arrival_time=3.0)
    anon = View("n1", num_prompt_tokens=1, arrival_time=4.0)
    for view in (a1, a2, a3, b1, anon):
        policy.on_arrival(view)
    assert policy.counters == {"a": 0.0, "b": 0.0, "": 0.0}
    # Projected charges: a 0 -> 4 -> 8 -> 12, b 0 -> 10, anonymous 0 -> 1; ties go to the earlier head.
    assert ids(policy.order_waiting([a1, a2, a3, b1, anon])) == ["a1", "b1", "n1", "a2", "a3"]
    assert policy.counters == {"a": 0.0, "b": 0.0, "": 0.0}  # ordering charges nothing


def test_fair_charges_prompts_once_at_admission_and_each_sampled_token() -> None:
    policy = FairPolicy(CONTEXT, {"input_weight": "0.5", "output_weight": "3"})
    a1 = View("a1", user="a", num_prompt_tokens=10, arrival_time=0.0)
    a2 = View("a2", user="a", num_prompt_tokens=2, arrival_time=1.0)
    b1 = View("b1", user="b", num_prompt_tokens=4, arrival_time=2.0)
    for view in (a1, a2, b1):
        policy.on_arrival(view)
    policy.on_scheduled(a1, 6)  # admitted with a first chunk: the whole prompt is charged, no token yet
    assert policy.counters["a"] == 5.0
    a1.num_computed_tokens = 6
    policy.on_scheduled(a1, 4)  # the rest of the prompt: samples a token
    assert policy.counters["a"] == 8.0
    assert ids(policy.order_waiting([a2, b1])) == ["b1", "a2"]  # b has had less
    policy.on_scheduled(b1, 4)
    assert policy.counters == {"a": 8.0, "b": 2.0 + 3.0}
    # b is the less served: when a running request needs blocks, a's most recent one gives way.
    assert policy.pick_victim([a1, b1], needy=b1).request_id == "a1"
    # a1 preempted: recomputing its prompt is not charged again, its tokens are.
    policy.on_preempted(a1)
    a1.num_computed_tokens = 0
    assert ids(policy.order_waiting([a1, a2])) == ["a1", "a2"]  # a1's projected charge is 0 now
    policy.on_scheduled(a1, 10)
    assert policy.counters["a"] == 8.0 + 3.0


def test_fair_victims_on_equal_counters_are_the_most_recently_admitted() -> None:
    policy = FairPolicy(CONTEXT)
    running = [decoding("x", user="a"), decoding("y", user="b"), decoding("z", user="c")]
    assert policy.pick_victim(running, needy=running[0]).request_id == "z"


def test_fair_lifts_a_newly_backlogged_tenant_so_idle_time_earns_no_credit() -> None:
    policy = FairPolicy(CONTEXT, {"output_weight": "0"})
    a1 = View("a1", user="a", num_prompt_tokens=20, arrival_time=0.0)
    policy.on_arrival(a1)
    policy.on_scheduled(a1, 20)  # a's queue empties: it was the last to leave, at 20
    assert policy.counters == {"a": 20.0}
    # b arrives while nobody waits: lifted to the counter of the last tenant to leave the queue.
    b1 = View("b1", user="b", num_prompt_tokens=5, arrival_time=1.0)
    policy.on_arrival(b1)
    assert policy.counters["b"] == 20.0
    # c arrives while b waits: lifted to the smallest counter among the backlogged (b's).
    a2 = View("a2", user="a", num_prompt_tokens=1, arrival_time=2.0)
    policy.on_arrival(a2)  # a is backlogged again, at its own 20
    policy.on_scheduled(b1, 5)  # b leaves the queue at 25
    c1 = View("c1", user="c", num_prompt_tokens=1, arrival_time=3.0)
    policy.on_arrival(c1)
    assert policy.counters == {"a": 20.0, "b": 25.0, "c": 20.0}
    # A tenant that already has more than the floor keeps it.
    b2 = View("b2", user="b", num_prompt_tokens=1, arrival_time=4.0)
    policy.on_arrival(b2)
    assert policy.counters["b"] == 25.0
    # Finished (aborted) waiting requests leave their tenants' queues: nobody is backlogged now, so
    # a newcomer gets the counter of the last tenant that left by admission (b, at 25).
    for view in (b2, a2, c1):
        policy.on_finished(view)
    d1 = View("d1", user="d", num_prompt_tokens=1, arrival_time=5.0)
    policy.on_arrival(d1)
    assert policy.counters == {"a": 20.0, "b": 25.0, "c": 20.0, "d": 25.0}
