"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Mistral) and a byte-level BPE tokenizer,
built offline in well under a second, for tests that need a model but not a real one (the
``make_tiny_model`` fixture in tests/conftest.py builds each variant once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 320
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TRAINING_TEXT = [
    "The capital of France is Paris.",
    "Hello world! How are you today?",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "0123456789 + - * / = ( ) [ ] { }",
]


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A 2-layer config (hidden 64, 4 heads, 2 KV heads) of transformers' ``model_type`` ``arch``
    (llama, qwen2, mistral, qwen3, phi3, mixtral, qwen3_moe ...), naming its causal-LM class;
    ``overrides`` set any of its fields (a family's own: experts, windows, rope scaling ...)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]],
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (vocabulary of ``TINY_VOCAB``) trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=TINY_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=_TINY_CHAT_TEMPLATE)


def build_tiny_model(folder: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random fp32 ``arch`` model (safetensors + config) and the tiny tokenizer in ``folder``.

    Weights are drawn wider than transformers' init (std 0.1, norms around 1, biases non-zero) so
    that logits are O(1) and every parameter, biases included, affects the output.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def noisy_copy(folder: Path, dest: Path, std: float, seed: int = 0) -> Path:
    """``folder``'s model with N(0, ``std``) noise added to every weight, in ``dest``: a draft model
    that agrees with it often but not always (the tiny Llama's greedy tokens, at std 0.005: the first
    draft about two times in three)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, dest / path.name)
    generator = torch.Generator().manual_seed(seed)
    for path in folder.glob("*.safetensors"):
        weights = {name: w + std * torch.randn(w.shape, generator=generator) for name, w in load_file(path).items()}
        save_file(weights, dest / path.name, metadata={"format": "pt"})
    return dest
