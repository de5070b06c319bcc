"""LoRA deltas in the C++ decoder stack (``Linear.apply`` in backends/csrc/decoder_stack.cpp) against
the Python layer loop's hooks: the same logits and KV caches, bit for bit, for plain (fp32) and
packed (bf16) slots, Llama's layers and Gemma 3's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.lora_adapters import make_adapter
from support.paged_harness import CPU, PagedHarness

from cadence.backends.cpu_kernels import cpu_ops
from cadence.backends.registry import load_backend
from cadence.config import LoRAConfig
from cadence.lora.manager import LoRAManager
from cadence.lora_request import LoRARequest
from cadence.models.decoder_stack import DecoderStack
from cadence.models.loader import load_hf_config, load_model

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the C++ kernels need AVX-512 or AVX2")

# Prompts of three requests (two adapters and the base model), then decodes beside a chunk, then
# steps all on one adapter (its slot alone, no mask).
_STEPS = [{"a": 5, "b": 11}, {"a": 1, "b": 1, "c": 9}, {"c": 4, "a": 1, "b": 1}, {"a": 1, "b": 1, "c": 1},
          {"a": 1}, {"b": 1}]
_LENGTHS = {"a": 9, "b": 15, "c": 15}
_ARCHS = {"llama": ("llama", {}), "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=24,
                                                                 sliding_window=6, num_hidden_layers=2))}


@pytest.mark.parametrize("arch", sorted(_ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_stack_adds_the_deltas_as_the_layer_hooks_do(make_tiny_model: Callable[..., Path],
                                                         tmp_path: Path, arch: str, dtype: torch.dtype) -> None:
    model_type, overrides = _ARCHS[arch]
    folder = make_tiny_model(model_type, **overrides)
    model = load_model(str(folder), load_hf_config(str(folder)), dtype, CPU, load_backend("sdpa", CPU, dtype, 16, 4))
    stack = model.decoder_stack
    assert isinstance(stack, DecoderStack)
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), dtype, CPU)
    loras = {"a": LoRARequest("x", 1, str(make_adapter(folder, tmp_path / "x", rank=8, seed=1))),
             "b": LoRARequest("y", 2, str(make_adapter(folder, tmp_path / "y", rank=4, seed=2))), "c": None}
    gen = torch.Generator().manual_seed(0)
    tokens = {rid: torch.randint(0, 320, (n,), generator=gen).tolist() for rid, n in _LENGTHS.items()}
    runs = []
    for use_stack in (True, False):
        model.decoder_stack = stack if use_stack else None
        harness = PagedHarness(model, block_size=4)
        logits = []
        for step in _STEPS:
            manager.prepare([loras[rid] for rid in step], np.array(list(step.values())))
            one_adapter = len(step) == 1
            assert stack.enabled and len(stack.lora_masks) == (0 if one_adapter else 3)  # small steps: in the stack
            assert (stack.lora_slot >= 0) == one_adapter
            logits.append(harness.step(tokens, step))
        runs.append((logits, harness.kv_caches))
    (stack_logits, stack_caches), (loop_logits, loop_caches) = runs
    for ours, theirs in zip(stack_logits, loop_logits, strict=True):
        assert torch.equal(ours, theirs)
    for (k1, v1), (k2, v2) in zip(stack_caches, loop_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    manager.prepare([None, None], np.array([1, 1]))
    assert stack.enabled and stack.lora_masks == []
