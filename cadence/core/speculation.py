"""Speculative decoding in the scheduler: how many drafts each decode verifies, and what came of them.

The worker proposes drafts after each step (``executor/speculation.py``); the scheduler gives a
decoding request one token plus up to that many drafts, each costing a token of the step's budget
like a prompt token, and allocates their KV slots with the rest. After the step, the rejected
drafts' positions are taken back (``num_computed_tokens``): their slots stay with the request and
are overwritten by its next tokens, and since the prefix cache only registers blocks full of the
request's own tokens, a block never enters it with a rejected draft's KV in it
(docs/speculative_decoding.md).

Speculation backs off where it does not pay. Each request keeps an estimate of how often its
drafts are accepted (``alpha``, per draft, exponentially weighted over its verifications), and the
engine fits its step time as ``a + b * tokens`` over recent steps (without the worker's drafting,
priced apart as ``d`` a draft position); a draft at position ``i`` is worth its token when
``alpha ** i`` (the chance it is accepted) exceeds ``(b * B + d) / (a + b * B)`` for a step of ``B``
tokens: the share of the step that its tokens and its proposal cost, so the tokens per second it
adds exceed what the step makes now. The scheduler asks the worker for that many drafts of each
request sampling in a step (:meth:`SpecDecoding.draft_counts`), so a draft model runs only for
drafts that will be verified. One user on a memory-bound CPU drafts while acceptance is high; a large
batch, where each token costs nearly its share of the step, does not. A request that drafts nothing
probes with one draft after a pause (acceptance changes as the text does): 8 steps, twice as long
after each probe rejected, up to 64. No request drafts while more than ``disable_by_batch_size``
run (vLLM's hard limit), nor is asked to while more are unfinished.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from itertools import accumulate

from cadence.config import SpeculativeConfig
from cadence.core.kv_cache_manager import KVCacheManager
from cadence.core.step_plan import StepPlan
from cadence.core.structured_output import StructuredOutputManager
from cadence.messages import ModelRunnerOutput, SpecDecodeStats
from cadence.policies.base import SchedulingPolicy
from cadence.request import Request

# Steps between two probes of a request whose drafts are not worth verifying, at first and at most.
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 64
# Steps whose drafting time prices a draft position.
DRAFT_ROUNDS_KEPT = 15
# How fast old verifications and steps are forgotten (weight per new one).
_ALPHA_DECAY = 0.8
_COST_DECAY = 0.98


class StepCostFit:
    """Step time as ``a + b * tokens``, fitted by least squares over recent steps (exponentially weighted)."""

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = _COST_DECAY
        self.n, self.x, self.y = d * self.n + 1, d * self.x + tokens, d * self.y + seconds
        self.xx, self.xy = d * self.xx + tokens * tokens, d * self.xy + tokens * seconds

    def token_share(self, tokens: int, extra_seconds: float = 0.0) -> float | None:
        """``(b * tokens + extra_seconds) / (a + b * tokens)``: the part of a step of ``tokens`` tokens
        that its tokens (and ``extra_seconds`` more) cost, at most 1; None until steps of different
        sizes have been seen."""
        spread = self.n * self.xx - self.x * self.x
        if self.n < 4 or spread <= 1e-6 * self.n * self.n:
            return None
        b = max(0.0, (self.n * self.xy - self.x * self.y) / spread)
        a = (self.y - b * self.x) / self.n
        return min(1.0, (b * tokens + extra_seconds) / max(a + b * tokens, 1e-9))


class SpecDecoding:
    """How many drafts each decode verifies, and the engine's cumulative speculation counts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cost = StepCostFit()
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        # A draft model's forward for all the requests drafting (one per draft position), in seconds,
        # over recent steps; and how many the step being run asked for.
        self._draft_rounds: deque[float] = deque(maxlen=DRAFT_ROUNDS_KEPT)
        self._rounds_asked = 0

    def add_drafts(self, step: StepPlan, requests: Mapping[str, Request], allocator: KVCacheManager,
                   policy: SchedulingPolicy, grammars: StructuredOutputManager | None) -> None:
        """Let each decode of ``step`` verify its drafts with its token, in the running order (as many
        as were proposed: :meth:`draft_counts` asked for those worth verifying): within the budget left
        and its ``max_tokens``, up to the first its grammar refuses, as many as the policy allows, in
        blocks that are free (never preempting: short of blocks, it decodes one token)."""
        if len(step.scheduled) > self.config.disable_by_batch_size:
            return
        for request_id, num in list(step.scheduled.items()):
            request = requests[request_id]
            if num != 1 or request.num_tokens - request.num_computed_tokens != 1 or not request.drafts.token_ids:
                continue  # a prompt's chunk, or nothing drafted
            room = request.max_tokens - request.num_output_tokens - 1
            count = min(len(request.drafts.token_ids), step.budget, room)
            if count > 0 and grammars is not None:
                count = grammars.num_valid(request_id, request.drafts.token_ids[:count])
            count = max(0, min(count, policy.num_speculative_tokens(request, count))) if count > 0 else 0
            blocks = allocator.allocate(request, 1 + count) if count else None
            if blocks is not None:
                step.add_drafts(request, count, blocks)

    def draft_counts(self, step: StepPlan, requests: Mapping[str, Request]) -> dict[str, int]:
        """How many drafts the worker proposes, after ``step`` (final: its tokens counted as computed),
        for each request that samples in it: those worth verifying in the next step, whose decodes
        are this step's samples, or a probe; no more than its ``max_tokens`` can take then. None
        while more than ``disable_by_batch_size`` requests are unfinished (``requests``: running or
        waiting, so the next step may hold them all), so a draft model runs only for drafts that
        can be verified."""
        if len(requests) > self.config.disable_by_batch_size:  # the next step's batch, at most
            return {}
        sampling = [requests[request_id] for request_id in step.scheduled
                    if requests[request_id].num_computed_tokens >= requests[request_id].num_tokens]
        # A draft position costs its token in every request and a draft forward for them all.
        share = self.cost.token_share(len(sampling), self.draft_round_s)
        # Room after this step's token and the next step's own.
        counts = {request.request_id: min(self._worth(request, share),
                                          max(0, request.max_tokens - request.num_output_tokens - 2))
                  for request in sampling}
        self._rounds_asked = max(counts.values(), default=0)
        return counts

    def _worth(self, request: Request, share: float | None) -> int:
        """How many draft positions are worth verifying: those whose chance of acceptance exceeds the
        share of the step their token costs (all until the step cost is known), or one as a probe."""
        drafts = request.drafts
        k = self.config.num_speculative_tokens
        if share is not None:
            alpha = drafts.accepted / drafts.tried
            k = next((i for i in range(k) if alpha ** (i + 1) <= share), k)
        if k:
            return k
        if drafts.paused_steps:
            drafts.paused_steps -= 1
            return 0
        # Each probe rejected doubles the next pause: a draft model pays a forward for each probe.
        drafts.paused_steps = drafts.pause = min(2 * drafts.pause, MAX_PAUSE_STEPS) if drafts.pause else PAUSE_STEPS
        return 1

    def observe(self, tokens: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A step of ``tokens`` tokens took ``seconds`` (wall or modelled), ``draft_seconds`` of which
        the worker spent proposing the drafts asked for (a draft model's forwards: a cost of their own,
        by draft position, not by token)."""
        self.cost.observe(tokens, seconds - draft_seconds)
        if self._rounds_asked and draft_seconds > 0:
            self._draft_rounds.append(draft_seconds / self._rounds_asked)
        self._rounds_asked = 0

    @property
    def draft_round_s(self) -> float:
        """What a draft position costs the worker to propose, in seconds: the median over recent steps
        (a request's first proposal computes its whole prompt in the draft, once: not a round's cost)."""
        return statistics.median(self._draft_rounds) if self._draft_rounds else 0.0

    def settle(self, request: Request, output: ModelRunnerOutput, index: int) -> list[int]:
        """The tokens ``request`` (``output``'s ``index``-th) emits: its accepted drafts, then its
        sampled token. Takes back the rejected drafts' positions, counts, updates its acceptance estimate and keeps
        its next drafts."""
        drafts = request.drafts
        num_accepted = output.num_accepted_drafts[index] if output.num_accepted_drafts else 0
        next_drafts = output.draft_token_ids[index] if output.draft_token_ids else []
        scheduled, tokens = drafts.num_scheduled, [*drafts.token_ids[:num_accepted], output.sampled_token_ids[index]]
        if scheduled:
            request.num_computed_tokens -= scheduled - num_accepted
            self.num_drafts += 1
            self.num_draft_tokens += scheduled
            self.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                self.accepted_per_pos[position] += 1
            # Per draft: accepted ones, and the one rejected (the rest were never judged).
            drafts.accepted = _ALPHA_DECAY * drafts.accepted + num_accepted
            if num_accepted:  # probing again at once, after pauses from 8 steps on
                drafts.pause = drafts.paused_steps = 0
            drafts.tried = _ALPHA_DECAY * drafts.tried + num_accepted + (num_accepted < scheduled)
        drafts.token_ids, drafts.num_scheduled = next_drafts, 0
        return tokens

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               self.num_accepted_tokens + self.num_drafts, list(self.accepted_per_pos))


def logprob_starts(output: ModelRunnerOutput) -> list[int]:
    """Where each request's entries begin in ``output.logprobs`` (one per token it emitted)."""
    accepted = output.num_accepted_drafts or [0] * len(output.request_ids)
    return list(accumulate((1 + n for n in accepted), initial=0))
