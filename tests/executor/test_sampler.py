"""Sampler: exact values where the result is deterministic, fixed-seed statistics where it is not."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from cadence.backends.cpu_kernels import cpu_ops
from cadence.executor import sampling_plan, token_choice
from cadence.executor.sampler import Sampler
from cadence.executor.sampling_plan import SamplingRow
from cadence.sampling_params import SamplingParams

V = 64
GREEDY = SamplingParams(temperature=0.0)


def row(
    params: SamplingParams = GREEDY,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=prompt or [1, 2, 3], output_token_ids=output or [],
                       eos_token_id=eos)


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def assert_follows(tokens: list[int], expected: torch.Tensor) -> None:
    """Chi-square goodness of fit, with a bound far in the tail (the seed is fixed, so not flaky).

    Categories of zero expected probability must never occur.
    """
    expected = expected.double() / expected.sum()
    observed = counts_of(tokens, len(expected))
    assert observed[expected == 0].sum() == 0, "sampled a token that should be impossible"
    support = expected > 0
    exp_counts = expected[support] * len(tokens)
    chi2 = float(((observed[support] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 8 * math.sqrt(2 * max(dof, 1)), f"chi2={chi2:.1f} for {dof} dof"


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 20_000) -> list[int]:
    torch.manual_seed(0)
    rows = [row(params)] * n
    return Sampler()(logits_row.expand(n, -1).contiguous(), rows).token_ids


@pytest.fixture(params=["kernel", "torch"])
def race(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The random rows' filters and exponential race in the C++ kernels (``csrc/logit_filters.cpp``,
    ``csrc/race.cpp``, where the CPU has AVX-512 or AVX2) or in torch ops (elsewhere)."""
    if request.param == "torch":
        monkeypatch.setattr(token_choice, "row_ops", lambda x: None)
    elif token_choice.row_ops(torch.zeros(1, 2)) is None:
        pytest.skip("the sampler's kernels run on CPUs with AVX-512 or AVX2")
    return str(request.param)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 3


# ---- greedy and logit processing -------------------------------------------------------------


def test_greedy_is_argmax_and_logits_untouched(logits: torch.Tensor) -> None:
    before = logits.clone()
    out = Sampler()(logits, [row()] * len(logits))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


@pytest.fixture(params=["kernel", "torch"])
def penalties(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The penalties in the C++ kernel (``csrc/penalties.cpp``, where cadence's CPU kernels build) or
    in torch ops (elsewhere)."""
    if request.param == "torch":
        monkeypatch.setattr(sampling_plan, "row_ops", lambda x: None)
    elif cpu_ops() is None:
        pytest.skip("the penalty kernel runs where cadence's CPU kernels build")
    return str(request.param)


def test_the_penalty_kernel_gives_the_torch_ops_values(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_ops() is None:
        pytest.skip("the penalty kernel runs where cadence's CPU kernels build")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=gen) * 4
    logits[0, :8] = 0.0  # a zero logit is multiplied: it stays 0
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5), GREEDY,
              SamplingParams(repetition_penalty=2.0, frequency_penalty=0.3), SamplingParams(presence_penalty=-1.0)]
    histories = [([0, 1, 2, 2, V - 1], [3, 3, 3, 0]), ([5, 6], [6, 6, 7, V - 1, V - 1]), ([9] * 5, [9, 10]),
                 ([1], [1]), ([], []), ([4, 4], [])]
    rows = [row(p, prompt=prompt, output=output) for p, (prompt, output) in zip(params, histories, strict=True)]
    kernel = Sampler().process_logits(logits, rows)
    monkeypatch.setattr(sampling_plan, "row_ops", lambda x: None)
    torch_ops = Sampler().process_logits(logits, rows)
    assert torch.equal(kernel, torch_ops) and not torch.equal(kernel, logits)


@pytest.mark.usefixtures("penalties")
def test_penalties_match_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    r = row(params, prompt=[0, 4], output=[3, 3, 1])
    got = Sampler().process_logits(logits, [r])
    # repetition on prompt|output {0, 1, 3, 4}: positive / 2, negative * 2;
    # then frequency * count and presence on output counts {3: 2, 1: 1}.
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 2 * 0.5 - 0.25, -2.0 * 2, 1.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("penalties")
def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=gen) * 4
    seqs = [torch.randint(0, V, (12,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    rows = [row(params, prompt=s[:7], output=s[7:]) for s in seqs]
    got = Sampler().process_logits(logits, rows)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(seqs), logits.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("penalties")
def test_penalties_only_touch_rows_that_ask(logits: torch.Tensor) -> None:
    # The same params object at two positions with different histories: only their own tokens count.
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    sampler = Sampler()
    for step in range(2):  # the second step reuses the cached plan with new histories
        rows = [row(), row(params, output=[5 + step]), row(), row(params, output=[7, 7, step])]
        got = sampler.process_logits(logits[:4], rows)
        expected = logits[:4].clone()
        expected[1, 5 + step] -= 1.0
        expected[3, [7, step]] -= 1.0
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_logit_bias_forces_a_token(logits: torch.Tensor) -> None:
    weakest = int(logits[0].argmin())
    biased = SamplingParams(temperature=0.0, logit_bias={weakest: 100.0})
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={weakest: 100.0})
    out = Sampler()(logits[:3], [row(biased), row(), row(sampled)])
    assert out.token_ids[0] == weakest
    assert out.token_ids[1] == int(logits[1].argmax())
    assert int(Sampler().process_logits(logits[2:3], [row(sampled)]).argmax()) == weakest


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 8], logits[0, 7] = 5.0, 4.0, 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8], ignore_eos=True)
    sampler = Sampler()
    early = row(params, output=[1, 2], eos=9)
    masked = sampler.process_logits(logits, [early])
    assert masked[0, 9] == -math.inf and masked[0, 8] == -math.inf
    assert torch.equal(masked[0, :7], logits[0, :7])
    assert sampler(logits, [early]).token_ids == [7]
    # Once min_tokens are out the mask lifts.
    assert sampler(logits, [row(params, output=[1, 2, 3], eos=9)]).token_ids == [9]


def test_mixed_batch_greedy_rows_ignore_sampling_settings(logits: torch.Tensor) -> None:
    hot = SamplingParams(temperature=5.0, seed=1)
    rows = [row(), row(hot), row(), row(hot), row(), row(hot)]
    out = Sampler()(logits, rows)
    for i in (0, 2, 4):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_wrong_shape_is_rejected(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(logits, [row()])


# ---- truncation and sampling -----------------------------------------------------------------


def test_top_k_one_is_greedy(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=1.5, top_k=1)
    torch.manual_seed(0)
    for _ in range(5):
        assert Sampler()(logits, [row(params)] * len(logits)).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_picks_argmax(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=2.0, top_p=1e-6)
    torch.manual_seed(0)
    for _ in range(5):
        assert Sampler()(logits, [row(params)] * len(logits)).token_ids == logits.argmax(-1).tolist()


@pytest.mark.usefixtures("race")
def test_temperature_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tokens = sample_many(probs.log(), SamplingParams(temperature=0.5))
    assert_follows(tokens, probs**2)  # p^(1/T), renormalised


@pytest.mark.usefixtures("race")
def test_plain_sampling_distribution() -> None:
    logits = torch.randn(20, generator=torch.Generator().manual_seed(4))
    assert_follows(sample_many(logits, SamplingParams()), logits.softmax(-1))


@pytest.mark.usefixtures("race")
def test_min_p_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    # min_p 0.2 -> threshold 0.1: the last two go, the rest renormalise.
    tokens = sample_many(probs.log(), SamplingParams(min_p=0.2))
    assert_follows(tokens, torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]))


@pytest.mark.usefixtures("race")
def test_top_k_distribution() -> None:
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    tokens = sample_many(probs.log(), SamplingParams(top_k=2))
    assert_follows(tokens, torch.tensor([0.0, 0.4, 0.0, 0.3]))


@pytest.mark.usefixtures("race")
def test_top_p_distribution() -> None:
    probs = torch.tensor([0.2, 0.4, 0.1, 0.3])
    # Kept while the mass strictly above a token is < 0.6: 0.4 (0), 0.3 (0.4); 0.2 has 0.7 above.
    tokens = sample_many(probs.log(), SamplingParams(top_p=0.6))
    assert_follows(tokens, torch.tensor([0.0, 0.4, 0.0, 0.3]))


@pytest.mark.usefixtures("race")
def test_top_p_matches_sort_based_reference_on_a_wide_vocab() -> None:
    # A flat distribution: many tokens in the nucleus and several rejection rounds per row.
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.8, top_k=80, top_p=0.7)
    ref = (logits / 0.8).masked_fill(logits < logits.topk(80).values[-1], -math.inf).softmax(-1)
    order = ref.argsort(descending=True)
    mass_above = ref[order].cumsum(0) - ref[order]
    keep = torch.zeros_like(ref, dtype=torch.bool)
    keep[order[mass_above < 0.7]] = True
    assert_follows(sample_many(logits, params, n=30_000), ref * keep)


# ---- seeds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.7, top_p=0.5, top_k=30, min_p=0.01, seed=-7),
])
@pytest.mark.usefixtures("race")
def test_seeded_row_ignores_batch_composition_and_position(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(V, generator=gen)
    others = torch.randn(5, V, generator=gen)
    history: list[int] = [4, 4]
    alone: list[int] = []
    torch.manual_seed(10)
    for _ in range(8):  # several steps: the seed stream advances with the output length
        alone.append(Sampler()(target[None], [row(params, output=history + alone)]).token_ids[0])
    assert len(set(alone)) > 1

    mix = [SamplingParams(temperature=1.0), GREEDY, SamplingParams(top_p=0.3), SamplingParams(seed=99),
           SamplingParams(top_k=3)]
    torch.manual_seed(11)
    for step in range(8):
        pos = step % 6
        batch = torch.cat([others[:pos], target[None], others[pos:]])
        rows = [row(p) for p in mix]
        rows.insert(pos, row(params, output=history + alone[:step]))
        assert Sampler()(batch, rows).token_ids[pos] == alone[step]


@pytest.mark.usefixtures("race")
def test_reused_sampler_matches_fresh_ones_across_batch_sizes() -> None:
    # The sampler keeps its plan and buffers between calls; shrinking and growing must not leak.
    gen = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=s, presence_penalty=0.5) for s in range(6)]
    reused = Sampler()
    for size in (6, 2, 6, 3):
        logits = torch.randn(size, V, generator=gen)
        rows = [row(p, output=[1, 2]) for p in params[:size]]
        assert reused(logits, rows).token_ids == Sampler()(logits, rows).token_ids


@pytest.mark.usefixtures("race")
def test_unseeded_rows_follow_the_global_seed(logits: torch.Tensor) -> None:
    rows = [row(SamplingParams(temperature=3.0))] * len(logits)
    torch.manual_seed(12)
    first = Sampler()(logits, rows).token_ids
    torch.manual_seed(12)
    assert Sampler()(logits, rows).token_ids == first


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_raw_with_exact_top_k_and_rank() -> None:
    raw = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    # Row 0 asks for 3 and is pushed onto token 2 (raw rank 3) by a bias; row 1 does not ask.
    asks = SamplingParams(temperature=0.0, logprobs=3, logit_bias={2: 50.0}, repetition_penalty=1.5)
    out = Sampler()(raw, [row(asks, prompt=[1]), row()])
    assert out.token_ids == [2, 4]
    assert out.logprobs is not None
    lp = torch.log_softmax(raw, -1)
    first, second = out.logprobs
    assert first.token_ids == [2, 1, 3, 2]
    assert first.logprobs == pytest.approx(lp[0, [2, 1, 3, 2]].tolist(), abs=1e-6)
    assert first.sampled_rank == 3
    assert second.token_ids == [4] and second.logprobs == pytest.approx([lp[1, 4].item()], abs=1e-6)
    assert second.sampled_rank == 1


def test_logprobs_zero_gives_only_the_sampled_token(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=1.0, logprobs=0, seed=5)
    out = Sampler()(logits[:1], [row(params)])
    assert out.logprobs is not None
    (entry,) = out.logprobs
    tok = out.token_ids[0]
    lp = torch.log_softmax(logits[0], -1)
    assert entry.token_ids == [tok]
    assert entry.logprobs == pytest.approx([float(lp[tok])], abs=1e-6)
    assert entry.sampled_rank == 1 + int((lp > lp[tok]).sum())


def test_plan_is_rebuilt_when_params_change(logits: torch.Tensor) -> None:
    sampler = Sampler()
    assert sampler(logits, [row()] * len(logits)).logprobs is None
    rows = [row(SamplingParams(temperature=0.0, logprobs=2))] * len(logits)
    out = sampler(logits, rows)
    assert out.logprobs is not None and all(len(e.token_ids) == 3 for e in out.logprobs)
    assert sampler(logits[:2], rows[:2]).logprobs is not None
