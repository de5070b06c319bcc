"""Turns one step's logits into one token per request, in a single batched pass.

The order is fixed, as in vLLM V1: logprobs of the raw logits; logit bias; min-tokens mask;
penalties (repetition, frequency, presence); greedy rows take the argmax; the others go through
temperature, min-p, top-k and top-p and are drawn by an exponential race (argmax of probs / E,
E ~ Exponential(1)). Every stage is a batched tensor op that runs only when some row needs it;
per-row Python work is limited to rows that ask for something uncommon (seeds, min-tokens,
penalties, logit bias).

The stages live in two modules beside this one: :mod:`cadence.executor.sampling_plan` turns a
batch's params into a plan once and applies logit bias, min-tokens and penalties;
:mod:`cadence.executor.token_choice` picks the tokens and gathers their logprobs.

Structured output comes first, before the sampler: the model runner masks the constrained rows'
logits with :func:`apply_grammar_bitmask`, so raw logprobs describe the constrained distribution
(as in vLLM V1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cadence.executor.sampling_plan import SamplingPlan, SamplingRow, Workspace, build_plan, process_logits
from cadence.executor.token_choice import choose_tokens, gather_logprobs
from cadence.messages import GrammarBitmask, TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and logprobs when any row asked for them.

    ``logprobs`` is None unless some row has ``params.logprobs is not None``; then it is aligned
    with the rows, and a row that did not ask gets an entry with only its sampled token.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None


class Sampler:
    """Samples one token per row from ``[B, V]`` float32 logits; never modifies the logits.

    Keeps a plan of the batch's settings and reusable buffers between calls, so one instance
    belongs to one model runner (it is not thread-safe).
    """

    def __init__(self) -> None:
        self._plan: SamplingPlan | None = None
        self._workspace = Workspace()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample the next token of every row.

        ``logits[i]`` belongs to ``rows[i]``. A row with a seed draws its randomness from a
        generator seeded by ``(seed, len(output_token_ids))``, so its token does not depend on
        the rest of the batch, its position in it, or on preemption.

        :raises ValueError: if ``logits`` is not ``[len(rows), V]``.
        """
        _check_shape(logits, rows)
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=None)
        plan = self._plan_for(rows, logits.shape[1], logits.device)
        if logits.dtype != torch.float32:
            logits = logits.float()
        ws = self._workspace
        raw_logprobs = None
        if plan.logprobs_k is not None:
            # vLLM V1 default: logprobs describe the model's distribution, before any processing.
            raw_logprobs = torch.log_softmax(logits, dim=-1, out=ws.take("logprobs", logits))

        processed = process_logits(logits, rows, plan, ws)
        tokens = choose_tokens(processed, processed is not logits, rows, plan, ws)

        logprobs = None
        if raw_logprobs is not None and plan.logprobs_k is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, plan.logprobs_k, ws)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], top_counts: list[int]) -> list[TokenLogprobs]:
        """Each row's logprob of its target (the prompt's next token) and its top ``top_counts``,
        from the raw logits (as sampled tokens' logprobs)."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        tokens = torch.tensor(targets, dtype=torch.long, device=logits.device)
        return gather_logprobs(raw, tokens, top_counts, self._workspace)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after logit bias, min-tokens mask and penalties: what greedy rows argmax.

        Returns ``logits`` itself when no row needs any of these; never modifies it.
        """
        _check_shape(logits, rows)
        plan = self._plan_for(rows, logits.shape[1], logits.device)
        processed = process_logits(logits.float(), rows, plan, self._workspace)
        return processed if processed is logits else processed.clone()

    def _plan_for(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingPlan:
        if self._plan is None or not self._plan.matches(rows, vocab_size, device):
            self._plan = build_plan(rows, vocab_size, device)
        return self._plan


def apply_grammar_bitmask(logits: torch.Tensor, row_ids: Sequence[str], grammar: GrammarBitmask) -> None:
    """Set to -inf, in place, each constrained row's tokens that its grammar forbids.

    ``logits[i]`` belongs to request ``row_ids[i]``; every request of ``grammar`` must be among them,
    with as many rows (a request verifying drafts has one per position, in order).
    """
    import xgrammar  # present whenever a bitmask is: the scheduler made it with xgrammar

    index: dict[str, list[int]] = {}
    for i, request_id in enumerate(row_ids):
        index.setdefault(request_id, []).append(i)
    taken: dict[str, int] = {}
    rows = []
    for request_id in grammar.request_ids:
        nth = taken[request_id] = taken.get(request_id, -1) + 1
        rows.append(index[request_id][nth])
    bitmask = grammar.bitmask.to(logits.device, non_blocking=True)
    if rows != list(range(logits.shape[0])):
        # xgrammar's indices select rows of the logits and of the bitmask alike: align the bitmask.
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype, device=logits.device)
        aligned[rows] = bitmask
        bitmask = aligned
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def _check_shape(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
