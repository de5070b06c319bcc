"""LoRA adapters in the engine (docs/lora.md): greedy tokens equal transformers + PEFT in fp32 for each
adapter alone and for one batch mixing three adapters and the base model, on tiny random models of
two families; adapters made with PEFT at test time (``support/lora_adapters.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.lora_adapters import make_adapter, peft_greedy

from cadence import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 12
PROMPTS = [[5, 9, 77, 120, 33, 8], [200, 14, 3], list(range(40, 75)), [250, 251, 9, 18, 60, 61, 62, 19]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest, make_tiny_model: Callable[..., Path],
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LoRARequest]]:
    """A tiny model and three adapters: all seven projections at rank 8; attention only at rank 4
    with rsLoRA; the MLP of layer 1 only at rank 2 with an alpha pattern."""
    model = make_tiny_model(request.param)
    folder = tmp_path_factory.mktemp(f"adapters-{request.param}")
    adapters = [
        make_adapter(model, folder / "all", rank=8, seed=1),
        make_adapter(model, folder / "attn", rank=4, seed=2, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                     use_rslora=True),
        make_adapter(model, folder / "mlp1", rank=2, seed=3, targets=("gate_proj", "up_proj", "down_proj"),
                     layers_to_transform=[1], alpha_pattern={"down_proj": 7}),
    ]
    return model, [LoRARequest(path.name, i + 1, str(path)) for i, path in enumerate(adapters)]


@pytest.fixture(scope="module")
def llm(family: tuple[Path, list[LoRARequest]]) -> LLM:
    return LLM(model=str(family[0]), dtype="float32", num_threads=1, enable_lora=True, max_loras=3, max_lora_rank=8)


@pytest.fixture(scope="module")
def references(family: tuple[Path, list[LoRARequest]]) -> dict[str | None, list[list[int]]]:
    model, loras = family
    refs: dict[str | None, list[list[int]]] = {None: peft_greedy(model, None, PROMPTS, NEW_TOKENS)}
    for lora in loras:
        refs[lora.lora_name] = peft_greedy(model, Path(lora.lora_path), PROMPTS, NEW_TOKENS)
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_matches_peft(llm: LLM, family: tuple[Path, list[LoRARequest]],
                                        references: dict[str | None, list[list[int]]]) -> None:
    for lora in family[1]:
        assert references[lora.lora_name] != references[None]  # the adapter changes the output
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False)) == references[lora.lora_name]


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(
        llm: LLM, family: tuple[Path, list[LoRARequest]], references: dict[str | None, list[list[int]]]) -> None:
    loras: list[LoRARequest | None] = [*family[1], None]
    batch = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    got = _tokens(llm.generate([p for p, _ in batch], GREEDY, lora_request=[lora for _, lora in batch],
                               use_tqdm=False))
    want = [references[None if lora is None else lora.lora_name][PROMPTS.index(p)] for p, lora in batch]
    assert got == want


def test_a_large_mixed_step_runs_each_adapter_s_rows_as_one_slice(
        llm: LLM, family: tuple[Path, list[LoRARequest]]) -> None:
    """Sixteen 60-token prompts, four each for three adapters and the base model, in one step of 960
    rows: the runner groups the rows by adapter and each runs through its own slot only."""
    long = [[(7 * i + 3 * j) % 300 + 10 for j in range(60)] for i in range(4)]
    loras: list[LoRARequest | None] = [*family[1], None]
    batch = [(p, lora) for p in long for lora in loras]
    got = _tokens(llm.generate([p for p, _ in batch], GREEDY, lora_request=[lora for _, lora in batch],
                               use_tqdm=False))
    want = {None if lora is None else lora.lora_name:
            peft_greedy(family[0], None if lora is None else Path(lora.lora_path), long, NEW_TOKENS) for lora in loras}
    assert got == [want[None if lora is None else lora.lora_name][long.index(p)] for p, lora in batch]


def test_the_base_model_is_untouched_after_adapters_ran(llm: LLM, references: dict[str | None, list[list[int]]]
                                                        ) -> None:
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == references[None]


def test_prefix_cache_blocks_are_the_adapters_own(llm: LLM, family: tuple[Path, list[LoRARequest]],
                                                  references: dict[str | None, list[list[int]]]) -> None:
    long = list(range(100, 135))  # a prompt no other test ran: two full blocks of 16 to cache
    lora = family[1][0]
    base_first = llm.generate([long], GREEDY, use_tqdm=False)[0]
    adapted = llm.generate([long], GREEDY, lora_request=lora, use_tqdm=False)[0]
    again = llm.generate([long], GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert adapted.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert again.num_cached_tokens == 32
    want = peft_greedy(family[0], Path(lora.lora_path), [long], NEW_TOKENS)[0]
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == want != base_first.outputs[0].token_ids


def test_more_adapters_than_slots_take_turns(family: tuple[Path, list[LoRARequest]],
                                             references: dict[str | None, list[list[int]]]) -> None:
    """One slot and one adapter kept loaded: a mixed batch runs adapter by adapter (the scheduler
    admits one adapter at a time), each read again from disk when its turn comes."""
    one = LLM(model=str(family[0]), dtype="float32", num_threads=1, enable_lora=True, max_loras=1, max_lora_rank=8)
    loras: list[LoRARequest | None] = [*family[1], None, *family[1]]
    got = _tokens(one.generate([PROMPTS[0]] * len(loras), GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [references[None if lora is None else lora.lora_name][0] for lora in loras]


def test_an_adapter_that_does_not_fit_is_refused_before_anything_runs(
        llm: LLM, family: tuple[Path, list[LoRARequest]], tmp_path: Path) -> None:
    model = family[0]
    big = make_adapter(model, tmp_path / "big", rank=16)
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("big", 9, str(big)), use_tqdm=False)
    with pytest.raises(ValueError, match="no LoRA adapter at"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("gone", 10, str(tmp_path / "gone")), use_tqdm=False)
    base = LLM(model=str(model), dtype="float32", num_threads=1)
    with pytest.raises(ValueError, match="--enable-lora"):
        base.generate(PROMPTS, GREEDY, lora_request=family[1][0], use_tqdm=False)


def test_tensor_parallel_ranks_hold_their_shards_of_each_adapter(
        family: tuple[Path, list[LoRARequest]], references: dict[str | None, list[list[int]]]) -> None:
    """Two ranks (mp workers): q/k/v and gate/up take their rows of B, o and down their columns of A;
    the deltas of the row-parallel layers sum in the all-reduce."""
    tp = LLM(model=str(family[0]), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=3,
             max_lora_rank=8)
    loras: list[LoRARequest | None] = [*family[1], None]
    batch = [(prompt, lora) for prompt in PROMPTS[:2] for lora in loras]
    got = _tokens(tp.generate([p for p, _ in batch], GREEDY, lora_request=[lora for _, lora in batch], use_tqdm=False))
    tp.shutdown()
    assert got == [references[None if lora is None else lora.lora_name][PROMPTS.index(p)] for p, lora in batch]


def test_adapters_verify_speculative_drafts_with_their_own_weights(
        family: tuple[Path, list[LoRARequest]], references: dict[str | None, list[list[int]]]) -> None:
    """n-gram drafts verified in an adapter's rows (drafts are rows of the step like any other)."""
    spec = LLM(model=str(family[0]), dtype="float32", num_threads=1, enable_lora=True, max_loras=3, max_lora_rank=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "disable_by_batch_size": 64})
    loras: list[LoRARequest | None] = [*family[1], None]
    batch = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    got = _tokens(spec.generate([p for p, _ in batch], GREEDY, lora_request=[lora for _, lora in batch],
                                use_tqdm=False))
    stats = spec.engine_core.scheduler.speculation
    assert stats is not None and stats.stats().num_draft_tokens > 0
    assert got == [references[None if lora is None else lora.lora_name][PROMPTS.index(p)] for p, lora in batch]
