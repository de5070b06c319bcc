"""The draft-model proposer on a tiny random Llama: its drafts are the model's greedy continuation
(transformers'), whatever KV it kept from earlier proposals; its pool gives the blocks of the least
recently drafted requests to new ones, and a request that cannot fit drafts nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cadence.config import ConfigError, ModelConfig
from cadence.executor.draft_model import DraftModelProposer, load_draft_model
from cadence.models.truncation import truncate_model


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> str:
    return str(make_tiny_model("llama"))


def proposer(folder: str, num_blocks: int = 64, k: int = 4, max_model_len: int = 512) -> DraftModelProposer:
    return load_draft_model(ModelConfig(path=folder, dtype="float32", max_model_len=max_model_len), None,
                            torch.device("cpu"), num_blocks, 16, k)


def greedy(folder: str, tokens: list[int], count: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens):]


def test_drafts_are_the_greedy_continuation_whatever_was_kept(folder: str) -> None:
    prompt = [5, 6, 7, 8, 9, 200, 13]
    truth = greedy(folder, prompt, 12)
    draft = proposer(folder)
    assert draft.propose([("a", prompt, 4)]) == [truth[:4]]
    # Two drafts accepted, then the target's own token (not the third draft): the KV of the accepted
    # positions is kept, the rejected one's recomputed.
    wrong = (truth[2] + 1) % 320
    seq = [*prompt, *truth[:2], wrong]
    assert draft.propose([("a", seq, 2)]) == [greedy(folder, seq, 2)]  # as many as asked
    assert draft.seqs["a"].num_confirmed == len(seq)
    # Another request with the right tokens, batched with the first.
    assert draft.propose([("b", [*prompt, *truth[:5]], 4), ("a", [*seq, 1], 9)]) == [truth[5:9],
                                                                                   greedy(folder, [*seq, 1], 4)]


def test_the_pool_takes_back_the_least_recently_drafted(folder: str) -> None:
    # 4 blocks of 16 (one is the null block): a 20-token request with 3 more drafted positions takes 2.
    draft = proposer(folder, num_blocks=4)
    prompts = {name: [3 + i + j for j in range(20)] for i, name in enumerate("abc")}
    assert draft.propose([("a", prompts["a"], 4)])[0]
    assert draft.num_free_blocks == 1
    assert draft.propose([("b", prompts["b"], 4)]) == [greedy(folder, prompts["b"], 4)]  # "a" gave its blocks
    assert list(draft.seqs) == ["b"]
    # Two that together need more than the pool: the second drafts nothing, the first keeps its KV.
    assert draft.propose([("b", prompts["b"], 4), ("c", prompts["c"], 4)])[1] == []
    draft.forget(["b", "c", "unknown"])
    assert draft.num_free_blocks == 3 and not draft.seqs


def test_drafts_stop_at_max_model_len(folder: str) -> None:
    draft = proposer(folder, max_model_len=30)
    assert len(draft.propose([("a", list(range(3, 31)), 4)])[0]) == 2
    assert draft.propose([("b", list(range(3, 33)), 4)]) == [[]]


def test_truncation_keeps_the_first_layers(folder: str, tmp_path: Path) -> None:
    copy = truncate_model(folder, tmp_path / "one", 1)
    assert json.loads((copy / "config.json").read_text())["num_hidden_layers"] == 1
    assert not [name for name in load_file(copy / "model.safetensors") if ".layers.1." in name]
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32)(tokens).logits
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, num_hidden_layers=1)(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (copy / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="between 1 and the model's 2 layers"):
        truncate_model(folder, tmp_path / "three", 3)


def test_truncation_cuts_layer_types(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    folder = make_tiny_model("qwen3", layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                             use_sliding_window=True)
    copy = truncate_model(folder, tmp_path / "one", 1)
    assert json.loads((copy / "config.json").read_text())["layer_types"] == ["sliding_attention"]
