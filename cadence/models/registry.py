"""Which model class runs a Hugging Face architecture: the entry-point group ``cadence.models``.

Each entry maps an architecture name, as a checkpoint's ``config.json`` lists it in
``architectures`` (``Qwen3ForCausalLM`` ...), to a class implementing :class:`CausalLM`. cadence's
own families register themselves in that group exactly as a third-party package does
(``docs/models.md``), so adding an architecture never needs a fork.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points

import torch
from torch import nn
from transformers import PretrainedConfig

from cadence.backends.base import AttentionBackend
from cadence.config import ConfigError
from cadence.distributed.layers import CheckpointTensor

GROUP = "cadence.models"


class CausalLM(nn.Module, abc.ABC):
    """The base of every model class: what the worker needs of a model (see ``docs/models.md``).

    Constructed as ``cls(hf_config, backend_cls, dtype, device, group)``: this rank's shard of the
    model (``group``, a :class:`~cadence.distributed.ParallelGroup`), parameters uninitialised until
    :meth:`load_weights`. A subclass sets ``num_kv_heads`` (this rank's), ``head_dim``,
    ``num_layers`` and ``attn_backend``, the backend object its layers call (the worker builds its
    metadata once per step).
    """

    num_kv_heads: int
    head_dim: int
    num_layers: int
    attn_backend: AttentionBackend

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: Sequence[object],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Run the step's ``T`` tokens (``input_ids``, ``positions``: ``[T]`` int64), reading and
        writing K/V through the backend, layer ``i`` with ``kv_caches[i]`` and ``attn_metadata[i]``
        (its KV cache group's); fp32 logits ``[len(logits_indices), vocab]``."""

    def prepare_fast_path(self) -> None:
        """Called by the loader once the weights are final (loaded, then packed or quantized), unless
        ``--enforce-eager``: a model may build a faster way to run its layers than op by op from
        Python (Llama's and Gemma's C++ decoder stack). Nothing by default."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy Hugging Face-named tensors (this rank's shard of each) into the parameters.

        :raises ValueError: a name the model does not have, a shape that does not fit, or a
            parameter the weights never provided.
        """


def installed_architectures() -> dict[str, EntryPoint]:
    """Every architecture an installed package registers, by name."""
    return _installed()


@functools.cache
def _installed() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def architectures_of(hf_config: PretrainedConfig) -> list[str]:
    """The config's ``architectures``, or, where it names none, its ``model_type``'s causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = list(getattr(hf_config, "architectures", None) or [])
    if named:
        return named
    fallback = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None) or "")
    return [fallback] if fallback else []


def check_supported(architectures: list[str], what: str) -> str:
    """The first of ``architectures`` that an installed package runs.

    Called where a model is chosen (``EngineArgs.create_config``, and for a GGUF file before it is
    converted), so that nothing is converted, spawned or loaded for a model cadence cannot run.

    :raises ConfigError: naming ``what`` (the checkpoint) and its architectures, the ones installed,
        and how to add one.
    """
    installed = installed_architectures()
    for name in architectures:
        if name in installed:
            return name
    named = ", ".join(architectures) or "no architecture"
    raise ConfigError(f"{what} is {named}, which cadence does not run; installed architectures: "
                      f"{', '.join(sorted(installed))}. A package can add one: see docs/models.md "
                      f"(a model class in the {GROUP!r} entry-point group)")


def model_class_for(hf_config: PretrainedConfig) -> type[CausalLM]:
    """The class registered for the config's architecture.

    :raises ConfigError: the architecture is not one an installed package runs.
    """
    name = check_supported(architectures_of(hf_config), "the model's architecture")
    cls: type[CausalLM] = installed_architectures()[name].load()
    return cls
