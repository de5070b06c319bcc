"""Speculative decoding end to end (``LLM(speculative_config=...)``) on a tiny random Llama, with
each proposer: n-gram lookups (the model's greedy output falls into loops that they draft well, and
breaks out of them, so drafts are rejected too) and a draft model (the model with noise on its
weights, right about two times in three). The output with speculation is the output without it,
token for token (greedy, seeded sampling with penalties, logprobs, stops, n > 1, preemption, prefix
caching, tensor parallelism, structured output), and unseeded sampling keeps its distribution."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chi2_contingency, fisher_exact
from support.tiny_models import noisy_copy

from cadence import LLM, SamplingParams
from cadence.config import ConfigError, ModelConfig
from cadence.core.speculation import StepCostFit
from cadence.executor.draft_model import load_draft_model
from cadence.executor.ngram_proposer import NgramProposer
from cadence.messages import SpecDecodeStats
from cadence.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 1024}


@pytest.fixture(scope="module")
def model(make_tiny_model: Callable[..., Path]) -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def draft_model(model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The model with a little noise on its weights: its first draft is accepted about two times in
    three (drafts are verified then, though a draft forward costs this tiny model as much as a step)."""
    return str(noisy_copy(Path(model), tmp_path_factory.mktemp("draft"), std=0.005))


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": request.getfixturevalue("draft_model"), "num_speculative_tokens": 4,
            "disable_by_batch_size": 1024}


@pytest.fixture(scope="module")
def first_draft(spec_config: dict[str, Any]) -> Callable[[list[int]], list[int]]:
    """What the proposer of ``spec_config`` drafts first after a sequence."""
    if spec_config["method"] == "ngram":
        return NgramProposer(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], 1).propose
    draft = ModelConfig(path=spec_config["model"], dtype="float32", max_model_len=512)
    proposer = load_draft_model(draft, None, torch.device("cpu"), num_blocks=256, block_size=16,
                                num_speculative_tokens=1)
    return lambda tokens: proposer.propose([("probe", tokens, 1)])[0]


@pytest.fixture(scope="module")
def plain(model: str) -> LLM:
    return LLM(model=model, dtype="float32")


class _UnknownStepCost(StepCostFit):
    """The back-off before it knows a step's cost: every draft position is worth asking for."""

    def token_share(self, tokens: int, extra_seconds: float = 0.0) -> float | None:
        return None


@pytest.fixture(scope="module")
def spec(model: str, spec_config: dict[str, Any]) -> LLM:
    llm = LLM(model=model, dtype="float32", speculative_config=spec_config)
    # These tests are about exactness. The back-off prices drafts by wall-clock step times, so how
    # many it asks for (and whether any is then rejected) would depend on the machine's speed.
    speculation = llm.engine_core.scheduler.speculation
    assert speculation is not None
    speculation.cost = _UnknownStepCost()
    return llm


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def spec_stats(llm: LLM) -> SpecDecodeStats:
    speculation = llm.engine_core.scheduler.speculation
    assert speculation is not None
    return speculation.stats()


def generate(llm: LLM, batch: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Any]:
    return [[(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in out.outputs]
            for out in llm.generate(batch, params, use_tqdm=False)]


def assert_drafts_were_accepted_and_rejected(llm: LLM, before: SpecDecodeStats) -> None:
    after = spec_stats(llm)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafted = after.num_draft_tokens - before.num_draft_tokens
    assert 0 < accepted < drafted


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.engine_core
    assert not engine.scheduler.requests
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_integrity()


def test_greedy_output_is_token_identical(plain: LLM, spec: LLM) -> None:
    before = spec_stats(spec)
    batch = prompts(12)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert generate(spec, batch, params) == generate(plain, batch, params)
    assert_drafts_were_accepted_and_rejected(spec, before)
    assert_engine_clean(spec)


def test_seeded_sampling_with_penalties_is_token_identical(plain: LLM, spec: LLM) -> None:
    before = spec_stats(spec)
    batch = prompts(8, seed=1)
    params = [SamplingParams(temperature=0.3, top_k=20, seed=i, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.1 if i % 2 else 1.0, presence_penalty=0.2 * (i % 3))
              for i in range(8)]
    assert generate(spec, batch, params) == generate(plain, batch, params)
    assert_drafts_were_accepted_and_rejected(spec, before)


def test_logprobs_stops_and_n_match(plain: LLM, spec: LLM) -> None:
    batch = prompts(6, seed=2)
    base = plain.generate(batch, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    # A stop string and a stop token from the middle of each greedy output, where drafts are verified.
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop=[out.outputs[0].text[30:34]],
                             stop_token_ids=[out.outputs[0].token_ids[25]]) for out in base]
    params.append(SamplingParams(n=3, temperature=0.5, seed=3, max_tokens=30, logprobs=1, ignore_eos=True))
    batch.append(batch[0])
    got, want = generate(spec, batch, params), generate(plain, batch, params)
    for seqs, reference in zip(got, want, strict=True):
        for (tokens, text, finish, logprobs), (ref_tokens, ref_text, ref_finish, ref_logprobs) in zip(
                seqs, reference, strict=True):
            assert (tokens, text, finish) == (ref_tokens, ref_text, ref_finish)
            assert [lp.token_ids for lp in logprobs] == [lp.token_ids for lp in ref_logprobs]
            for entry, ref in zip(logprobs, ref_logprobs, strict=True):
                # A verification computes a position in a query of several tokens: the same math, other
                # summation order.
                assert entry.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert {finish for seqs in got[:-1] for _, _, finish, _ in seqs} == {"stop"}


def test_preemption_and_prefix_caching_keep_the_output(model: str, spec_config: dict[str, Any], plain: LLM) -> None:
    # 24 blocks of 16 tokens hold about 3 of these requests at once: the rest wait or are preempted
    # (a draft model's pool has 24 blocks too: it takes back the blocks of the least recent).
    small = LLM(model=model, dtype="float32", speculative_config=spec_config, num_kv_blocks=24)
    shared = prompts(1, seed=4)[0] * 3
    batch = [shared + p for p in prompts(10, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert generate(small, batch, params) == generate(plain, batch, params)
    assert small.engine_core.scheduler.num_preemptions > 0
    assert small.engine_core.allocator.prefix_cache_hits > 0
    assert spec_stats(small).num_accepted_tokens > 0
    assert_engine_clean(small)
    small.shutdown()


def test_tensor_parallel_ranks_verify_alike(model: str, spec_config: dict[str, Any], plain: LLM) -> None:
    """Two ranks (mp workers): each samples the verification rows from rank 0's broadcast tokens and
    verifies rank 0's drafts (only rank 0 runs a draft model), so both keep the same state."""
    tp = LLM(model=model, dtype="float32", tensor_parallel_size=2, speculative_config=spec_config)
    batch = prompts(4, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert generate(tp, batch, params) == generate(plain, batch, params)
    assert spec_stats(tp).num_accepted_tokens > 0
    tp.shutdown()


def test_unseeded_sampling_keeps_the_distribution(plain: LLM, spec: LLM,
                                                  first_draft: Callable[[list[int]], list[int]]) -> None:
    """600 unseeded samples with and without speculation: how often the second token is the first
    draft (the acceptance event, which a wrong verification skews) and the second token's own
    distribution; neither Fisher's exact test (of the rare first) nor a chi-square test (of the second)
    can tell the two apart."""
    before = spec_stats(spec)
    # Every token, so that any first token has drafts; then the model's own greedy loop, which a
    # sample sometimes follows, so that drafts are accepted too.
    loop = plain.generate([prompts(1, seed=6)[0]], SamplingParams(temperature=0, max_tokens=40),
                          use_tqdm=False)[0].outputs[0].token_ids
    prompt = list(range(3, 320)) + list(loop)
    params = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)

    def sample(llm: LLM) -> tuple[list[int], Counter[int]]:
        seqs = [out.outputs[0].token_ids for out in llm.generate([prompt] * 600, params, use_tqdm=False)]
        drafts = {first: first_draft([*prompt, first]) for first in {seq[0] for seq in seqs}}
        drafted = sum(seq[1:2] == drafts[seq[0]] for seq in seqs)
        return [drafted, len(seqs) - drafted], Counter(seq[1] for seq in seqs)

    (spec_drafted, spec_second), (plain_drafted, plain_second) = sample(spec), sample(plain)
    assert spec_stats(spec).num_drafts - before.num_drafts >= 500  # nearly every sample verified drafts
    assert_drafts_were_accepted_and_rejected(spec, before)
    # Fisher's exact test: the event is rare (a few in 600), where a chi-square's expected counts are too small
    assert fisher_exact([spec_drafted, plain_drafted]).pvalue > 1e-3
    common = [token for token, _ in (spec_second + plain_second).most_common(10)]
    table = [[counts[t] for t in common] + [600 - sum(counts[t] for t in common)]
             for counts in (spec_second, plain_second)]
    assert chi2_contingency(table).pvalue > 1e-3


def test_constrained_requests_draft_within_their_grammar(plain: LLM, spec: LLM, spec_config: dict[str, Any]) -> None:
    """Drafts are cut at the first token the grammar refuses, and each verified position is masked
    by the grammar after the drafts before it: the same tokens as without speculation, all matching.
    (A draft model drafts without the grammar: the model's unconstrained choices, which this
    grammar refuses, so its drafts may all be cut, which must not change the output either.)"""
    before = spec_stats(spec)
    pattern = r"(ab|cd|ef)( (ab|cd|ef)){3,40}"
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs=StructuredOutputsParams(regex=pattern))
    batch = prompts(6, seed=7)
    got = generate(spec, batch, params)
    assert got == generate(plain, batch, params)
    assert all(re.fullmatch(pattern, text) and finish == "stop" for [(_, text, finish, _)] in got)
    if spec_config["method"] == "ngram":
        assert_drafts_were_accepted_and_rejected(spec, before)


def test_a_bad_speculative_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="speculative method"):
        LLM(speculative_config={"method": "medusa"})
    with pytest.raises(ConfigError, match="does not take"):
        LLM(speculative_config='{"method": "ngram", "num_lookahead": 3}')
    with pytest.raises(ConfigError, match="not JSON"):
        LLM(speculative_config="{method: ngram}")
    with pytest.raises(ConfigError, match="needs a 'model'"):
        LLM(speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="needs a 'model'"):
        LLM(speculative_config={"method": "ngram", "model": "x"})
    with pytest.raises(ConfigError, match="model must be a string"):
        LLM(speculative_config={"method": "draft_model", "model": 3})


def test_a_draft_model_must_share_the_vocabulary(model: str, make_tiny_model: Callable[..., Path]) -> None:
    other = make_tiny_model("llama", vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary of 400 tokens, the model 320"):
        LLM(model=model, speculative_config={"method": "draft_model", "model": str(other)})
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(model=model, speculative_config={"method": "draft_model", "model": "/nowhere/draft"})
