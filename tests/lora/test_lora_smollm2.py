"""LoRA adapters on the real default model (SmolLM2-135M-Instruct, its GGUF weights kept quantized):
greedy tokens equal transformers + PEFT in fp32 on the same weights dequantized, for each of three
adapters alone and for a batch mixing them and the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.lora_adapters import make_adapter, peft_greedy

from cadence import LLM, LoRARequest, SamplingParams
from cadence.config import default_threads
from cadence.models.loader import resolve_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves."]


def test_three_adapters_alone_and_mixed_with_the_base_match_peft(tmp_path: Path) -> None:
    torch.set_num_threads(default_threads())
    folder = resolve_model(None)
    made = {"all16": dict(rank=16, seed=4), "attn8": dict(rank=8, seed=5, use_rslora=True,
                                                            targets=("q_proj", "v_proj", "o_proj")),
            "mlp4": dict(rank=4, seed=6, targets=("gate_proj", "up_proj", "down_proj"), layers_to_transform=[0, 7])}
    loras = [LoRARequest(name, i + 1, str(make_adapter(folder, tmp_path / name, **options)))
             for i, (name, options) in enumerate(made.items())]
    llm = LLM(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = {lora.lora_name: peft_greedy(folder, Path(lora.lora_path), prompts, NEW_TOKENS) for lora in loras}
    want[None] = peft_greedy(folder, None, prompts, NEW_TOKENS)
    for lora in loras:
        assert want[lora.lora_name] != want[None]
        alone = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in alone] == want[lora.lora_name]
    mixed: list[LoRARequest | None] = [*loras, None]
    batch = [(p, lora) for p in prompts for lora in mixed]
    got = llm.generate([p for p, _ in batch], params, lora_request=[lora for _, lora in batch], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [want[None if lora is None else lora.lora_name][prompts.index(p)]
                                                      for p, lora in batch]
