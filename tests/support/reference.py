"""The reference side of token-exact tests: what Hugging Face transformers generates (fp32, greedy)
and the log-probabilities it assigns, for the random token prompts fed to both it and cadence."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from cadence import LLM, SamplingParams


def hf_greedy(folder: Path | str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' ``generate`` (greedy, fp32, EOS ignored) for each prompt on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine side runs with ignore_eos
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_log_softmax(folder: Path | str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """``[len(completion), vocab]``: transformers' fp32 log-softmax at each position that predicted a
    token of ``completion``, from one forward pass over the whole sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def random_prompts(seed: int, count: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    """``count`` prompts of random ids in ``[3, vocab)``, the second and third sharing a prefix with
    the first (so that the prefix cache hits)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
    prompts[1] = prompts[0][:40] + prompts[1]
    prompts[2] = prompts[0][:33] + prompts[2]
    return prompts


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """cadence's greedy tokens (EOS ignored) for ``prompts``, submitted as one batch."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
