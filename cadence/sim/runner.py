"""The simulated model runner: takes the scheduler's steps exactly as the real runner does.

It keeps the same persistent batch the real :class:`~cadence.executor.model_runner.ModelRunner`
keeps (new requests arrive whole, running ones as deltas; finished and preempted ones are
dropped), but only counts: how many tokens each request knows and how many are computed. A
request whose scheduled tokens reach the end of what it knows (and of the drafts it verifies)
"samples"; what that step computed is summed into a :class:`~cadence.core.cost_model.StepShape`
for the cost model.

With speculative decoding, the simulated worker proposes the drafts the scheduler asks for each
sampled request (up to ``num_speculative_tokens``; a draft model's proposals take the cost model's
time for them, which the scheduler's back-off is told as the engine's is), and a verification accepts each draft in turn
with probability ``draft_acceptance`` (stopping at the first rejection), so the scheduler's
speculation (its drafts, back-off and budget) runs as in the engine, on the acceptance rate one
chooses to study.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from cadence.core.cost_model import CostModel, StepShape, step_shape
from cadence.messages import ModelRunnerOutput, SchedulerOutput

# Any id other than the requests' EOS would do: simulated requests end by length.
SIMULATED_TOKEN_ID = 1


# A request's own acceptance rate, from its ``extra_args`` (a trace line's): mixed workloads (code
# edits beside chat) accept drafts at very different rates.
ACCEPTANCE_ARG = "draft_acceptance"


@dataclass(frozen=True)
class SimulatedDrafts:
    """The simulated worker's speculation: drafts proposed per sampled request, and the chance that
    each is accepted (independently, until the first rejection), unless the request's
    ``extra_args`` give its own (``draft_acceptance``)."""

    num_drafts: int
    acceptance: float
    draft_model: bool = False  # proposals take a draft model's forwards (the cost model prices them)

    def __post_init__(self) -> None:
        if self.num_drafts < 1 or not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"need num_drafts >= 1 and an acceptance in [0, 1], got {self.num_drafts} and "
                             f"{self.acceptance}")


class ShapeTracker:
    """The runner's persistent batch, reduced to counts; turns each step into its shape.

    With ``draft_model``, a step's shape also counts the proposals the scheduler asks of the draft
    model after it (``draft_rounds``, ``draft_rows``); n-gram proposals cost nothing to count.
    ``row_limit`` is the quantized kernel's, which ``kernel_rows`` are counted with.
    """

    def __init__(self, draft_model: bool = False, row_limit: int | None = None) -> None:
        # request id -> [known tokens, computed tokens]
        self._counts: dict[str, list[int]] = {}
        self.draft_model = draft_model
        self.row_limit = row_limit

    def __len__(self) -> int:
        return len(self._counts)

    def step(self, out: SchedulerOutput) -> tuple[StepShape, list[str]]:
        """Apply one step; returns its shape and the ids that sample a token (in batch order)."""
        counts = self._counts
        for request_id in out.finished_request_ids:
            counts.pop(request_id, None)
        for request_id in out.preempted_request_ids:
            counts.pop(request_id, None)
        for new in out.new_requests:
            counts[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        for cached in out.cached_requests:
            counts[cached.request_id][1] = cached.num_computed_tokens
        sampled: list[str] = []
        chunks = []
        for request_id, num in out.num_scheduled_tokens.items():
            state = counts[request_id]
            drafts = len(out.spec_token_ids.get(request_id, ()))
            end = state[1] + num
            state[1] = end
            samples = end == state[0] + drafts
            if samples:
                sampled.append(request_id)
                state[0] = end + 1  # every draft accepted, until settle() says otherwise
            chunks.append((num, end, samples, drafts))
        shape = step_shape(chunks, self.row_limit)
        if self.draft_model:
            asked = [out.draft_counts.get(request_id, 0) for request_id in sampled]
            shape.draft_rounds, shape.draft_rows = max(asked, default=0), sum(asked)
        return shape, sampled

    def advance_decodes(self, request_ids: Iterable[str], num_steps: int, finished: Iterable[str]) -> None:
        """Apply ``num_steps`` decode-only steps of these requests at once (``decode_run.py``), once the
        ``finished`` ones that the first of them carries are dropped."""
        counts = self._counts
        for request_id in finished:
            counts.pop(request_id, None)
        for request_id in request_ids:
            state = counts[request_id]
            state[0] += num_steps
            state[1] += num_steps

    def settle(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Take back the positions of the drafts ``result`` rejected (speculative decoding)."""
        if result.num_accepted_drafts is None:
            return
        for request_id, accepted in zip(result.request_ids, result.num_accepted_drafts, strict=True):
            rejected = len(out.spec_token_ids.get(request_id, ())) - accepted
            state = self._counts.get(request_id)
            if rejected and state is not None:
                state[0] -= rejected
                state[1] -= rejected


class SimulatedRunner:
    """Stands in for the worker: answers each step at once and says how long it would have taken."""

    def __init__(self, cost_model: CostModel, drafts: SimulatedDrafts | None = None, seed: int = 0) -> None:
        self.cost_model = cost_model
        self.tracker = ShapeTracker(draft_model=drafts is not None and drafts.draft_model,
                                    row_limit=cost_model.row_limit)
        self.drafts = drafts
        self._rng = random.Random(seed)
        self._acceptance: dict[str, float] = {}  # requests with their own rate

    def execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, StepShape, float]:
        """The step's sampled tokens, its shape, and its modelled duration in seconds."""
        shape, sampled = self.tracker.step(out)
        result = ModelRunnerOutput(out.step_id, sampled, [SIMULATED_TOKEN_ID] * len(sampled))
        if self.drafts is not None:
            for request_id in out.finished_request_ids:
                self._acceptance.pop(request_id, None)
            for new in out.new_requests:
                rate = (new.sampling_params.extra_args or {}).get(ACCEPTANCE_ARG)
                if rate is not None:
                    self._acceptance[new.request_id] = float(rate)
            result.num_accepted_drafts = [self._accepted(r, len(out.spec_token_ids.get(r, ()))) for r in sampled]
            result.draft_token_ids = [[SIMULATED_TOKEN_ID] * min(self.drafts.num_drafts, out.draft_counts.get(r, 0))
                                      for r in sampled]
            self.tracker.settle(out, result)
            result.draft_time_s = self.cost_model.draft_time(shape)
        return result, shape, self.cost_model.step_time(shape)

    def _accepted(self, request_id: str, num_drafts: int) -> int:
        assert self.drafts is not None
        rate = self._acceptance.get(request_id, self.drafts.acceptance)
        accepted = 0
        while accepted < num_drafts and self._rng.random() < rate:
            accepted += 1
        return accepted
