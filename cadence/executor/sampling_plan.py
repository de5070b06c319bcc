"""The per-batch sampling plan and the logits processing it drives.

A :class:`SamplingPlan` is what a batch's params mean as tensors (which rows are greedy, their
temperatures, top-k/top-p/min-p, seeds, biases, min-tokens, penalties, logprobs counts), built once
and reused while the batch does not change. :func:`process_logits` applies the stages that every
row goes through before a token is chosen: logit bias, min-tokens mask and penalties.
:class:`Workspace` holds the sampler's reusable buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from cadence.backends.cpu_kernels import row_ops
from cadence.sampling_params import SamplingParams

_NEG_INF = float("-inf")


# ---- plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch, provided by the model runner."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step)
    eos_token_id: int | None


@dataclass(frozen=True, eq=False)
class RandomPlan:
    """Settings of the sampled (non-greedy) rows, in their order; None means "no row uses it"."""

    temperature: torch.Tensor | None  # [R, 1]
    log_min_p: torch.Tensor | None  # [R, 1], -inf where off
    top_k_index: torch.Tensor | None  # [R, 1], k - 1, 0 where off
    top_k_off: torch.Tensor | None  # [R, 1] bool
    top_k_max: int
    top_k_by_row: torch.Tensor | None  # [R] int64: every sampled row's k (0 where off), as the filter kernel takes it
    top_p_rows: torch.Tensor | None  # positions (among the sampled rows) whose top_p < 1
    top_p_all: bool  # every sampled row has top_p < 1
    top_p: torch.Tensor | None  # [len(top_p_rows)]
    top_p_by_row: torch.Tensor | None  # [R]: every sampled row's top_p (1 where off), as the race kernel takes it
    seeded: list[tuple[int, int, int]]  # (position among the sampled rows, batch row, seed)


@dataclass(frozen=True, eq=False)
class PenaltyPlan:
    """The rows that use penalties, and every row's factors ``[B]`` (None where all are neutral)."""

    rows: list[int]
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class SamplingPlan:
    """Everything about a batch that depends only on its params, eos ids, vocab size and device.

    Built once and reused while the model runner hands in the same params objects in the same
    order (the persistent batch makes that the usual case between admissions and finishes).
    Params are treated as immutable once a request is submitted, as everywhere in the engine.
    """

    params: tuple[SamplingParams, ...]
    eos: tuple[int | None, ...]
    vocab_size: int
    device: torch.device
    # Index tensors of the greedy / sampled rows; None when the batch is not mixed.
    greedy_idx: torch.Tensor | None
    random_idx: torch.Tensor | None
    random: RandomPlan | None  # None when all rows are greedy
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    min_tokens: list[tuple[int, int, list[int]]]  # (row, min_tokens, token ids to mask)
    penalties: PenaltyPlan | None
    logprobs_k: list[int] | None  # top-k count per row, None when no row asked

    def matches(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> bool:
        if len(rows) != len(self.params) or vocab_size != self.vocab_size or device != self.device:
            return False
        # Identity, not equality: cheap, and the plan holds references so ids cannot be reused.
        if not all(map(operator.is_, self.params, [r.params for r in rows])):
            return False
        return all(rows[i].eos_token_id == self.eos[i] for i, _, _ in self.min_tokens)


def build_plan(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingPlan:
    params = tuple(r.params for r in rows)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    mixed = bool(greedy_rows and random_rows)
    penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
    biases = [(i, tid, value) for i, p in enumerate(params) for tid, value in (p.logit_bias or {}).items()]
    return SamplingPlan(
        params=params,
        eos=tuple(r.eos_token_id for r in rows),
        vocab_size=vocab_size,
        device=device,
        greedy_idx=_long(greedy_rows, device) if mixed else None,
        random_idx=_long(random_rows, device) if mixed else None,
        random=_build_random_plan(params, random_rows, vocab_size, device) if random_rows else None,
        bias=(
            (_long([b[0] for b in biases], device), _long([b[1] for b in biases], device),
             _float([b[2] for b in biases], device))
            if biases else None
        ),
        min_tokens=[
            (i, p.min_tokens, _min_tokens_mask_ids(p, rows[i].eos_token_id))
            for i, p in enumerate(params)
            if p.min_tokens > 0
        ],
        penalties=_build_penalty_plan(params, penalty_rows, device) if penalty_rows else None,
        logprobs_k=[p.logprobs or 0 for p in params] if any(p.logprobs is not None for p in params) else None,
    )


def _build_random_plan(
    params: tuple[SamplingParams, ...], random_rows: list[int], vocab_size: int, device: torch.device
) -> RandomPlan:
    rparams = [params[i] for i in random_rows]
    temps = [p.temperature for p in rparams]
    min_ps = [p.min_p for p in rparams]
    # top-k at or above the vocabulary size keeps everything, so it counts as off.
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in rparams]
    top_p_rows = [j for j, p in enumerate(rparams) if p.top_p < 1]
    any_top_k = any(top_ks)
    return RandomPlan(
        temperature=_float(temps, device).unsqueeze(1) if any(t != 1.0 for t in temps) else None,
        log_min_p=_float(min_ps, device).log().unsqueeze(1) if any(m > 0 for m in min_ps) else None,
        top_k_index=_long([max(k - 1, 0) for k in top_ks], device).unsqueeze(1) if any_top_k else None,
        top_k_off=torch.tensor([k == 0 for k in top_ks], device=device).unsqueeze(1) if any_top_k else None,
        top_k_max=max(top_ks),
        top_k_by_row=_long(top_ks, device) if any_top_k else None,
        top_p_rows=_long(top_p_rows, device) if top_p_rows else None,
        top_p_all=len(top_p_rows) == len(rparams),
        top_p=_float([rparams[j].top_p for j in top_p_rows], device) if top_p_rows else None,
        top_p_by_row=_float([min(p.top_p, 1.0) for p in rparams], device) if top_p_rows else None,
        seeded=[(j, i, seed) for j, i in enumerate(random_rows) if (seed := params[i].seed) is not None],
    )


def _build_penalty_plan(
    params: tuple[SamplingParams, ...], penalty_rows: list[int], device: torch.device
) -> PenaltyPlan:
    additive = any(params[i].frequency_penalty != 0 or params[i].presence_penalty != 0 for i in penalty_rows)
    return PenaltyPlan(
        rows=penalty_rows,
        repetition=(
            _float([p.repetition_penalty for p in params], device)
            if any(params[i].repetition_penalty != 1 for i in penalty_rows) else None
        ),
        frequency=_float([p.frequency_penalty for p in params], device) if additive else None,
        presence=_float([p.presence_penalty for p in params], device) if additive else None,
    )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _min_tokens_mask_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    # EOS is masked even under ignore_eos, as vLLM does (it puts the model's EOS into every
    # request's min-tokens stop set): min_tokens is a floor on output length, not a stop rule.
    ids = list(params.stop_token_ids)
    if eos_token_id is not None:
        ids.append(eos_token_id)
    return ids


# ---- logit processing (all rows) -------------------------------------------------------------


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], plan: SamplingPlan, ws: Workspace
) -> torch.Tensor:
    """Logit bias, min-tokens mask, penalties. Returns ``logits`` itself when none applies."""
    masked = [
        (i, ids)
        for i, min_tokens, ids in plan.min_tokens
        if ids and len(rows[i].output_token_ids) < min_tokens
    ]
    if plan.bias is None and not masked and plan.penalties is None:
        return logits
    # A private contiguous copy: the caller's logits stay untouched, and penalties use flat views.
    out = ws.take("processed", logits).copy_(logits)
    if plan.bias is not None:
        b_rows, b_ids, b_vals = plan.bias
        out.index_put_((b_rows, b_ids), b_vals, accumulate=True)
    if masked:
        m_rows = [i for i, ids in masked for _ in ids]
        m_ids = list(chain.from_iterable(ids for _, ids in masked))
        out[torch.tensor(m_rows, device=out.device), torch.tensor(m_ids, device=out.device)] = _NEG_INF
    if plan.penalties is not None:
        _apply_penalties(out, rows, plan.penalties)
    return out


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], plan: PenaltyPlan) -> None:
    """Penalties, in place on the contiguous ``[B, V]`` logits.

    Works on flat ``row * V + token`` indices of the tokens seen, so the cost follows the
    number of tokens, not ``B * V``.
    """
    ops = row_ops(logits)
    if ops is not None:  # csrc/penalties.cpp: the same values, over each row's tokens without sorting them
        outputs = [rows[i].output_token_ids for i in plan.rows]
        prompts = [rows[i].prompt_token_ids if plan.repetition is not None else [] for i in plan.rows]
        ops.apply_penalties(logits, _long(plan.rows, logits.device), *_ids_and_offsets(prompts),
                            *_ids_and_offsets(outputs), plan.repetition, plan.frequency, plan.presence)
        return
    vocab, flat, device = logits.shape[1], logits.view(-1), logits.device
    output_ids = _flat_ids([rows[i].output_token_ids for i in plan.rows], plan.rows, vocab, device)
    if plan.repetition is not None:
        # HF / vLLM: a token seen in the prompt or the output moves towards zero by the factor.
        prompt_ids = _flat_ids([rows[i].prompt_token_ids for i in plan.rows], plan.rows, vocab, device)
        seen = torch.unique(torch.cat([output_ids, prompt_ids]))
        factor, values = plan.repetition[seen // vocab], flat[seen]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    if plan.frequency is not None and plan.presence is not None:
        # OpenAI: frequency per occurrence, presence once, both over the generated tokens only.
        ids, counts = torch.unique(output_ids, return_counts=True)
        row_of = ids // vocab
        flat.index_add_(0, ids, -(plan.frequency[row_of] * counts + plan.presence[row_of]))


def _ids_and_offsets(token_lists: list[list[int]], device: torch.device | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every list's tokens one after another, and where each list starts (its end the next's start)."""
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    offsets = torch.tensor([0, *accumulate(len(tokens) for tokens in token_lists)], dtype=torch.long, device=device)
    return ids, offsets


def _flat_ids(
    token_lists: list[list[int]], batch_rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab + token`` for every token of ``token_lists[j]``, with row ``batch_rows[j]``."""
    tokens, offsets = _ids_and_offsets(token_lists, device)
    return torch.repeat_interleave(_long(batch_rows, device) * vocab, offsets.diff()) + tokens


# ---- buffers ---------------------------------------------------------------------------------


class Workspace:
    """Reusable float32 buffers on the CPU, one per role, grown to the largest batch seen.

    Fresh tensors above glibc's mmap threshold (at most 32 MiB; a [256, 49152] float32 tensor is
    48 MiB) are mapped and unmapped on every call, and the page faults doubled the sampler's time
    at B=256. On other devices the caching allocator already reuses memory, so this allocates.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised float32 tensor shaped like ``like``; valid until ``role`` is taken again."""
        if like.device.type != "cpu":
            return torch.empty(like.shape, dtype=torch.float32, device=like.device)
        rows, vocab = like.shape
        buf = self._buffers.get(role)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab:
            buf = self._buffers[role] = torch.empty(rows, vocab, dtype=torch.float32)
        return buf[:rows]
