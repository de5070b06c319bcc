"""Expert weights load from either checkpoint layout (one tensor per expert and projection, as
checkpoints on disk hold them, or transformers 5's stacked ``experts.gate_up_proj`` /
``experts.down_proj``, as its modules hold them) into the same parameters, on every tensor-parallel
rank; and a checkpoint sharded over several safetensors files loads whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.reference import greedy, hf_greedy, random_prompts
from support.tiny_models import TINY_VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from cadence import LLM
from cadence.backends.sdpa_backend import SDPABackend
from cadence.distributed.group import ParallelGroup
from cadence.models.registry import CausalLM, model_class_for

MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def _build(config: object, rank: int, world_size: int) -> CausalLM:
    group = ParallelGroup(rank=rank, world_size=world_size)
    return model_class_for(config)(config, SDPABackend, torch.float32, "cpu", group)


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_stacked_and_per_expert_checkpoints_load_alike(make_tiny_model: Callable[..., Path], arch: str, rank: int,
                                                        world_size: int) -> None:
    folder = make_tiny_model(arch, **MOE_CONFIGS[arch])
    config = tiny_config(arch, **MOE_CONFIGS[arch])
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        on_disk = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    assert any(".experts.0." in name for name in on_disk)  # one tensor per expert
    stacked = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)

    per_expert_model, stacked_model = _build(config, rank, world_size), _build(config, rank, world_size)
    per_expert_model.load_weights(on_disk.items())
    stacked_model.load_weights(stacked.items())
    ours = dict(per_expert_model.named_parameters())
    assert ours.keys() == dict(stacked_model.named_parameters()).keys()
    for name, param in stacked_model.named_parameters():
        torch.testing.assert_close(param, ours[name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_sharded_over_files_loads_whole(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    source = make_tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    prompts = random_prompts(4, 4, TINY_VOCAB, (5, 40))
    llm = LLM(model=str(tmp_path), dtype="float32")
    assert greedy(llm, prompts, 8) == hf_greedy(source, prompts, 8)

