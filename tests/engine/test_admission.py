"""Admission: a prompt is tokenized once and every check a request can fail raises
InvalidRequestError naming the field to change, before anything reaches an engine core."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.tiny_models import TINY_VOCAB, build_tiny_tokenizer

from cadence.engine.admission import ModelLimits, PreparedRequest, check_request, prepare_request, tokenize_prompt
from cadence.engine_args import EngineArgs
from cadence.errors import InvalidRequestError
from cadence.models.loader import load_hf_config
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

LIMITS = ModelLimits(max_model_len=64, vocab_size=TINY_VOCAB, kv_capacity_tokens=96, eos_token_id=0)
OK = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def refused(prompt: list[int], params: SamplingParams, limits: ModelLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        check_request(limits, prompt, params)
    return caught.value


# ---- limits --------------------------------------------------------------------------------


def test_limits_of_a_served_model(make_tiny_model: Callable[..., Path], tokenizer: Any) -> None:
    path = make_tiny_model("llama")
    config = EngineArgs(model=str(path), dtype="float32", max_model_len=100, block_size=8).create_config()
    limits = ModelLimits.of(config, load_hf_config(str(path)), 13, tokenizer)
    # The null block holds no tokens.
    assert limits == ModelLimits(max_model_len=100, vocab_size=TINY_VOCAB, kv_capacity_tokens=96, eos_token_id=0)


def test_limits_without_an_eos_token(make_tiny_model: Callable[..., Path]) -> None:
    class NoEos:
        eos_token_id = None

    path = make_tiny_model("llama")
    config = EngineArgs(model=str(path), dtype="float32").create_config()
    limits = ModelLimits.of(config, load_hf_config(str(path)), 2, NoEos())  # type: ignore[arg-type]
    assert limits.eos_token_id is None and limits.kv_capacity_tokens == config.cache.block_size


# ---- prompts -------------------------------------------------------------------------------


def test_a_text_prompt_is_tokenized_and_kept(tokenizer: Any) -> None:
    text = "Hello world! How are you today?"
    prepared = prepare_request(tokenizer, LIMITS, text, OK)
    assert prepared == PreparedRequest(list(tokenizer(text).input_ids), OK, text)
    assert prepared.prompt_token_ids == [276, 295, 223, 306, 294, 3, 223, 277, 89, 223, 261, 71, 223, 308, 223, 303, 33]
    assert prepared.params is OK


def test_a_token_prompt_is_copied_and_has_no_text(tokenizer: Any) -> None:
    prompt = [5, 6, 7]
    prepared = prepare_request(tokenizer, LIMITS, prompt, OK)
    assert prepared.prompt_token_ids == [5, 6, 7] and prepared.prompt_text is None
    prompt.append(8)
    assert prepared.prompt_token_ids == [5, 6, 7]
    assert tokenize_prompt(tokenizer, prompt) is not prompt


def test_a_prepared_request_is_frozen(tokenizer: Any) -> None:
    prepared = prepare_request(tokenizer, LIMITS, [1], OK)
    with pytest.raises(AttributeError):
        prepared.prompt_text = "x"  # type: ignore[misc]


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "no-tokens"])
def test_an_empty_prompt_is_refused(tokenizer: Any, prompt: str | list[int]) -> None:
    with pytest.raises(InvalidRequestError, match="the prompt is empty") as caught:
        prepare_request(tokenizer, LIMITS, prompt, OK)
    assert caught.value.param == "prompt"


def test_a_prompt_as_long_as_the_context_is_refused() -> None:
    error = refused([1] * 64, OK)
    assert error.param == "prompt"
    assert str(error) == ("the prompt has 64 tokens but the model's context length (max_model_len) is 64; "
                          "shorten the prompt to at most 63")
    check_request(LIMITS, [1] * 63, SamplingParams(max_tokens=1))  # one token short fits


@pytest.mark.parametrize("bad", [-1, TINY_VOCAB, 10**9, 1.0, "5", None], ids=repr)
def test_a_prompt_token_outside_the_vocabulary_is_refused(bad: Any) -> None:
    error = refused([1, bad, 2], OK)
    assert error.param == "prompt" and str(error) == f"prompt token ids must be integers in [0, {TINY_VOCAB})"


def test_prompt_tokens_at_the_vocabulary_edges_pass() -> None:
    check_request(LIMITS, [0, TINY_VOCAB - 1], OK)


def test_a_text_prompt_too_long_is_refused_after_tokenizing(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="the prompt has 68 tokens") as caught:
        prepare_request(tokenizer, LIMITS, "Hello world! How are you today?" * 4, OK)
    assert caught.value.param == "prompt"


# ---- parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "param", "token"), [
    (SamplingParams(stop_token_ids=[3, TINY_VOCAB]), "stop_token_ids", TINY_VOCAB),
    (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids", 10**6),
    (SamplingParams(logit_bias={5: 1.0, TINY_VOCAB + 1: 2.0}), "logit_bias", TINY_VOCAB + 1),
    (SamplingParams(logit_bias={-1: 1.0}), "logit_bias", -1),
], ids=["stop-edge", "stop-far", "bias-over", "bias-negative"])
def test_token_ids_in_the_parameters_must_be_in_the_vocabulary(params: SamplingParams, param: str,
                                                               token: int) -> None:
    error = refused([1], params)
    assert error.param == param
    assert str(error) == f"{param}: token id {token} is outside the vocabulary (size {TINY_VOCAB})"


def test_token_ids_in_the_parameters_at_the_edges_pass() -> None:
    check_request(LIMITS, [1], SamplingParams(stop_token_ids=[0, TINY_VOCAB - 1],
                                              logit_bias={0: -100.0, TINY_VOCAB - 1: 100.0}))


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="(unclosed"),
    StructuredOutputsParams(json={"type": "object", "required": "name"}),
    StructuredOutputsParams(json='["not", "a", "schema"]'),
    StructuredOutputsParams(grammar="root ::= undefined_rule"),
], ids=["regex", "schema-invalid", "schema-not-object", "grammar"])
def test_a_constraint_that_does_not_compile_is_refused(constraint: StructuredOutputsParams) -> None:
    error = refused([1], SamplingParams(structured_outputs=constraint))
    assert error.param == "structured_outputs"
    assert str(error).startswith("invalid ")


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="[a-z]+"),
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),
], ids=["regex", "schema", "choice", "json-object", "grammar"])
def test_a_constraint_that_compiles_passes(constraint: StructuredOutputsParams) -> None:
    check_request(LIMITS, [1], SamplingParams(structured_outputs=constraint))


def test_a_request_bigger_than_the_kv_cache_is_refused() -> None:
    long_context = ModelLimits(max_model_len=200, vocab_size=TINY_VOCAB, kv_capacity_tokens=96, eos_token_id=0)
    error = refused([1] * 40, SamplingParams(max_tokens=57), long_context)
    assert error.param == "max_tokens"
    assert str(error) == ("the request needs up to 97 tokens of KV cache but the whole cache holds 96; "
                          "lower max_tokens or raise --kv-cache-memory")
    check_request(long_context, [1] * 40, SamplingParams(max_tokens=56))  # exactly the whole cache fits


def test_the_kv_need_is_capped_by_the_context_length() -> None:
    small = ModelLimits(max_model_len=64, vocab_size=TINY_VOCAB, kv_capacity_tokens=64, eos_token_id=0)
    check_request(small, [1] * 40, SamplingParams(max_tokens=1000))  # stops at 64 tokens anyway
    tight = ModelLimits(max_model_len=64, vocab_size=TINY_VOCAB, kv_capacity_tokens=63, eos_token_id=0)
    assert refused([1] * 40, SamplingParams(max_tokens=1000), tight).param == "max_tokens"


def test_no_max_tokens_needs_the_whole_context() -> None:
    fits = ModelLimits(max_model_len=64, vocab_size=TINY_VOCAB, kv_capacity_tokens=64, eos_token_id=0)
    check_request(fits, [1], SamplingParams(max_tokens=None))
    short = ModelLimits(max_model_len=64, vocab_size=TINY_VOCAB, kv_capacity_tokens=48, eos_token_id=0)
    error = refused([1], SamplingParams(max_tokens=None), short)
    assert error.param == "max_tokens" and "needs up to 64 tokens" in str(error)


def test_refusals_are_value_errors() -> None:
    assert issubclass(InvalidRequestError, ValueError)
    assert InvalidRequestError("x").param is None
