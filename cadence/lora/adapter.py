"""A PEFT LoRA adapter on disk: its config checked against the model, and its weights read.

A PEFT adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose tensors
are named ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``; the module's output gains ``scaling * B @ A @ x``, with ``scaling = lora_alpha / r``
(rsLoRA: ``lora_alpha / sqrt(r)``; ``alpha_pattern`` and ``rank_pattern`` may set both per module).

cadence adapts the decoder layers' seven projections (q/k/v/o, gate/up/down: docs/lora.md). An
adapter that needs anything else (embeddings, the LM head, ``modules_to_save``, DoRA, biases) is
refused when it is registered or first requested, with the reason; the engine core checks again and
answers such a request with an error, so no worker ever fails to read one.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from cadence.models.layers import head_dim_of

# The projections an adapter may target, by the module's last name.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<kind>[a-z_]+))\.lora_(?P<ab>[AB])\.weight")


class AdapterError(ValueError):
    """An adapter cadence cannot serve; the message says why."""


@dataclass(frozen=True)
class AdapterLimits:
    """What an adapter is checked against: the model's projection shapes ``(in, out)`` by target
    name, its layer count, and the highest rank served (``--max-lora-rank``)."""

    shapes: tuple[tuple[str, tuple[int, int]], ...]  # a tuple, so that the limits hash (the check's cache key)
    num_layers: int
    max_rank: int

    @classmethod
    def of(cls, hf_config: PretrainedConfig, max_rank: int) -> AdapterLimits:
        hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
        q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
        inter = hf_config.intermediate_size
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        if any(getattr(hf_config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            for kind in ("gate_proj", "up_proj", "down_proj"):  # a mixture of experts' MLPs are not adapted
                del shapes[kind]
        return cls(tuple(shapes.items()), hf_config.num_hidden_layers, max_rank)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted module's ``A`` ``[r, in]`` and ``B`` ``[out, r]``, the scaling folded into ``B``."""

    a: torch.Tensor
    b: torch.Tensor


def check_adapter(path: str, limits: AdapterLimits) -> None:
    """Check that the adapter at ``path`` fits the model and the rank limit, reading only its
    config and tensor headers (cached per folder and modification time).

    :raises AdapterError: saying what does not fit.
    """
    folder = Path(path)
    try:
        stamp = (folder / WEIGHTS_FILE).stat().st_mtime_ns, (folder / CONFIG_FILE).stat().st_mtime_ns
    except OSError as exc:
        raise AdapterError(f"no LoRA adapter at {path!r}: {exc.strerror} ({Path(exc.filename or path).name})") from None
    _check_cached(str(folder.resolve()), stamp, limits)


@functools.lru_cache(maxsize=256)
def _check_cached(path: str, stamp: tuple[int, int], limits: AdapterLimits) -> None:
    _read_config(Path(path))
    with safe_open(Path(path) / WEIGHTS_FILE, framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    targets = dict(limits.shapes)
    for module, (a_shape, b_shape) in _pairs(shapes).items():
        match = _KEY.fullmatch(module + ".lora_A.weight")
        assert match is not None  # _pairs keeps only names it matched
        kind, layer = match["kind"], int(match["layer"])
        if layer >= limits.num_layers:
            raise AdapterError(f"{module}: the model has {limits.num_layers} layers")
        if kind not in targets:
            raise AdapterError(f"{module}: cadence adapts no {kind} of this model (its MLPs are a mixture of experts)")
        rank, (fan_in, fan_out) = a_shape[0], targets[kind]
        if a_shape != (rank, fan_in) or b_shape != (fan_out, rank):
            raise AdapterError(f"{module}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not fit a "
                               f"[{fan_out}, {fan_in}] projection (is the adapter for another model?)")
        if rank > limits.max_rank:
            raise AdapterError(f"{module} has rank {rank}, above --max-lora-rank {limits.max_rank}")


def load_adapter(path: str) -> dict[str, LoRAWeights]:
    """The adapter's weights by module name (``model.layers.3.self_attn.q_proj``), fp32, scaled.

    :raises AdapterError: for an adapter :func:`check_adapter` would refuse as malformed.
    """
    folder = Path(path)
    config = _read_config(folder)
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    _pairs({key: tuple(t.shape) for key, t in tensors.items()})  # every tensor is one of a pair
    weights = {}
    for key, a in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match["ab"] != "A":
            continue
        module = match["module"]
        b = tensors[key[:-len("lora_A.weight")] + "lora_B.weight"]
        rank = a.shape[0]
        weights[module] = LoRAWeights(a.float(), b.float() * _scaling(config, module, rank))
    return weights


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {folder / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "fan_in_fan_out": "fan_in_fan_out",
               "trainable_token_indices": "trainable tokens", "lora_bias": "lora_bias"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{folder}: {what} is not supported (docs/lora.md)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias {config['bias']!r} is not supported, only 'none'")
    return config


def _pairs(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``module -> (A shape, B shape)``; every tensor must be a known module's A or B, each with its mate."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _KEY.fullmatch(key)
        if match is None or match["kind"] not in TARGETS:
            raise AdapterError(f"the adapter adapts {key!r}; cadence adapts the decoder layers' "
                               f"{', '.join(TARGETS)} only (docs/lora.md)")
        found.setdefault(match["module"], {})[match["ab"]] = shape
    if not found:
        raise AdapterError("the adapter has no LoRA weights")
    lonely = [module for module, ab in found.items() if len(ab) != 2]
    if lonely:
        raise AdapterError(f"{lonely[0]} has only one of lora_A and lora_B")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


def _scaling(config: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of ``module``: its ``alpha_pattern`` entry or ``lora_alpha``, over its rank
    (rsLoRA: over the rank's square root)."""
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value of the first pattern matching the end of ``module``'s name, as PEFT matches them."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
