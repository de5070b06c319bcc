"""The step being built: what the scheduler has decided so far, and what is left of its token and
time budgets (the time budget is :mod:`cadence.core.step_budget`'s, when an ITL target is set)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field

from cadence.core.cost_model import StepShape, step_shape
from cadence.core.scheduling_trace import LATENCY_TARGET, PREEMPTED_THIS_STEP, PROMPT_CAP, TOKEN_BUDGET
from cadence.core.step_budget import StepBudget
from cadence.request import Request


@dataclass
class StepPlan:
    budget: int  # tokens left
    step_budget: StepBudget | None = None
    running: InitVar[Sequence[Request]] = ()  # when the step began: its decodes set the prefills' time
    batch: InitVar[int] = 0  # the decode batch the engine's requests will make (StepBudget.prefill_time)
    max_prompts: InitVar[int] = 0  # waiting requests the step may admit (--max-prompts-per-step; 0: no cap)
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens, in scheduling order
    new_blocks: dict[str, list[list[int]]] = field(default_factory=dict)  # per KV cache group
    preempted: list[Request] = field(default_factory=list)
    drafts: dict[str, int] = field(default_factory=dict)  # request id -> drafted tokens it verifies
    preempted_for_running: bool = False
    # Seconds the step's prefill chunks may still take (inf: only the token budget bounds them).
    time_left: float = math.inf
    has_prefill: bool = False
    # Rows the step's linear layers take so far, its decodes from the start (under a latency target:
    # the first rows, up to the quantized kernel's row limit, cost more than the rest).
    rows: int = 0
    prompts_left: float = math.inf  # waiting requests the step may still admit

    def __post_init__(self, running: Sequence[Request], batch: int, max_prompts: int) -> None:
        if max_prompts:
            self.prompts_left = max_prompts
        if self.step_budget is not None:
            decode_ends = [r.num_tokens for r in running if r.num_tokens - r.num_computed_tokens == 1]
            self.time_left = self.step_budget.prefill_time(decode_ends, batch)
            self.rows = len(decode_ends)

    def token_budget(self, request: Request, start: int) -> int:
        """What ``request``, computed up to ``start``, may draw on: the tokens left, and for a prefill
        what fits the time left (at least one token for the step's first prefill, so prompts always move)."""
        if self.step_budget is None or self.time_left == math.inf or request.num_tokens - start <= 1:
            return self.budget
        fits = self.step_budget.prefill_tokens(self.time_left, start, self.rows)
        return min(self.budget, fits if fits or self.has_prefill else 1)

    def stop_reason(self, request: Request) -> str | None:
        """Why admission stops at waiting ``request`` before trying it: no tokens left, the step
        admitted its most prompts, or it was preempted in this step (it is not readmitted in the step
        that took its blocks)."""
        if self.budget == 0:
            return TOKEN_BUDGET
        if self.prompts_left <= 0:
            return PROMPT_CAP
        return PREEMPTED_THIS_STEP if any(r is request for r in self.preempted) else None

    def limit(self, request: Request, start: int) -> str:
        """What bounds ``request`` now, for the scheduling trace: the latency target when its time
        leaves less than the tokens left, else the token budget."""
        return LATENCY_TARGET if self.token_budget(request, start) < self.budget else TOKEN_BUDGET

    def admit(self, request: Request, num: int, blocks: list[list[int]], start: int) -> None:
        """:meth:`take` for a waiting request: one prompt fewer left to admit."""
        self.take(request, num, blocks, start)
        self.prompts_left -= 1

    def take(self, request: Request, num: int, blocks: list[list[int]], start: int) -> None:
        self.scheduled[request.request_id] = num
        self.new_blocks[request.request_id] = blocks
        self.budget -= num
        if request.num_tokens - start > 1:
            self.has_prefill = True
            if self.step_budget is not None:
                self.time_left -= self.step_budget.chunk_time(num, start, self.rows)
                self.rows += num

    def add_drafts(self, request: Request, num: int, blocks: list[list[int]]) -> None:
        """``request``'s tokens, taken already, go on with ``num`` drafts held in ``blocks`` as well
        (speculative decoding; per KV cache group). Their time comes out of what the prefills may take."""
        self.drafts[request.request_id] = num
        self.scheduled[request.request_id] += num
        for ids, more in zip(self.new_blocks[request.request_id], blocks, strict=True):
            ids.extend(more)
        self.budget -= num
        if self.step_budget is not None:
            self.time_left -= self.step_budget.draft_time(num, self.rows)
            self.rows += num

    def drop(self, request: Request) -> None:
        self.budget += self.scheduled.pop(request.request_id, 0)
        self.new_blocks.pop(request.request_id, None)
        self.drafts.pop(request.request_id, None)

    def shape(self, requests: Mapping[str, Request]) -> StepShape:
        """What the step computes, before the requests' computed counts move past it (``kernel_rows``
        counted with its step budget's model's row limit)."""
        chunks = []
        for request_id, num in self.scheduled.items():
            request = requests[request_id]
            end, drafts = request.num_computed_tokens + num, self.drafts.get(request_id, 0)
            chunks.append((num, end, end == request.num_tokens + drafts, drafts))
        return step_shape(chunks, None if self.step_budget is None else self.step_budget.model.row_limit)
