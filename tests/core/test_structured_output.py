"""Structured output without the real model: constraint checks, the bitmask on logits, its transport,
and the engine's handling of grammars (compile waits, the cache, failures, preemption) on a tiny model.

The real-model proofs (20 JSON schemas, choice, regex, mixed batches, the OpenAI client) are in
``test_structured_output_smollm2.py`` and ``test_structured_output_api.py``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import xgrammar

from cadence import LLM, SamplingParams
from cadence.core.structured_output import StructuredOutputManager, check_constraint
from cadence.executor.sampler import apply_grammar_bitmask
from cadence.messages import GrammarBitmask, SchedulerOutput
from cadence.models.loader import load_tokenizer
from cadence.runtime.codec import Codec
from cadence.sampling_params import StructuredOutputsParams

# A finite language, so even a random model ends it within a bounded number of tokens.
WORDS = r"(ab|cd|ef)( (ab|cd|ef)){3,7}"


# ---- constraints -----------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "structured_outputs takes exactly one of json, regex, choice, grammar or json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, "takes exactly one of .*, got regex, choice"),
    ({"choice": []}, "structured_outputs.choice must list at least one option"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
])
def test_a_constraint_takes_exactly_one_well_formed_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_equal_schemas_share_a_key_and_key_order_is_kept() -> None:
    spaced = StructuredOutputsParams(json='{ "type": "object",\n "properties": {"b": {}, "a": {}} }')
    parsed = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spaced.key == parsed.key == ("json", '{"type":"object","properties":{"b":{},"a":{}}}')
    assert StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}, "type": "object"}).key != parsed.key


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json": {"type": "object", "required": "name"}},
     r"^invalid JSON schema: 'name' is not of type 'array' \(at \$\.required\)$"),
    ({"json": {"type": "object", "properties": {"n": {"type": "string", "maxLength": -1}}}},
     r"^invalid JSON schema: -1 is less than the minimum of 0 \(at \$\.properties\.n\.maxLength\)$"),
    ({"json": {"type": "objectx"}}, r"^invalid JSON schema: 'objectx' is not valid under any of the given schemas"),
    ({"json": [1, 2]}, r"^invalid JSON schema: a schema must be a JSON object, got \[1, 2\]$"),
    ({"regex": "a(b"}, r"^invalid regex: Regex parsing error at position 4: The parenthesis is not closed\.$"),
    ({"grammar": "root ::= item"}, r"^invalid grammar: EBNF parser error at line 1, column 10: Rule \"item\" is not "
                                   r"defined$"),
])
def test_a_bad_constraint_is_rejected_naming_the_problem(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_constraint(StructuredOutputsParams(**kwargs))


@pytest.mark.parametrize("kwargs", [
    {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
    {"regex": WORDS},
    {"choice": ['say "hi"', "back\\slash", "new\nline", ""]},
    {"grammar": 'root ::= "yes" | "no"'},
    {"json_object": True},
])
def test_good_constraints_pass(kwargs: dict[str, Any]) -> None:
    check_constraint(StructuredOutputsParams(**kwargs))


# ---- the bitmask -----------------------------------------------------------------------------


def packed(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """xgrammar's bitmask allowing exactly ``allowed[i]`` in row i."""
    bits = torch.zeros(len(allowed), (vocab + 31) // 32 * 32, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        bits[row, ids] = 1
    words = (bits.view(len(allowed), -1, 32) << torch.arange(32)).sum(-1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # as signed 32-bit words


def test_the_bitmask_masks_exactly_the_constrained_rows_by_request_id() -> None:
    vocab = 70
    logits = torch.randn(4, vocab)
    before = logits.clone()
    grammar = GrammarBitmask(request_ids=["c", "a"], bitmask=packed([[0, 33, 69], [5]], vocab))
    apply_grammar_bitmask(logits, ["a", "b", "c", "d"], grammar)
    for row, allowed in [(0, [5]), (2, [0, 33, 69])]:
        expected = torch.full((vocab,), float("-inf"))
        expected[allowed] = before[row, allowed]
        assert torch.equal(logits[row], expected)
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_a_request_verifying_drafts_has_a_bitmask_row_per_position() -> None:
    vocab = 70
    logits = torch.randn(4, vocab)
    before = logits.clone()
    grammar = GrammarBitmask(request_ids=["b", "b", "b"], bitmask=packed([[1], [2, 3], [4]], vocab))
    apply_grammar_bitmask(logits, ["a", "b", "b", "b"], grammar)
    for row, allowed in [(1, [1]), (2, [2, 3]), (3, [4])]:
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == allowed
    assert torch.equal(logits[0], before[0])


def test_a_step_with_a_bitmask_survives_the_transport_codec() -> None:
    bitmask = xgrammar.allocate_token_bitmask(2, 100)
    bitmask[1, 0] = 5
    step = SchedulerOutput(step_id=3, new_requests=[], cached_requests=[], num_scheduled_tokens={"a": 1, "b": 1},
                           finished_request_ids=[], preempted_request_ids=[],
                           grammar_bitmask=GrammarBitmask(request_ids=["b", "a"], bitmask=bitmask))
    codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
    decoded = codec.decode(codec.encode(step))
    assert decoded.grammar_bitmask is not None and decoded.grammar_bitmask.request_ids == ["b", "a"]
    assert decoded.grammar_bitmask.bitmask.dtype == torch.int32
    assert torch.equal(decoded.grammar_bitmask.bitmask, bitmask)
    assert codec.decode(codec.encode(SchedulerOutput(1, [], [], {}, [], []))).grammar_bitmask is None


# ---- the engine, on a tiny random model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(model=str(tiny), dtype="float32")


def words(max_tokens: int = 30, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(regex=WORDS), **kwargs)


PROMPTS = [[5, 17, 99, 3], [250, 8, 8, 71, 12, 40], [33, 34, 35], [100, 200, 300, 9, 9]]
FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def texts(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[str, list[int], str | None]]:
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_random_model_under_a_regex_matches_it_and_stops(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    for text, token_ids, finish in texts(llm, PROMPTS, [words(temperature=0), words(seed=1), words(seed=2),
                                                        words(temperature=0)]):
        assert re.fullmatch(WORDS, text) and finish == "stop" and token_ids[-1] == eos


def test_preemption_keeps_constrained_outputs_intact(tiny: Path, llm: LLM) -> None:
    params = [words(temperature=0), FREE, words(seed=3), words(temperature=0)]
    roomy = texts(llm, PROMPTS, params)
    # 10 blocks of 4 tokens: the four requests cannot all hold their 15-35 tokens at once.
    cramped = LLM(model=str(tiny), dtype="float32", num_kv_blocks=11, block_size=4, max_num_batched_tokens=64)
    assert texts(cramped, PROMPTS, params) == roomy
    assert cramped.engine_core.scheduler.num_preemptions > 0
    assert all(re.fullmatch(WORDS, text) for text, _, _ in [roomy[0], *roomy[2:]])


def failing_loader() -> Any:
    raise OSError("tokenizer files are gone")


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = texts(llm, PROMPTS[1:2], [FREE])[0]
    monkeypatch.setattr(llm.engine_core.scheduler, "structured_output", StructuredOutputManager(failing_loader, 320))
    failed, neighbour = llm.generate(PROMPTS[:2], [words(temperature=0), FREE], use_tqdm=False)
    assert (failed.outputs[0].text, failed.outputs[0].token_ids, failed.outputs[0].finish_reason) == ("", [], "error")
    assert failed.error == "the grammar failed to compile: tokenizer files are gone"
    assert neighbour.error is None
    assert (neighbour.outputs[0].text, neighbour.outputs[0].token_ids, neighbour.outputs[0].finish_reason) == alone


class FailsAfterTheLook(StructuredOutputManager):
    """Its first compile fails just after the engine looked for failed compiles, before it decides
    whether to wait for grammars: the window in which an idle engine used to step with nothing to
    schedule, and die."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        super().__init__(self._gated_failure, 320)

    def _gated_failure(self) -> Any:
        assert self.gate.wait(30), "the engine never looked for failures"
        raise OSError("tokenizer files are gone")

    def take_failures(self) -> dict[str, str]:
        failures = super().take_failures()
        if not self.gate.is_set():
            self.gate.set()
            self.wait(30)  # the compile has failed when this returns
        return failures


def test_a_compile_failing_while_the_engine_is_idle_fails_only_its_request(llm: LLM,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    alone = texts(llm, PROMPTS[1:2], [FREE])
    monkeypatch.setattr(llm.engine_core.scheduler, "structured_output", FailsAfterTheLook())
    [failed] = llm.generate(PROMPTS[:1], words(temperature=0), use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error == "the grammar failed to compile: tokenizer files are gone"
    assert texts(llm, PROMPTS[1:2], [FREE]) == alone  # the engine lives on


def test_a_request_waits_for_its_grammar_while_others_run(tiny: Path, llm: LLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    def gated_loader() -> Any:  # the engine's first compile loads the tokenizer: hold it there
        assert gate.wait(30), "the test never opened the gate"
        return load_tokenizer(str(tiny))

    compiled: list[str] = []
    compile_grammar = xgrammar.GrammarCompiler.compile_grammar

    def counted(self: xgrammar.GrammarCompiler, grammar: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        compiled.append(str(grammar))
        return compile_grammar(self, grammar)

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", counted)
    engine = llm.engine_core
    monkeypatch.setattr(engine.scheduler, "structured_output", StructuredOutputManager(gated_loader, 320))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    same = [StructuredOutputsParams(json=schema), StructuredOutputsParams(json='{"type": "object", "properties": '
                                                                              '{"ok": {"type": "boolean"}}, '
                                                                              '"required": ["ok"]}')]

    async def run() -> tuple[list[str | None], list[str]]:
        async with llm.running() as running:
            # At most 16 whitespace characters in each of the 4 gaps, then 5 tokens of JSON: 100 is enough.
            constrained = [await running.submit(running.prepare(PROMPTS[0], SamplingParams(
                temperature=0, max_tokens=100, structured_outputs=c)), f"c{i}") for i, c in enumerate(same)]
            free = await running.submit(running.prepare(PROMPTS[2], FREE), "free")
            done = await free.result()
            # The free request finished while both constrained ones were still waiting for their grammar.
            waiting = [h.output.outputs[0].finish_reason for h in constrained]
            assert done.outputs[0].finish_reason == "length" and not engine.scheduler.running
            gate.set()
            return waiting, [(await h.result()).outputs[0].text for h in constrained]

    waiting, results = anyio.run(run)
    assert waiting == [None, None]
    assert results[0] == results[1] and re.fullmatch(r'\s*\{\s*"ok"\s*:\s*(true|false)\s*\}\s*', results[0])
    assert len(compiled) == 1  # equal constraints compiled once


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_and_stays_cached(tiny: Path) -> None:
    gate = threading.Event()

    def gated_loader() -> Any:  # the first compile loads the tokenizer: hold it there
        assert gate.wait(30), "the test never opened the gate"
        return load_tokenizer(str(tiny))

    slow = StructuredOutputManager(gated_loader, 320, compile_timeout_s=0.0)
    constraint = StructuredOutputsParams(regex=WORDS)
    slow.add_request("late", constraint)
    assert not slow.is_ready("late")
    assert slow.take_failures() == {"late": "the grammar did not compile within 0 s"}
    assert slow.num_compiling == 0
    gate.set()  # the compile goes on, and its grammar serves the next request with the constraint
    slow.add_request("next", constraint)
    slow.wait(30)  # the one compile, started for "late", finishes
    assert slow.is_ready("next") and slow.num_active == 1 and slow.num_compiling == 0
