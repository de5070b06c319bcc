"""The worker's side of speculative decoding: the n-gram proposer, verification of a step's drafts,
and the drafter's rule (no drafts for a large batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cadence.config import SpeculativeConfig
from cadence.executor.ngram_proposer import NgramProposer
from cadence.executor.sampler import SamplerOutput
from cadence.executor.speculation import Drafter, verify
from cadence.messages import TokenLogprobs
from cadence.sampling_params import SamplingParams


def test_the_longest_suffix_match_wins_and_its_latest_occurrence() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, num_tokens=3)
    #          the 3-gram [1, 2, 3] occurs once, followed by 9; the 1-gram [3] last occurs before 7
    tokens = [1, 2, 3, 9, 8, 5, 3, 7, 6, 1, 2, 3]
    assert proposer.propose(tokens) == [9, 8, 5]
    assert proposer.propose([4, 3, 7, 5, 3, 6, 0, 3]) == [6, 0, 3]  # 1-gram [3]: the latest earlier one
    assert NgramProposer(2, 3, 3).propose([4, 3, 7, 5, 3, 6, 0, 3]) == []  # no 2-gram ends in [0, 3] before


def test_a_draft_stops_at_the_end_of_the_history_and_at_num_tokens() -> None:
    assert NgramProposer(1, 2, 5).propose([5, 6, 5]) == [6, 5]
    assert NgramProposer(1, 2, 1).propose([5, 6, 7, 5, 6]) == [7]
    assert NgramProposer(2, 2, 4).propose([5, 6]) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2, 1)


@dataclass
class State:
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    request_id: str = "r"

    def append(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)


def logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs([token], [-float(token)], 1)


def test_verify_accepts_up_to_the_first_disagreement_and_takes_back_the_rest() -> None:
    a, b, c = (State(SamplingParams(), [1, 2], num_computed_tokens=n) for n in (6, 3, 10))
    # a verified 3 drafts (rows 4), b none (1 row), c 2 drafts (3 rows)
    rows = [7, 8, 5, 4, 9, 1, 2, 3]
    sampled = SamplerOutput(rows, [logprob(t) for t in rows])
    out = verify([a, b, c], [[7, 6, 5], [], [1, 2]], sampled)
    assert out.last_tokens == [8, 9, 3] and out.num_accepted == [1, 0, 2]
    assert (a.output_token_ids, b.output_token_ids, c.output_token_ids) == ([7, 8], [9], [1, 2, 3])
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (4, 3, 10)
    assert out.logprobs == [logprob(t) for t in (7, 8, 9, 1, 2, 3)]


def test_the_drafter_proposes_as_many_as_the_scheduler_asks() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    a, b, c = (State(SamplingParams(), [4, 5, 6, 4], request_id=name) for name in "abc")
    assert drafter.propose([a, b, c], {"a": 2, "b": 1}) == [[5, 6], [5], []]
    assert drafter.propose([a, b], {}) == [[], []]
