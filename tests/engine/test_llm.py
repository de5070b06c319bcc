"""The offline ``LLM`` API: sampling behaviour, stops, bad input and engine failure."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence import LLM, SamplingParams, TextPrompt, TokensPrompt
from cadence.errors import EngineDeadError


@pytest.fixture(scope="module")
def llm(make_tiny_model: Callable[..., Path]) -> LLM:
    return LLM(model=str(make_tiny_model("llama")), dtype="float32")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def assert_engine_clean(llm: LLM) -> None:
    engine = llm.engine_core
    assert not engine.scheduler.requests
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks - 1
    engine.allocator.check_integrity()


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm: LLM) -> None:
    target = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)] * 5
    batch = [*prompts(5, seed=6)[:2], target, *prompts(5, seed=6)[2:]]
    mixed = llm.generate(batch, [*others[:2], params, *others[2:]], use_tqdm=False)[2].outputs[0].token_ids
    assert alone == again == mixed
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_returns_distinct_seeded_samples(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate(prompts(1), params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert llm.generate(prompts(1), params, use_tqdm=False)[0].outputs == out.outputs


def test_stop_string_truncates_text_at_the_right_place(llm: LLM) -> None:
    prompt = prompts(1, seed=2)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert base.token_ids[:len(out.token_ids)] == out.token_ids
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]
    assert_engine_clean(llm)


def test_stop_token_id_ends_generation_on_that_token(llm: LLM) -> None:
    prompt = prompts(1, seed=3)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    k = 6
    while base[k] in base[:k]:
        k += 1
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[base[k]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", base[k])


def test_min_tokens_defers_the_stop_token(llm: LLM) -> None:
    prompt = prompts(1, seed=3)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    first = base[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=8,
                                                stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 9 or out.finish_reason == "length"
    assert first not in out.token_ids[:8]


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logit_bias={0: 100.0})  # token 0 is EOS
    out = llm.generate(prompts(1), params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([0], "stop")
    ignoring = SamplingParams(temperature=0, max_tokens=5, logit_bias={0: 100.0}, ignore_eos=True)
    out = llm.generate(prompts(1), ignoring, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([0] * 5, "length")


def test_string_prompts_and_chat(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_text = llm.generate("Hello world!", params, use_tqdm=False)[0]
    by_ids = llm.generate([llm.tokenizer("Hello world!").input_ids], params, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == "Hello world!"
    chat = llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                                 add_generation_prompt=True, tokenize=False)
    assert llm.tokenizer.decode(chat.prompt_token_ids) == expected


def test_vllm_s_prompt_dicts_are_prompts(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer("Hello world!").input_ids
    by_text, by_ids = llm.generate([TextPrompt(prompt="Hello world!"), TokensPrompt(prompt_token_ids=ids)], params,
                                   use_tqdm=False)
    alone = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)  # one dict: one prompt
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert (by_text.prompt, by_ids.prompt, by_ids.prompt_token_ids) == ("Hello world!", None, ids)
    with pytest.raises(ValueError, match=r"'prompt_token_ids'; got \['multi_modal_data', 'prompt'\]"):
        llm.generate([[5, 6], {"prompt": "Hi", "multi_modal_data": {}}], params, use_tqdm=False)
    assert_engine_clean(llm)


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([], SamplingParams(), "prompt is empty"),
    ([5] * 600, SamplingParams(), "prompt has 600 tokens but the model's context length"),
    ([5, 9999], SamplingParams(), r"prompt token ids must be integers in \[0, 320\)"),
    ([5, 6], SamplingParams(stop_token_ids=[400]), "outside the vocabulary"),
])
def test_bad_prompts_raise_and_admit_nothing(llm: LLM, prompt: list[int], params: SamplingParams,
                                             message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    assert_engine_clean(llm)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be"),
    ({"min_p": 2.0}, "min_p must be in"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"n": 0}, "n must be at least 1"),
    ({"min_tokens": 5, "max_tokens": 2}, "must not exceed max_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 3.0}, "presence_penalty must be in"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"stop": [""]}, "stop strings must not be empty"),
])
def test_invalid_sampling_values_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_bigger_than_the_kv_cache_is_rejected(make_tiny_model: Callable[..., Path]) -> None:
    small = LLM(model=str(make_tiny_model("llama")), dtype="float32", num_kv_blocks=3)
    with pytest.raises(ValueError, match="needs up to 40 tokens of KV cache but the whole cache holds 32"):
        small.generate([[5] * 30], SamplingParams(max_tokens=10), use_tqdm=False)
    assert_engine_clean(small)


def test_a_crashing_worker_fails_pending_requests_instead_of_hanging(make_tiny_model: Callable[..., Path]) -> None:
    broken = LLM(model=str(make_tiny_model("llama")), dtype="float32")

    def explode(*_: object) -> None:
        raise RuntimeError("simulated device failure")

    broken.engine_core.worker.execute_model = explode  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="simulated device failure"):
        broken.generate(prompts(4), SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        broken.generate(prompts(1), SamplingParams(max_tokens=4), use_tqdm=False)
