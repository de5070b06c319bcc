"""Admission: a prompt and its sampling parameters, tokenized and checked once, before anything
is sent to an engine core.

Every check a request can fail runs here and raises :class:`~cadence.errors.InvalidRequestError`
naming the field to change; a :class:`PreparedRequest` is a request that passed them all, which the
request manager submits as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, cast

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from cadence.config import EngineConfig
from cadence.core.structured_output import check_constraint
from cadence.engine.prefix_tokenizer import Encode, plain_encode
from cadence.errors import InvalidRequestError
from cadence.lora.adapter import AdapterError, AdapterLimits, check_adapter
from cadence.lora_request import LoRARequest
from cadence.models.kv_groups import kv_cache_groups_of, kv_capacity_tokens
from cadence.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's text prompt as a dict: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt as a dict: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against before it is admitted."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the longest request the KV pool holds for sure
    eos_token_id: int | None
    lora: AdapterLimits | None = None  # None: LoRA is off (no --enable-lora)

    @classmethod
    def of(cls, config: EngineConfig, hf_config: PretrainedConfig, num_blocks: int,
           tokenizer: PreTrainedTokenizerBase) -> ModelLimits:
        """The limits of a model served with ``config`` from a KV pool of ``num_blocks`` (null block included)."""
        return cls(max_model_len=config.model.max_model_len, vocab_size=hf_config.vocab_size,
                   kv_capacity_tokens=kv_capacity_tokens(
                       num_blocks, config.cache.block_size,
                       kv_cache_groups_of(hf_config, config.cache.hybrid_kv_cache).num_groups),
                   eos_token_id=tokenizer.eos_token_id,
                   lora=None if config.lora is None else AdapterLimits.of(hf_config, config.lora.max_lora_rank))


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed admission: its prompt as token ids (with its text, when it came as
    text) and the sampling parameters it was checked with."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (docs/lora.md)


def prompt_content(prompt: Prompt) -> str | list[int]:
    """The text or token ids a prompt holds, a vLLM prompt dict's too.

    :raises InvalidRequestError: a dict without exactly one of ``prompt`` and ``prompt_token_ids``
        (vLLM's multimodal and other keys are not served).
    """
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return cast(TextPrompt, prompt)["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return cast(TokensPrompt, prompt)["prompt_token_ids"]
    raise InvalidRequestError("a prompt dict takes one key: 'prompt' (text) or 'prompt_token_ids'; "
                              f"got {sorted(prompt)}", "prompt")


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int], encode: Encode | None = None
                    ) -> list[int]:
    """Token ids of a text prompt (by ``encode``, else the tokenizer's own); a token-id prompt as a fresh list."""
    if isinstance(prompt, str):
        return (encode or plain_encode(tokenizer))(prompt, True)
    return list(prompt)


def prepare_request(tokenizer: PreTrainedTokenizerBase, limits: ModelLimits, prompt: Prompt,
                    params: SamplingParams, lora_request: LoRARequest | None = None,
                    encode: Encode | None = None) -> PreparedRequest:
    """Tokenize ``prompt`` (by ``encode``, a :class:`PrefixTokenizer`'s, else the tokenizer's own) and
    check the request (and its adapter, if any) against ``limits``.

    :raises InvalidRequestError: saying what to change, with the field in ``param``.
    """
    content = prompt_content(prompt)
    token_ids = tokenize_prompt(tokenizer, content, encode)
    check_request(limits, token_ids, params)
    if lora_request is not None:
        check_lora(limits, lora_request)
    return PreparedRequest(token_ids, params, content if isinstance(content, str) else None, lora_request)


def check_lora(limits: ModelLimits, lora_request: LoRARequest) -> None:
    """:raises InvalidRequestError: LoRA is off, or the adapter does not fit the model (``param``: model)."""
    if limits.lora is None:
        raise InvalidRequestError(f"the request names LoRA adapter {lora_request.lora_name!r}, but this engine "
                                  "serves none; start it with --enable-lora (docs/lora.md)", "model")
    try:
        check_adapter(lora_request.lora_path, limits.lora)
    except AdapterError as exc:
        raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r}: {exc}", "model") from None


def check_request(limits: ModelLimits, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """:raises InvalidRequestError: if the request cannot be served, naming the field to change."""
    num = len(prompt_token_ids)
    if num == 0:
        raise InvalidRequestError("the prompt is empty; give at least one token", "prompt")
    if num >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num} tokens but the model's context length (max_model_len) is "
            f"{limits.max_model_len}; shorten the prompt to at most {limits.max_model_len - 1}", "prompt")
    if any(not isinstance(t, int) or not 0 <= t < limits.vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {limits.vocab_size})", "prompt")
    _check_token_ids(limits.vocab_size, params)
    if params.structured_outputs is not None:
        try:
            check_constraint(params.structured_outputs)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "structured_outputs") from None
    max_tokens = params.max_tokens or limits.max_model_len
    needed = min(num + max_tokens, limits.max_model_len)
    if needed > limits.kv_capacity_tokens:
        raise InvalidRequestError(
            f"the request needs up to {needed} tokens of KV cache but the whole cache holds "
            f"{limits.kv_capacity_tokens}; lower max_tokens or raise --kv-cache-memory", "max_tokens")


def _check_token_ids(vocab_size: int, params: SamplingParams) -> None:
    """Token ids in the parameters must be inside the model's vocabulary."""
    for param, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"{param}: token id {token_id} is outside the vocabulary "
                                          f"(size {vocab_size})", param)
