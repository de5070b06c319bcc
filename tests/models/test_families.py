"""Every model family beyond plain Llama, token for token against Hugging Face transformers (fp32,
greedy), with each family's own features switched on in a tiny random model: q/k norms, every RoPE
scaling type, LongRoPE with partial rotary, fused checkpoint projections, experts with and without
renormalisation and a shared expert, dense and sparse layers mixed, soft-capping, sliding-window
and global layers with their own RoPE. Each runs cold and with a warm prefix cache, with chunked
prefill and forced preemptions, at tensor-parallel size 2 (gloo), and its logprobs match
transformers' log-softmax.

Prompts are longer than the original RoPE context (64) wherever a scaling type depends on it, and
than every sliding window (16).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.reference import greedy, hf_greedy, hf_log_softmax, random_prompts
from support.tiny_models import TINY_VOCAB

from cadence import LLM, SamplingParams
from cadence.models.kv_groups import kv_cache_groups_of
from cadence.models.loader import load_hf_config

NEW_TOKENS = 12
ORIGINAL_CONTEXT = 64
LONG_PROMPTS = (ORIGINAL_CONTEXT + 6, 130)
WINDOW = 16


def _longrope(max_position_embeddings: int, original: int) -> dict[str, Any]:
    # head_dim 16 with partial_rotary_factor 0.75 rotates 12 dims: 6 frequencies, so 6 factors each.
    # Phi3Config takes original_max_position_embeddings from its own field, not from rope_scaling.
    return dict(partial_rotary_factor=0.75, max_position_embeddings=max_position_embeddings,
                original_max_position_embeddings=original, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "short_factor": [1.0 + 0.3 * i for i in range(6)], "long_factor": [1.5 + 0.9 * i for i in range(6)]})


# family -> (transformers model_type, config overrides, prompt lengths)
FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[int, int]]] = {
    # head_dim 32 is not hidden / heads (16), as in Qwen3; biases on, to load them too.
    "qwen3": ("qwen3", dict(head_dim=32, attention_bias=True), LONG_PROMPTS),
    "qwen3-yarn": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                               "original_max_position_embeddings": ORIGINAL_CONTEXT}), LONG_PROMPTS),
    "llama3-rope": ("llama", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_CONTEXT}), LONG_PROMPTS),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), LONG_PROMPTS),
    "llama-dynamic-rope": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), LONG_PROMPTS),
    # The model's context is longer than the original: the long factors, for sequences past 64.
    "phi3-longrope": ("phi3", _longrope(512, ORIGINAL_CONTEXT), LONG_PROMPTS),
    # Its context is the original one (128): the short factors, for every sequence it can hold.
    "phi3-short-factors": ("phi3", _longrope(128, 128), (10, 60)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2), LONG_PROMPTS),
    # Layer 1 of 3 stays dense (mlp_only_layers).
    "qwen3-moe": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1]), LONG_PROMPTS),
    # Every second layer is sparse (decoder_sparse_step 2), with the gated shared expert.
    "qwen2-moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    decoder_sparse_step=2), LONG_PROMPTS),
    # Sliding layers (even) and global ones alternate; scores and logits soft-capped (small caps, so
    # that they bite); queries scaled by query_pre_attn_scalar, not head_dim.
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0), LONG_PROMPTS),
    # Each layer kind with its own RoPE (linear scaling on the global one), q/k norms.
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}), LONG_PROMPTS),
    "mistral-sliding-window": ("mistral", dict(sliding_window=WINDOW), LONG_PROMPTS),
    # Qwen2's window applies from layer max_window_layers on.
    "qwen2-sliding-window": ("qwen2", dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
                             LONG_PROMPTS),
}
# Tensor parallelism shards each family's layers its own way; the RoPE variants only change tables.
TP_FAMILIES = ["qwen3", "llama3-rope", "phi3-longrope", "mixtral", "qwen3-moe", "qwen2-moe", "gemma2", "gemma3",
               "mistral-sliding-window"]


class Case:
    """One family's tiny checkpoint, its prompts and transformers' greedy tokens for them."""

    def __init__(self, folder: Path, prompts: list[list[int]]) -> None:
        self.folder = folder
        self.prompts = prompts
        self.expected = hf_greedy(folder, prompts, NEW_TOKENS)

    def llm(self, **engine_args: Any) -> LLM:
        return LLM(model=str(self.folder), dtype="float32", **engine_args)

    @property
    def num_kv_cache_groups(self) -> int:
        return kv_cache_groups_of(load_hf_config(str(self.folder))).num_groups


_cases: dict[str, Case] = {}


@pytest.fixture
def case(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path]) -> Case:
    """The case of the test's ``family`` parameter, built once per session."""
    family = request.node.callspec.params["family"]
    if family not in _cases:
        arch, overrides, lengths = FAMILIES[family]
        _cases[family] = Case(make_tiny_model(arch, **overrides), random_prompts(0, 8, TINY_VOCAB, lengths))
    return _cases[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cold_then_warm_prefix_cache_matches_transformers(case: Case, family: str) -> None:
    llm = case.llm()
    assert greedy(llm, case.prompts, NEW_TOKENS) == case.expected
    hits = llm.engine_core.allocator.prefix_cache_hits
    assert greedy(llm, case.prompts, NEW_TOKENS) == case.expected
    assert llm.engine_core.allocator.prefix_cache_hits > hits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_with_preemptions_matches_transformers(case: Case, family: str) -> None:
    # 64-token steps cut every prompt into chunks; 48 blocks of 4 per KV cache group hold the longest
    # request (182 tokens) but not 8 at once, even where blocks out of a window return to the pool.
    llm = case.llm(max_num_batched_tokens=64, block_size=4, num_kv_blocks=48 * case.num_kv_cache_groups)
    assert greedy(llm, case.prompts, NEW_TOKENS) == case.expected
    assert llm.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_2_matches_transformers(case: Case, family: str) -> None:
    llm = case.llm(tensor_parallel_size=2, num_kv_blocks=128)
    try:
        assert greedy(llm, case.prompts, NEW_TOKENS) == case.expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logprobs_match_transformers_log_softmax(case: Case, family: str) -> None:
    prompt = case.prompts[3]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    out = case.llm().generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == case.expected[3]
    reference = hf_log_softmax(case.folder, prompt, out.token_ids)
    assert out.logprobs is not None
    for step, entry in enumerate(out.logprobs):
        top = reference[step].topk(2)
        assert entry.token_ids[1:] == top.indices.tolist()
        assert entry.logprobs == pytest.approx([top.values[0].item(), *top.values.tolist()], abs=1e-4)



@pytest.mark.parametrize("family", ["mistral-sliding-window"])
def test_blocks_out_of_the_window_return_to_the_pool(case: Case, family: str,
                                                     make_tiny_model: Callable[..., Path]) -> None:
    """Every layer of this Mistral slides (window 16): a request holds about its window's blocks,
    so the 8 requests share 60 blocks of 4 without a preemption; the same prompts on a Mistral
    without a window (every block kept to the end) are preempted."""
    windowed = case.llm(max_num_batched_tokens=24, block_size=4, num_kv_blocks=60)
    assert greedy(windowed, case.prompts, NEW_TOKENS) == case.expected
    assert windowed.engine_core.scheduler.num_preemptions == 0
    plain = LLM(model=str(make_tiny_model("mistral", sliding_window=None)), dtype="float32",
                max_num_batched_tokens=24, block_size=4, num_kv_blocks=60)
    greedy(plain, case.prompts, NEW_TOKENS)
    assert plain.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["gemma3"])
def test_sliding_layers_return_blocks_the_global_layer_keeps(case: Case, family: str) -> None:
    """Gemma 3's layers slide, attend globally, slide (window 16): three KV cache groups of one
    layer each, so a request's sliding layers hold about their window's blocks while its global
    layer holds them all. In the same KV memory, the 8 requests run without a preemption; one block
    table for all three layers (every block kept to the end) is preempted."""
    assert case.num_kv_cache_groups == 3
    hybrid = case.llm(max_num_batched_tokens=24, block_size=4, num_kv_blocks=3 * 70)
    assert greedy(hybrid, case.prompts, NEW_TOKENS) == case.expected
    assert hybrid.engine_core.scheduler.num_preemptions == 0
    single = case.llm(max_num_batched_tokens=24, block_size=4, num_kv_blocks=70, disable_hybrid_kv_cache_manager=True)
    assert greedy(single, case.prompts, NEW_TOKENS) == case.expected
    assert single.engine_core.scheduler.num_preemptions > 0
