"""Finds attention backends through the entry-point group ``cadence.attention_backends``.

Built-in backends register there exactly as a third-party package would; a backend's module (and
so its optional dependency, e.g. triton or flash_attn) is imported only when it is chosen.
"""

from __future__ import annotations

import importlib.util
import logging
from importlib.metadata import EntryPoint, entry_points

import torch

from cadence.backends.base import AttentionBackend

GROUP = "cadence.attention_backends"

logger = logging.getLogger(__name__)


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available_backends() -> list[str]:
    """Names of the installed backends, sorted."""
    return sorted(_entry_points())


def load_backend(name: str | None, device: torch.device, dtype: torch.dtype | None = None,
                 head_dim: int | None = None, block_size: int | None = None) -> type[AttentionBackend]:
    """The backend class called ``name``, or the best installed one for ``device`` when ``None``.

    Given the model's ``dtype``, ``head_dim`` and KV ``block_size``, the backend's ``check_model``
    runs too, and the automatic choice skips a backend that cannot serve them (FlashAttention under
    float32, say) for the next one.

    :raises ValueError: no backend of that name is installed, or it cannot serve this model.
    :raises RuntimeError: the backend cannot run on ``device`` (from its ``check_device``).
    """
    installed = _entry_points()
    if name is not None:
        return _load(name, installed, device, dtype, head_dim, block_size)
    for candidate in _auto_candidates(device, installed):
        try:
            return _load(candidate, installed, device, dtype, head_dim, block_size)
        except (RuntimeError, ValueError) as exc:
            logger.info("attention backend %s skipped: %s", candidate, exc)
    return _load("sdpa", installed, device, dtype, head_dim, block_size)


def _load(name: str, installed: dict[str, EntryPoint], device: torch.device, dtype: torch.dtype | None,
          head_dim: int | None, block_size: int | None) -> type[AttentionBackend]:
    if name not in installed:
        raise ValueError(f"unknown attention backend {name!r}; installed: {', '.join(sorted(installed))}")
    cls = installed[name].load()
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"entry point {name!r} in {GROUP} is {cls!r}, not an AttentionBackend subclass")
    cls.check_device(device)
    if dtype is not None and head_dim is not None and block_size is not None:
        cls.check_model(dtype, head_dim, block_size)
    return cls


def _auto_candidates(device: torch.device, installed: dict[str, EntryPoint]) -> list[str]:
    """FlashAttention on CUDA when importable, else Triton on CUDA; SDPA (the reference) last."""
    candidates = []
    if device.type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            candidates.append("flash_attn")
        candidates.append("triton")
    return [c for c in candidates if c in installed]
