"""The worker's adapter slots (``cadence/lora/manager.py``): which slot each step's adapters take,
which adapters stay loaded, and what a step may not ask for."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.lora_adapters import make_adapter

from cadence.backends.sdpa_backend import SDPABackend
from cadence.config import LoRAConfig
from cadence.lora.adapter import AdapterError, load_adapter
from cadence.lora.manager import LoRAManager
from cadence.lora_request import LoRARequest
from cadence.models.llama import LlamaForCausalLM
from cadence.models.loader import load_hf_config

QKV = "model.layers.1.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def setup(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Path, list[LoRARequest]]:
    model = make_tiny_model("llama")
    folder = tmp_path_factory.mktemp("manager-adapters")
    return model, [LoRARequest(name, i + 1, str(make_adapter(model, folder / name, rank=4, seed=i)))
                   for i, name in enumerate("abc")]


def _manager(model: Path, max_loras: int, max_cpu_loras: int | None = None) -> LoRAManager:
    llama = LlamaForCausalLM(load_hf_config(str(model)), SDPABackend, torch.float32)
    return LoRAManager(llama, LoRAConfig(max_loras, 4, max_cpu_loras), torch.float32, torch.device("cpu"))


def _q_a(manager: LoRAManager, slot: int) -> torch.Tensor:
    """Slot ``slot``'s A of layer 1's q projection."""
    slots = manager.layers[QKV][1]
    return slots.a[slot * slots.width:slot * slots.width + 4]


def test_an_adapter_takes_the_slot_least_recently_used_by_one_the_step_does_not_need(
        setup: tuple[Path, list[LoRARequest]]) -> None:
    model, (a, b, c) = setup
    manager = _manager(model, max_loras=2, max_cpu_loras=3)
    manager.prepare([a, None, b], np.array([1, 1, 1]))
    manager.prepare([b], np.array([1]))  # a's slot is now the one used least recently
    manager.prepare([c, b], np.array([2, 1]))
    want = load_adapter(c.lora_path)["model.layers.1.self_attn.q_proj"].a
    assert torch.equal(_q_a(manager, 0), want)  # c took a's slot 0, b kept slot 1
    assert manager.layers[QKV][1].batch.mask(3) is not None
    with pytest.raises(RuntimeError, match="above --max-loras 2"):
        manager.prepare([a, b, c], np.array([1, 1, 1]))
    manager.prepare([None], np.array([4]))
    assert manager.layers[QKV][1].batch.mask(3) is None  # a step without adapters adds nothing


def test_only_max_cpu_loras_adapters_stay_loaded(setup: tuple[Path, list[LoRARequest]], tmp_path: Path) -> None:
    model, (a, b, _) = setup
    copies = [LoRARequest(lora.lora_name, lora.lora_int_id, shutil.copytree(lora.lora_path, tmp_path / lora.lora_name))
              for lora in (a, b)]
    manager = _manager(model, max_loras=1, max_cpu_loras=1)
    manager.prepare([copies[0]], np.array([1]))
    manager.prepare([copies[1]], np.array([1]))  # takes the one slot and the one place in memory
    shutil.rmtree(copies[0].lora_path)
    with pytest.raises(AdapterError):  # no longer kept: read from disk again, and it is gone
        manager.prepare([copies[0]], np.array([1]))
    shutil.rmtree(copies[1].lora_path)
    manager.prepare([copies[1]], np.array([1]))  # still in its slot: nothing to read
