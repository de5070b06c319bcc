"""Turns one step's logits into one token per request, in a single batched pass.

The order is fixed, as in vLLM V1: logprobs of the raw logits; logit bias; min-tokens mask;
penalties (repetition, frequency, presence); greedy rows take the argmax; the others go through
temperature, min-p, top-k and top-p and are drawn by an exponential race (argmax of probs / E,
E ~ Exponential(1)). Every stage is a batched tensor op that runs only when some row needs it;
per-row Python work is limited to rows that ask for something uncommon (seeds, min-tokens,
penalties, logit bias).

Structured output comes first, before the sampler: the model runner masks the constrained rows'
logits with :func:`apply_grammar_bitmask`, so raw logprobs describe the constrained distribution
(as in vLLM V1).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from cadence.backends.cpu_kernels import cpu_ops
from cadence.messages import GrammarBitmask, TokenLogprobs
from cadence.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch, provided by the model runner."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before this step)
    eos_token_id: int | None


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and logprobs when any row asked for them.

    ``logprobs`` is None unless some row has ``params.logprobs is not None``; then it is aligned
    with the rows, and a row that did not ask gets an entry with only its sampled token.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None


@dataclass(frozen=True, eq=False)
class _RandomPlan:
    """Settings of the sampled (non-greedy) rows, in their order; None means "no row uses it"."""

    temperature: torch.Tensor | None  # [R, 1]
    log_min_p: torch.Tensor | None  # [R, 1], -inf where off
    top_k_index: torch.Tensor | None  # [R, 1], k - 1, 0 where off
    top_k_off: torch.Tensor | None  # [R, 1] bool
    top_k_max: int
    top_p_rows: torch.Tensor | None  # positions (among the sampled rows) whose top_p < 1
    top_p_all: bool  # every sampled row has top_p < 1
    top_p: torch.Tensor | None  # [len(top_p_rows)]
    seeded: list[tuple[int, int, int]]  # (position among the sampled rows, batch row, seed)


@dataclass(frozen=True, eq=False)
class _PenaltyPlan:
    """The rows that use penalties, and every row's factors ``[B]`` (None where all are neutral)."""

    rows: list[int]
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class _Plan:
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
    random: _RandomPlan | None  # None when all rows are greedy
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    min_tokens: list[tuple[int, int, list[int]]]  # (row, min_tokens, token ids to mask)
    penalties: _PenaltyPlan | None
    logprobs_k: list[int] | None  # top-k count per row, None when no row asked

    def matches(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> bool:
        if len(rows) != len(self.params) or vocab_size != self.vocab_size or device != self.device:
            return False
        # Identity, not equality: cheap, and the plan holds references so ids cannot be reused.
        if not all(map(operator.is_, self.params, [r.params for r in rows])):
            return False
        return all(rows[i].eos_token_id == self.eos[i] for i, _, _ in self.min_tokens)


class _Workspace:
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


class Sampler:
    """Samples one token per row from ``[B, V]`` float32 logits; never modifies the logits.

    Keeps a plan of the batch's settings and reusable buffers between calls, so one instance
    belongs to one model runner (it is not thread-safe).
    """

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._workspace = _Workspace()

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

        processed = _process_logits(logits, rows, plan, ws)
        tokens = _choose_tokens(processed, processed is not logits, rows, plan, ws)

        logprobs = None
        if raw_logprobs is not None and plan.logprobs_k is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, plan.logprobs_k, ws)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after logit bias, min-tokens mask and penalties: what greedy rows argmax.

        Returns ``logits`` itself when no row needs any of these; never modifies it.
        """
        _check_shape(logits, rows)
        plan = self._plan_for(rows, logits.shape[1], logits.device)
        processed = _process_logits(logits.float(), rows, plan, self._workspace)
        return processed if processed is logits else processed.clone()

    def _plan_for(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> _Plan:
        if self._plan is None or not self._plan.matches(rows, vocab_size, device):
            self._plan = _build_plan(rows, vocab_size, device)
        return self._plan


def apply_grammar_bitmask(logits: torch.Tensor, row_ids: Sequence[str], grammar: GrammarBitmask) -> None:
    """Set to -inf, in place, each constrained row's tokens that its grammar forbids.

    ``logits[i]`` belongs to request ``row_ids[i]``; every request of ``grammar`` must be among them.
    """
    import xgrammar  # present whenever a bitmask is: the scheduler made it with xgrammar

    index = {request_id: i for i, request_id in enumerate(row_ids)}
    rows = [index[request_id] for request_id in grammar.request_ids]
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


# ---- plan ------------------------------------------------------------------------------------


def _build_plan(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> _Plan:
    params = tuple(r.params for r in rows)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    mixed = bool(greedy_rows and random_rows)
    penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
    biases = [(i, tid, value) for i, p in enumerate(params) for tid, value in (p.logit_bias or {}).items()]
    return _Plan(
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
) -> _RandomPlan:
    rparams = [params[i] for i in random_rows]
    temps = [p.temperature for p in rparams]
    min_ps = [p.min_p for p in rparams]
    # top-k at or above the vocabulary size keeps everything, so it counts as off.
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in rparams]
    top_p_rows = [j for j, p in enumerate(rparams) if p.top_p < 1]
    any_top_k = any(top_ks)
    return _RandomPlan(
        temperature=_float(temps, device).unsqueeze(1) if any(t != 1.0 for t in temps) else None,
        log_min_p=_float(min_ps, device).log().unsqueeze(1) if any(m > 0 for m in min_ps) else None,
        top_k_index=_long([max(k - 1, 0) for k in top_ks], device).unsqueeze(1) if any_top_k else None,
        top_k_off=torch.tensor([k == 0 for k in top_ks], device=device).unsqueeze(1) if any_top_k else None,
        top_k_max=max(top_ks),
        top_p_rows=_long(top_p_rows, device) if top_p_rows else None,
        top_p_all=len(top_p_rows) == len(rparams),
        top_p=_float([rparams[j].top_p for j in top_p_rows], device) if top_p_rows else None,
        seeded=[(j, i, seed) for j, i in enumerate(random_rows) if (seed := params[i].seed) is not None],
    )


def _build_penalty_plan(
    params: tuple[SamplingParams, ...], penalty_rows: list[int], device: torch.device
) -> _PenaltyPlan:
    additive = any(params[i].frequency_penalty != 0 or params[i].presence_penalty != 0 for i in penalty_rows)
    return _PenaltyPlan(
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


def _process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan, ws: _Workspace
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


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], plan: _PenaltyPlan) -> None:
    """Penalties, in place on the contiguous ``[B, V]`` logits.

    Works on flat ``row * V + token`` indices of the tokens seen, so the cost follows the
    number of tokens, not ``B * V``.
    """
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


def _flat_ids(
    token_lists: list[list[int]], batch_rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab + token`` for every token of ``token_lists[j]``, with row ``batch_rows[j]``."""
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    return torch.repeat_interleave(_long(batch_rows, device) * vocab, lengths) + tokens


# ---- token choice ----------------------------------------------------------------------------


# Row gathers use advanced indexing: Tensor.index_select on a [64, 49152] CPU tensor measured
# ~6x slower than x[idx] under torch 2.13 (and far worse when the CPUs are contended).


def _choose_tokens(
    logits: torch.Tensor, owned: bool, rows: Sequence[SamplingRow], plan: _Plan, ws: _Workspace
) -> torch.Tensor:
    """Greedy argmax or sampling per row. ``owned``: ``logits`` may be modified in place."""
    if plan.random is None:
        return _argmax(logits)
    if plan.random_idx is None or plan.greedy_idx is None:  # every row samples
        return _sample(logits, owned, rows, plan.random, ws)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    tokens.index_copy_(0, plan.greedy_idx, _argmax(logits[plan.greedy_idx]))
    sampled = _sample(logits[plan.random_idx], True, rows, plan.random, ws)
    tokens.index_copy_(0, plan.random_idx, sampled)
    return tokens


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[B, V]`` fp32 rows, by the C++ kernel on CPUs that run it (4x faster)."""
    runs = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    ops = cpu_ops() if runs else None
    return x.argmax(dim=-1) if ops is None else ops.argmax_rows(x)


def _sample(
    logits: torch.Tensor, owned: bool, rows: Sequence[SamplingRow], plan: _RandomPlan, ws: _Workspace
) -> torch.Tensor:
    """Temperature, min-p, top-k, then an exponential race with top-p by rejection.

    ``logits`` holds the sampled rows only, in ``random_idx`` order; it is modified in place only
    when ``owned`` (otherwise it is the caller's tensor).
    """
    x = logits
    if plan.temperature is not None:
        x = x.div_(plan.temperature) if owned else torch.div(x, plan.temperature, out=ws.take("x", x))
        owned = True
    if not owned and (plan.log_min_p is not None or plan.top_k_index is not None):
        x = ws.take("x", x).copy_(x)
    if plan.log_min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + plan.log_min_p, _NEG_INF)
    if plan.top_k_index is not None and plan.top_k_off is not None:
        # Threshold at the k-th largest value (ties with it are kept, as in vLLM); one topk of the
        # largest k in the batch instead of a full sort.
        kth = x.topk(plan.top_k_max, dim=-1).values.gather(1, plan.top_k_index)
        x.masked_fill_(x < kth.masked_fill_(plan.top_k_off, _NEG_INF), _NEG_INF)
    probs = torch.softmax(x, dim=-1, out=ws.take("probs", x))

    generators = {
        pos: _row_generator(seed, len(rows[row].output_token_ids), logits.device)
        for pos, row, seed in plan.seeded
    }
    tokens = _race(probs, ws.take("noise", probs), list(generators.items()))
    if plan.top_p_rows is not None and plan.top_p is not None:
        nucleus_probs = probs if plan.top_p_all else probs[plan.top_p_rows]
        scratch = ws.take("x", nucleus_probs)  # x is dead once probs exist
        _resample_outside_top_p(nucleus_probs, scratch, tokens, plan.top_p_rows, plan.top_p, generators)
    return tokens


def _resample_outside_top_p(
    probs: torch.Tensor,
    scratch: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    top_p: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> None:
    """Make ``tokens[rows]`` draws from those rows' top-p nucleus, by rejection (in place).

    ``probs`` holds the probabilities of ``rows`` (read only), ``tokens`` their first draws;
    ``scratch`` is a buffer of the same shape.

    A token is in the nucleus iff the mass of tokens strictly more likely than it is < top_p
    (the same set vLLM's sort-and-cumsum mask keeps). A draw outside it is rejected; that token
    and every less likely one are then dropped (all are outside too) and the row draws again.
    Conditioned on acceptance the draw follows the renormalised nucleus, so this equals masking
    then sampling, without sorting the vocabulary (a [64, 49152] sort costs ~100 ms on 2 CPU
    threads; the check here ~4 ms). The most likely token is always accepted and each rejection
    removes at least one token, so the loop ends; the expected number of rounds is about
    1 + ln(1 / nucleus mass), i.e. one or two for usual top_p.
    """
    active, p = rows, probs
    while True:
        chosen_p = p.gather(1, tokens[active].unsqueeze(1))
        mass_above = torch.mul(p, p > chosen_p, out=scratch[: p.shape[0]]).sum(dim=-1)
        rejected = mass_above >= top_p
        if not bool(rejected.any()):
            return
        active, top_p, p, chosen_p = active[rejected], top_p[rejected], p[rejected], chosen_p[rejected]
        p.masked_fill_(p <= chosen_p, 0.0)
        row_gens = []
        if generators:
            row_gens = [(j, generators[a]) for j, a in enumerate(active.tolist()) if a in generators]
        tokens.index_copy_(0, active, _race(p, scratch[: p.shape[0]], row_gens))


def _race(
    probs: torch.Tensor, noise: torch.Tensor, row_generators: list[tuple[int, torch.Generator]]
) -> torch.Tensor:
    """One exponential race per row, with ``noise`` (same shape as ``probs``) as the buffer.

    argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks i with probability p_i / sum(p). E is built
    as -log(U): on CPU that is ~6x faster than ``Tensor.exponential_``, and U < 1 keeps E > 0,
    so no token can win by a division by zero (U == 0 gives E = inf, which only drops that one
    token from that one draw). Rows in ``row_generators`` draw U from their own generator.
    """
    if len(row_generators) < noise.shape[0]:
        noise.uniform_()
    for row, generator in row_generators:
        noise[row].uniform_(generator=generator)
    noise.log_().neg_()
    return _argmax(torch.div(probs, noise, out=noise))


def _row_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded row at one output position (splitmix64 of both)."""
    z = ((seed & _MASK64) + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device=device)
    generator.manual_seed(z ^ (z >> 31))
    return generator


# ---- logprobs --------------------------------------------------------------------------------


def _gather_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, top_counts: list[int], ws: _Workspace
) -> list[TokenLogprobs]:
    """The sampled token's logprob and rank for every row, plus each row's requested top-k."""
    sampled = raw.gather(1, tokens.unsqueeze(1))
    # Count in float32 (exact below 2**24): summing a bool tensor first casts it to int64,
    # which measured 4x slower than the comparison itself.
    ranks = (torch.gt(raw, sampled, out=ws.take("probs", raw)).sum(dim=-1) + 1).long().tolist()
    k_max = min(max(top_counts), raw.shape[1])
    top_ids: list[list[int]] = [[] for _ in top_counts]
    top_lps: list[list[float]] = [[] for _ in top_counts]
    if k_max > 0:
        values, indices = raw.topk(k_max, dim=-1)
        top_ids, top_lps = indices.tolist(), values.tolist()
    return [
        TokenLogprobs(token_ids=[tok, *ids[:k]], logprobs=[lp, *lps[:k]], sampled_rank=rank)
        for tok, lp, rank, ids, lps, k in zip(
            tokens.tolist(), sampled.squeeze(1).tolist(), ranks, top_ids, top_lps, top_counts, strict=True
        )
    ]
