"""Speculative decoding in the worker: verifying a step's drafts and proposing the next ones.

A speculating request's step computes its last sampled token and its ``k`` drafts; the logits at
those ``k + 1`` positions are sampled as ``k + 1`` ordinary rows, row ``i`` seeing drafts ``0..i-1``
as outputs (penalties, per-position seeds). Drafts are accepted while each equals the token its
position sampled; the first that differs is replaced by that sample (or, all accepted, the last
row's sample is a bonus token). The drafts are point guesses (the n-gram proposer's, or the draft
model's greedy tokens), and for a point guess this is exactly rejection sampling: a draft ``d`` is
kept with probability ``p(d)``, and on rejection the token is drawn from ``p`` without ``d``,
renormalised. So greedy output is token-identical to decoding one token at a time, a seeded
request's too (each position draws from the seed of its output index), and any other keeps the
target distribution (docs/speculative_decoding.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cadence.config import SpeculativeConfig
from cadence.executor.draft_model import DraftModelProposer
from cadence.executor.ngram_proposer import NgramProposer
from cadence.executor.sampler import SamplerOutput
from cadence.messages import TokenLogprobs


class DraftingState(Protocol):
    """What verification and drafting read and change of a request's state in the model runner."""

    num_computed_tokens: int

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    def append(self, token_ids: list[int]) -> None: ...


@dataclass(frozen=True)
class Verified:
    """A step's outcome per sampled request: its last token, how many drafts it accepted, and the
    logprobs of every token it emitted (when any row asked)."""

    last_tokens: list[int]
    num_accepted: list[int]
    logprobs: list[TokenLogprobs] | None


def verify(states: Sequence[DraftingState], drafts: Sequence[list[int]], sampled: SamplerOutput) -> Verified:
    """Accept each request's drafts up to the first its rows disagree with; append the emitted
    tokens to its state and take back the rejected drafts' positions (their KV is overwritten later).

    ``sampled`` has ``len(drafts[i]) + 1`` rows per request, in order.
    """
    last_tokens, num_accepted = [], []
    logprobs: list[TokenLogprobs] | None = None if sampled.logprobs is None else []
    at = 0
    for state, guess in zip(states, drafts, strict=True):
        tokens = sampled.token_ids[at:at + len(guess) + 1]
        accepted = 0
        while accepted < len(guess) and tokens[accepted] == guess[accepted]:
            accepted += 1
        state.append(tokens[:accepted + 1])
        state.num_computed_tokens -= len(guess) - accepted
        if logprobs is not None and sampled.logprobs is not None:
            logprobs.extend(sampled.logprobs[at:at + accepted + 1])
        last_tokens.append(tokens[accepted])
        num_accepted.append(accepted)
        at += len(guess) + 1
    return Verified(last_tokens, num_accepted, logprobs)


class Drafter:
    """Proposes each sampled request's drafts for the next step, as many as the scheduler asks
    (``SchedulerOutput.draft_counts``; it decides how many are verified, and cuts a constrained
    request's at the first its grammar refuses): the n-gram proposer's, or the draft model's when one
    is given, which then runs only for the requests asked."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModelProposer | None = None) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        self.draft_model = draft_model

    def propose(self, states: Sequence[DraftingState], counts: Mapping[str, int]) -> list[list[int]]:
        wanted = [(state.request_id, state.prompt_token_ids + state.output_token_ids, counts[state.request_id])
                  for state in states if counts.get(state.request_id)]
        if self.draft_model is not None:
            made = iter(self.draft_model.propose(wanted))
        else:
            made = iter(self.ngram.propose(tokens)[:count] for _, tokens, count in wanted)
        return [next(made) if counts.get(state.request_id) else [] for state in states]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that left the batch: the draft model frees their KV."""
        if self.draft_model is not None:
            self.draft_model.forget(request_ids)
