"""LoRA adapters made with PEFT at test time, with random non-zero weights (``init_lora_weights=False``
draws B as well as A), and the transformers + PEFT reference cadence's adapted outputs are checked
against (docs/lora.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_folder: Path | str, folder: Path, *, rank: int = 8, alpha: float = 16, seed: int = 0,
                 targets: Sequence[str] = ALL_TARGETS, **lora_options: Any) -> Path:
    """Save a PEFT LoRA adapter of ``model_folder``'s model in ``folder``; ``lora_options`` go to
    ``LoraConfig`` (``use_rslora``, ``layers_to_transform``, ``alpha_pattern`` ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, **lora_options)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's own init leaves B's scale at 1/sqrt(r): keep deltas moderate
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(0.5)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(model_folder: Path | str, adapter: Path | None, prompts: list[list[int]],
                new_tokens: int) -> list[list[int]]:
    """transformers + PEFT ``generate`` (greedy, fp32, EOS ignored) of each prompt on its own, with
    ``adapter`` applied (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
