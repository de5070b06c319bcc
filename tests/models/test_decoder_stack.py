"""The decoder layers as one C++ call (cadence/models/decoder_stack.py) against the Python layer loop
it replaces: the same logits and the same KV caches, bit for bit, for every kind of weight it takes;
and the models it must leave to the loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.ggml_blocks import QUANTIZED, Q, write_tiny_gguf
from support.paged_harness import CPU, PagedHarness

from cadence import LLM, SamplingParams
from cadence.backends import sdpa_backend
from cadence.backends.cpu_kernels import cpu_ops
from cadence.backends.registry import load_backend
from cadence.models import decoder_stack
from cadence.models.decoder_stack import DecoderStack
from cadence.models.gemma import Gemma2ForCausalLM
from cadence.models.llama import LlamaForCausalLM
from cadence.models.loader import load_hf_config, load_model
from cadence.quantization import packed

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ kernels need AVX-512 or AVX2")

# Ragged prompts in one step, a chunk over a cached prefix beside decodes, then decodes.
_STEPS = [{"a": 5, "b": 11}, {"a": 1, "b": 1, "c": 9}, {"c": 4, "a": 1, "b": 1}, {"a": 1, "b": 1, "c": 1}]
_LENGTHS = {"a": 8, "b": 14, "c": 15}


def _both_ways(model: LlamaForCausalLM | Gemma2ForCausalLM) -> None:
    """Run the steps with the stack, then with the Python loop on fresh caches: equal everything."""
    assert isinstance(model.decoder_stack, DecoderStack), "the stack must be built for this model"
    gen = torch.Generator().manual_seed(0)
    tokens = {rid: torch.randint(0, 320, (n,), generator=gen).tolist() for rid, n in _LENGTHS.items()}
    runs = []
    for stack in (model.decoder_stack, None):
        model.decoder_stack = stack
        harness = PagedHarness(model, block_size=4)
        runs.append(([harness.step(tokens, step) for step in _STEPS], harness.kv_caches))
    (stack_logits, stack_caches), (loop_logits, loop_caches) = runs
    for ours, theirs in zip(stack_logits, loop_logits, strict=True):
        assert torch.equal(ours, theirs)
    for (k1, v1), (k2, v2) in zip(stack_caches, loop_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _load(folder: Path, dtype: torch.dtype, quantization: str = "none") -> LlamaForCausalLM | Gemma2ForCausalLM:
    backend = load_backend("sdpa", CPU, dtype, 16, 4)
    model = load_model(str(folder), load_hf_config(str(folder)), dtype, CPU, backend, quantization=quantization)
    assert isinstance(model, LlamaForCausalLM | Gemma2ForCausalLM)
    return model


# qwen2 has q/k/v biases; mistral a sliding window (shorter than the prompts here); qwen3 per-head
# q/k norms; gemma2 soft-capped scores and sliding layers between global ones; gemma3 q/k norms
# scaled by 1 + weight and one RoPE table per layer kind.
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6)
_ARCHS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", dict(sliding_window=6)),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", dict(_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(_GEMMA, num_hidden_layers=3, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
}


@pytest.mark.parametrize("arch", sorted(_ARCHS))
@pytest.mark.parametrize(("dtype", "quantization"), [(torch.float32, "none"), (torch.bfloat16, "none"),
                                                      (torch.bfloat16, "int8")], ids=["fp32", "bf16", "int8"])
def test_the_stack_is_the_layer_loop_bit_for_bit(make_tiny_model: Callable[..., Path], arch: str,
                                                 dtype: torch.dtype, quantization: str) -> None:
    """fp32 runs oneDNN's GEMM on x86 (else F.linear), bf16 the packed GEMM, int8 the quantized kernel."""
    model_type, overrides = _ARCHS[arch]
    _both_ways(_load(make_tiny_model(model_type, **overrides), dtype, quantization))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_stack_runs_the_avx2_bf16_panels_as_the_loop(make_tiny_model: Callable[..., Path], arch: str,
                                                         avx2_bf16_panels: None) -> None:
    """bf16 weights in the AVX2 GEMM's panels (3-D): Llama's gate/up then goes without the AVX512-BF16
    GEMM's SiLU epilogue, through the GEMM and silu_and_mul as the loop does."""
    model_type, overrides = _ARCHS[arch]
    model = _load(make_tiny_model(model_type, **overrides), torch.bfloat16)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dim() == 3
    _both_ways(model)


@pytest.mark.parametrize("kinds", [[Q.Q4_1], [*QUANTIZED]], ids=["one-format", "mixed-formats"])
def test_the_stack_runs_gguf_weights_as_the_loop(kinds: list[Q], tmp_path: Path) -> None:
    """A fused q/k/v or gate/up whose parts come in different formats is a stack of matrices."""
    llm = LLM(model=str(write_tiny_gguf(tmp_path / "tiny.gguf", kinds)), dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine_core.executor.worker.runner.model
    stacked = [m for m in model.modules() if type(getattr(m, "weight", None)).__name__ == "QuantizedRowStack"]
    assert bool(stacked) == (len(kinds) > 1)
    _both_ways(model)


def test_the_stack_sends_batches_past_the_kernel_s_row_limit_to_the_dense_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the AVX2 kernel float32 batches past its row limit (2 here) take the dense GEMM, in the
    stack as in the loop; every step runs the paged-attention kernel, prefills too (the AVX2 default
    leaves those to the loop)."""
    monkeypatch.setattr(packed, "_AVX2_KERNEL_ROWS", 2)
    monkeypatch.setattr(sdpa_backend, "attention_takes_prefills", lambda: True)
    monkeypatch.setattr(decoder_stack, "attention_takes_prefills", lambda: True)
    llm = LLM(model=str(write_tiny_gguf(tmp_path / "tiny.gguf", [*QUANTIZED])), dtype="float32", num_kv_blocks=64)
    _both_ways(llm.engine_core.executor.worker.runner.model)


def test_models_the_kernels_do_not_run_whole_keep_the_loop(make_tiny_model: Callable[..., Path]) -> None:
    # a mixture of experts; RoPE over part of each head (the kernel turns whole heads)
    moe = _load(make_tiny_model("qwen3_moe"), torch.bfloat16)
    partial = _load(make_tiny_model("phi3", partial_rotary_factor=0.5), torch.bfloat16)
    # the torch attention path: a head size the kernels do not take
    odd_heads = _load(make_tiny_model("llama", head_dim=24), torch.bfloat16)
    assert moe.decoder_stack is None and partial.decoder_stack is None and odd_heads.decoder_stack is None
    assert _load(make_tiny_model("llama"), torch.bfloat16).decoder_stack is not None


def test_enforce_eager_keeps_the_loop_and_the_same_tokens(make_tiny_model: Callable[..., Path]) -> None:
    folder, params = str(make_tiny_model("llama")), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(20, 45))]
    fast, eager = (LLM(model=folder, dtype="bfloat16", num_kv_blocks=64, enforce_eager=e) for e in (False, True))
    assert isinstance(fast.engine_core.executor.worker.runner.model.decoder_stack, DecoderStack)
    assert eager.engine_core.executor.worker.runner.model.decoder_stack is None
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
