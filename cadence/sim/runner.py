"""The simulated model runner: takes the scheduler's steps exactly as the real runner does.

It keeps the same persistent batch the real :class:`~cadence.executor.model_runner.ModelRunner`
keeps (new requests arrive whole, running ones as deltas; finished and preempted ones are
dropped), but only counts: how many tokens each request knows and how many are computed. A
request whose scheduled tokens reach the end of what it knows "samples" a token; what that step
computed is summed into a :class:`~cadence.core.cost_model.StepShape` for the cost model.
"""

from __future__ import annotations

from cadence.core.cost_model import CostModel, StepShape, step_shape
from cadence.messages import ModelRunnerOutput, SchedulerOutput

# Any id other than the requests' EOS would do: simulated requests end by length.
SIMULATED_TOKEN_ID = 1


class ShapeTracker:
    """The runner's persistent batch, reduced to counts; turns each step into its shape."""

    def __init__(self) -> None:
        # request id -> [known tokens, computed tokens]
        self._counts: dict[str, list[int]] = {}

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
            end = state[1] + num
            state[1] = end
            samples = end == state[0]
            if samples:
                sampled.append(request_id)
                state[0] = end + 1
            chunks.append((num, end, samples))
        shape = step_shape(chunks)
        return shape, sampled


class SimulatedRunner:
    """Stands in for the worker: answers each step at once and says how long it would have taken."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.tracker = ShapeTracker()

    def execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, StepShape, float]:
        """The step's sampled tokens, its shape, and its modelled duration in seconds."""
        shape, sampled = self.tracker.step(out)
        result = ModelRunnerOutput(out.step_id, sampled, [SIMULATED_TOKEN_ID] * len(sampled))
        return result, shape, self.cost_model.step_time(shape)
