"""From processed logits to one token per row, and the logprobs of that choice.

Greedy rows take the argmax; the others go through temperature, min-p, top-k and top-p and are
drawn by an exponential race (argmax of probs / E, E ~ Exponential(1)). A seeded row draws from
its own generator, seeded by the request's seed and its output position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cadence.backends.cpu_kernels import row_ops
from cadence.executor.sampling_plan import RandomPlan, SamplingPlan, SamplingRow, Workspace
from cadence.messages import TokenLogprobs

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
# Rejection rounds of top-p sampling before the rows still rejected take their most likely token.
_TOP_P_MAX_ROUNDS = 64


# ---- token choice ----------------------------------------------------------------------------


# Row gathers use advanced indexing: Tensor.index_select on a [64, 49152] CPU tensor measured
# ~6x slower than x[idx] under torch 2.13 (and far worse when the CPUs are contended).


def choose_tokens(
    logits: torch.Tensor, owned: bool, rows: Sequence[SamplingRow], plan: SamplingPlan, ws: Workspace
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
    """``x.argmax(dim=-1)`` of ``[B, V]`` fp32 rows, by the C++ kernel where it runs: 4x faster than
    torch's with AVX-512; with AVX2 [1, 49152] 13.5 us against 56, [64, 49152] 0.38 ms against 1.8-4.0."""
    ops = row_ops(x)
    return x.argmax(dim=-1) if ops is None else ops.argmax_rows(x)


def _sample(
    logits: torch.Tensor, owned: bool, rows: Sequence[SamplingRow], plan: RandomPlan, ws: Workspace
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
    ops = row_ops(x)
    if ops is not None and (plan.log_min_p is not None or plan.top_k_by_row is not None):
        # csrc/logit_filters.cpp: the same tokens kept as the torch ops below, a row at a time
        ops.filter_rows(x, plan.top_k_by_row, None if plan.log_min_p is None else plan.log_min_p.view(-1))
    else:
        _filter(x, plan)
    probs = torch.softmax(x, dim=-1, out=ws.take("probs", x))

    generators = {
        pos: _row_generator(seed, len(rows[row].output_token_ids), logits.device)
        for pos, row, seed in plan.seeded
    }
    if ops is not None:  # the race and top-p's rejection rounds, row by row in C++
        keys = _race_keys(probs.shape[0], list(generators.items()))
        return ops.race_rows(probs, keys, plan.top_p_by_row, _TOP_P_MAX_ROUNDS)
    tokens = _race(probs, ws.take("noise", probs), list(generators.items()))
    if plan.top_p_rows is not None and plan.top_p is not None:
        nucleus_probs = probs if plan.top_p_all else probs[plan.top_p_rows]
        scratch = ws.take("x", nucleus_probs)  # x is dead once probs exist
        _resample_outside_top_p(nucleus_probs, scratch, tokens, plan.top_p_rows, plan.top_p, generators)
    return tokens


def _filter(x: torch.Tensor, plan: RandomPlan) -> None:
    """Min-p, then top-k, by torch ops, in place (where ``filter_rows`` does not run)."""
    if plan.log_min_p is not None:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + plan.log_min_p, _NEG_INF)
    if plan.top_k_index is not None and plan.top_k_off is not None:
        # Threshold at the k-th largest value (ties with it are kept, as in vLLM); one topk of the
        # largest k in the batch instead of a full sort.
        kth = x.topk(plan.top_k_max, dim=-1).values.gather(1, plan.top_k_index)
        x.masked_fill_(x < kth.masked_fill_(plan.top_k_off, _NEG_INF), _NEG_INF)


def _resample_outside_top_p(
    probs: torch.Tensor,
    scratch: torch.Tensor,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    top_p: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> None:
    """Make ``tokens[rows]`` draws from those rows' top-p nucleus, by rejection (in place), in torch
    ops where the race kernel does not run (``csrc/race.cpp`` makes the same rounds row by row).

    ``probs`` holds the probabilities of ``rows`` (read only), ``tokens`` their first draws;
    ``scratch`` is a buffer of the same shape.

    A token is in the nucleus iff the mass of tokens strictly more likely than it is < top_p
    (the same set vLLM's sort-and-cumsum mask keeps). A draw outside it is rejected; that token
    and every less likely one are then dropped (all are outside too) and the row draws again.
    Conditioned on acceptance the draw follows the renormalised nucleus, so this equals masking
    then sampling, without sorting the vocabulary (a [64, 49152] sort costs ~100 ms on 2 CPU
    threads; the check here ~4 ms).

    Bounded whatever the input: a row still rejected after :data:`_TOP_P_MAX_ROUNDS` rounds, or
    left with nothing to draw (a top_p of 0 rejects even the most likely token), takes its most
    likely token, which is in every nucleus. For a valid top_p the remaining mass shrinks by a
    uniform fraction per rejection, so the rounds are about 1 + Poisson(ln(1 / nucleus mass)),
    and the nucleus holds at least the most likely token (mass >= 1 / V): with V = 2**18 the
    mean is below 14 rounds and the bound is never reached in practice (P < 1e-20).
    """
    active, local, p = rows, None, probs  # local: positions in probs of the active rows (None: all)
    for _ in range(_TOP_P_MAX_ROUNDS):
        chosen_p = p.gather(1, tokens[active].unsqueeze(1))
        mass_above = torch.mul(p, p > chosen_p, out=scratch[: p.shape[0]]).sum(dim=-1)
        # A draw of probability 0 (or NaN) means nothing was left to draw: the row is stuck.
        drawn = chosen_p.squeeze(1) > 0
        rejected, stuck = (mass_above >= top_p) & drawn, ~drawn
        any_rejected, any_stuck = torch.stack((rejected.any(), stuck.any())).tolist()
        if any_stuck:
            _take_most_likely(probs, tokens, active[stuck], _subset(local, stuck))
        if not any_rejected:
            return
        local = _subset(local, rejected)
        active, top_p, p, chosen_p = active[rejected], top_p[rejected], p[rejected], chosen_p[rejected]
        p.masked_fill_(p <= chosen_p, 0.0)
        row_gens = []
        if generators:
            row_gens = [(j, generators[a]) for j, a in enumerate(active.tolist()) if a in generators]
        tokens.index_copy_(0, active, _race(p, scratch[: p.shape[0]], row_gens))
    _take_most_likely(probs, tokens, active, local)


def _subset(local: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """The positions in ``probs`` of the rows ``keep`` selects among those at ``local`` (None: all)."""
    return keep.nonzero().squeeze(1) if local is None else local[keep]


def _take_most_likely(probs: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                      local: torch.Tensor | None) -> None:
    """``tokens[rows]`` = the most likely token of ``probs[local]`` (``local`` None: every row)."""
    if rows.numel():
        tokens.index_copy_(0, rows, _argmax(probs if local is None else probs[local]))


def _race(probs: torch.Tensor, noise: torch.Tensor, row_generators: list[tuple[int, torch.Generator]]
          ) -> torch.Tensor:
    """One exponential race per row by torch ops, in ``noise`` (a buffer shaped like ``probs``),
    where the C++ kernel does not run (``row_ops``).

    argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks i with probability p_i / sum(p). E is built as
    -log(U): on CPU that is ~6x faster than ``Tensor.exponential_``, and U < 1 keeps E > 0, so no
    token can win by a division by zero (U == 0 gives E = inf, which only drops that one token from
    that one draw). Rows in ``row_generators`` draw U from their own generator.
    """
    if len(row_generators) < noise.shape[0]:
        noise.uniform_()
    for row, generator in row_generators:
        noise[row].uniform_(generator=generator)
    noise.log_().neg_()
    return _argmax(torch.div(probs, noise, out=noise))


def _race_keys(rows: int, row_generators: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """The race kernel's 64-bit key per row (``csrc/race.cpp``: 32 rows of 49,152 in 0.7 ms through
    AVX-512 and 1.4 through AVX2 on one machine, where the torch ops of :func:`_race` took 6): from
    torch's default generator, so ``torch.manual_seed`` fixes them, or a seeded row's own."""
    keys = torch.empty(rows, dtype=torch.long).random_()
    for row, generator in row_generators:
        keys[row] = torch.empty(1, dtype=torch.long).random_(generator=generator)[0]
    return keys


def _row_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded row at one output position (splitmix64 of both)."""
    z = ((seed & _MASK64) + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device=device)
    generator.manual_seed(z ^ (z >> 31))
    return generator


# ---- logprobs --------------------------------------------------------------------------------


def gather_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, top_counts: list[int], ws: Workspace
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
        ops = row_ops(raw)
        # csrc/top_k_rows.cpp: one pass a row, where torch's topk took 3.1 ms for [64, 49152] even at k 1
        values, indices = raw.topk(k_max, dim=-1) if ops is None else ops.top_k_rows(raw, k_max)
        top_ids, top_lps = indices.tolist(), values.tolist()
    return [
        TokenLogprobs(token_ids=[tok, *ids[:k]], logprobs=[lp, *lps[:k]], sampled_rank=rank)
        for tok, lp, rank, ids, lps, k in zip(
            tokens.tolist(), sampled.squeeze(1).tolist(), ranks, top_ids, top_lps, top_counts, strict=True
        )
    ]
