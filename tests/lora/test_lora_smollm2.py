"""LoRA adapters on the real default model (SmolLM2-135M-Instruct, its GGUF weights kept quantized):
greedy tokens equal transformers + PEFT in fp32 on the same weights dequantized, for a batch mixing
two adapters and the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.lora_adapters import make_adapter, peft_greedy

from cadence import LLM, LoRARequest, SamplingParams
from cadence.models.loader import resolve_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves."]


def test_a_mixed_batch_of_adapters_and_the_base_matches_peft(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    folder = resolve_model(None)
    adapters = [make_adapter(folder, tmp_path / "all16", rank=16, seed=4),
                LoRARequest("attn8", 2, str(make_adapter(folder, tmp_path / "attn8", rank=8, seed=5, use_rslora=True,
                                                         targets=("q_proj", "v_proj", "o_proj"))))]
    loras: list[LoRARequest | None] = [LoRARequest("all16", 1, str(adapters[0])), adapters[1], None]
    llm = LLM(dtype="float32", num_threads=2, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    batch = [(p, lora) for p in prompts for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in batch], params,
                                                         lora_request=[lora for _, lora in batch], use_tqdm=False)]
    want = {None if lora is None else lora.lora_name:
            peft_greedy(folder, None if lora is None else Path(lora.lora_path), prompts, NEW_TOKENS) for lora in loras}
    assert want["all16"] != want[None] and want["attn8"] != want[None]
    assert got == [want[None if lora is None else lora.lora_name][prompts.index(p)] for p, lora in batch]
