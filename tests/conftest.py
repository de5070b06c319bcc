"""Shared test factories.

``make_tiny_model`` builds tiny random Hugging Face checkpoints (Llama, Qwen2, Mistral) with a
byte-level BPE tokenizer, offline, in well under a second; each variant is built once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
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
    """A 2-layer config (hidden 64, 4 heads, 2 KV heads) for ``arch`` in llama, qwen2, mistral."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        architectures=[names[arch]],
    )
    kwargs.update(overrides)
    return classes[arch](**kwargs)


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


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_tiny_model(arch, **config_overrides) -> folder``, built once per distinct call."""
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(arch: str = "llama", **overrides: Any) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return built[key]

    return make


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """Tiny models: a second intra-op thread only adds synchronisation, and stalls badly on a busy
    machine. Tests of the real model ask for their threads explicitly (``LLM(num_threads=...)``)."""
    torch.set_num_threads(1)


@pytest.fixture
def kill_mid_generation() -> Callable[[Any, int], BaseException | None]:
    """``kill(llm, pid) -> what generate raised``: a long greedy request runs in a thread while the
    worker ``pid`` is paused (SIGSTOP) before it comes, so neither the request nor its first step
    can finish; the worker is SIGKILLed once that step is running. Fails if generate then hangs."""
    import os
    import signal
    import threading

    from cadence import SamplingParams

    def kill(llm: Any, pid: int) -> BaseException | None:
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        os.kill(pid, signal.SIGSTOP)
        thread = threading.Thread(target=run)
        thread.start()
        while not llm.engine_core.scheduler.running and thread.is_alive():  # the first step is running
            thread.join(0.01)
        os.kill(pid, signal.SIGKILL)
        thread.join(300)  # a hang guard only
        assert not thread.is_alive(), "generation hung after a worker died"
        return outcome[0]

    return kill
