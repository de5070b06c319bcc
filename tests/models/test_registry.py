"""The model registry (the ``cadence.models`` entry-point group) against docs/models.md, and the
refusal of an architecture no installed package runs, before any engine is built."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from support.tiny_models import tiny_config
from transformers import AutoConfig

from cadence import LLM
from cadence.config import ConfigError
from cadence.core.engine_core import EngineCore
from cadence.engine_args import EngineArgs
from cadence.models import loader
from cadence.models.registry import (
    CausalLM,
    architectures_of,
    check_supported,
    installed_architectures,
    model_class_for,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
# A row of the families table: | `Architecture` | `module:Class` | checkpoints |
_FAMILY_ROW = re.compile(r"^\| `(\w+)` \| `([\w.]+):(\w+)` \|", re.MULTILINE)


def documented_families() -> dict[str, str]:
    """The families table of docs/models.md: architecture -> ``module:Class``."""
    section = DOC.read_text().split("## Which families run", 1)[1].split("### GGUF files", 1)[0]
    rows = {arch: f"{module}:{cls}" for arch, module, cls in _FAMILY_ROW.findall(section)}
    assert rows, "docs/models.md has no families table under 'Which families run'"
    return rows


@pytest.mark.parametrize(("architecture", "target"), sorted(documented_families().items()))
def test_each_documented_family_is_installed_as_written(architecture: str, target: str) -> None:
    entry = installed_architectures().get(architecture)
    assert entry is not None, f"{architecture} is in docs/models.md but no installed package registers it"
    assert entry.value == target
    cls = entry.load()
    assert f"{cls.__module__}:{cls.__qualname__}" == target
    assert issubclass(cls, CausalLM)


def test_every_family_of_cadence_itself_is_documented() -> None:
    own = {name: ep.value for name, ep in installed_architectures().items() if ep.value.startswith("cadence.")}
    assert own == documented_families()


def test_every_installed_entry_point_loads_a_causal_lm() -> None:
    for name, entry in installed_architectures().items():
        cls = entry.load()
        assert isinstance(cls, type) and issubclass(cls, CausalLM), f"{name} -> {entry.value} is not a CausalLM"


def test_architectures_of_prefers_the_named_ones_then_the_model_type() -> None:
    assert architectures_of(tiny_config("qwen3", architectures=["Qwen3ForCausalLM", "Other"])) == [
        "Qwen3ForCausalLM", "Other"]
    assert architectures_of(tiny_config("qwen3", architectures=None)) == ["Qwen3ForCausalLM"]
    assert architectures_of(tiny_config("mixtral", architectures=[])) == ["MixtralForCausalLM"]
    assert architectures_of(AutoConfig.for_model("t5")) == []  # T5 has no causal LM


def test_model_class_for_a_config_without_architectures() -> None:
    from cadence.models.qwen3 import Qwen3ForCausalLM

    assert model_class_for(tiny_config("qwen3", architectures=None)) is Qwen3ForCausalLM


def test_check_supported_takes_the_first_installed_architecture() -> None:
    assert check_supported(["GPT2LMHeadModel", "MistralForCausalLM", "LlamaForCausalLM"], "x") == "MistralForCausalLM"
    with pytest.raises(ConfigError, match="x is no architecture, which cadence does not run"):
        check_supported([], "x")


@pytest.fixture
def engine_never_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Anything past the config check fails loudly and is recorded: building the engine core (which
    starts the workers), or loading a model or its tokenizer."""
    reached: list[str] = []

    def forbid(what: str) -> Callable[..., object]:
        def fail(*args: object, **kwargs: object) -> object:
            reached.append(what)
            raise AssertionError(f"{what} was reached for an unsupported architecture")
        return fail

    monkeypatch.setattr(EngineCore, "build", forbid("EngineCore.build"))
    monkeypatch.setattr(loader, "load_model", forbid("load_model"))
    monkeypatch.setattr("cadence.engine.llm.load_tokenizer", forbid("load_tokenizer"))
    return reached


def _gpt2_folder(folder: Path, **overrides: object) -> Path:
    tiny_config("gpt2", **overrides).save_pretrained(folder)
    return folder


def _assert_refusal(error: ConfigError, architecture: str) -> None:
    message = str(error)
    assert architecture in message
    assert "which cadence does not run" in message
    for installed in installed_architectures():
        assert installed in message
    assert "docs/models.md" in message


@pytest.mark.parametrize("overrides", [{}, {"architectures": None}], ids=["named", "by-model-type"])
def test_llm_refuses_an_unsupported_folder_before_building_the_engine(
        tmp_path: Path, engine_never_built: list[str], overrides: dict[str, object]) -> None:
    folder = _gpt2_folder(tmp_path, **overrides)
    assert json.loads((folder / "config.json").read_text()).get("architectures") in (["GPT2LMHeadModel"], None)
    with pytest.raises(ConfigError) as caught:
        LLM(model=str(folder), dtype="float32")
    _assert_refusal(caught.value, "GPT2LMHeadModel")
    assert str(folder) in str(caught.value)
    assert engine_never_built == []


def test_create_config_refuses_an_unknown_architecture_name(tmp_path: Path, engine_never_built: list[str]) -> None:
    config = tiny_config("llama", architectures=["NoSuchThingForCausalLM"])
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as caught:
        EngineArgs(model=str(tmp_path)).create_config()
    _assert_refusal(caught.value, "NoSuchThingForCausalLM")
    assert engine_never_built == []


def test_create_config_accepts_a_registered_architecture(make_tiny_model: Callable[..., Path]) -> None:
    """The check lets a registered architecture through (here with the tiny Llama's weights, which
    no one loads: create_config reads config.json only)."""
    folder = make_tiny_model("llama")
    config = EngineArgs(model=str(folder)).create_config()
    assert config.model.path == str(folder)
