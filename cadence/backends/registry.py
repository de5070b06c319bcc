"""Finds attention backends through the entry-point group ``cadence.attention_backends``.

Built-in backends register there exactly as a third-party package would; a backend's module (and
so its optional dependency, e.g. triton or flash_attn) is imported only when it is chosen.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import EntryPoint, entry_points

import torch

from cadence.backends.base import AttentionBackend

GROUP = "cadence.attention_backends"


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available_backends() -> list[str]:
    """Names of the installed backends, sorted."""
    return sorted(_entry_points())


def load_backend(name: str | None, device: torch.device) -> type[AttentionBackend]:
    """The backend class called ``name``, or the best installed one for ``device`` when ``None``.

    :raises ValueError: no backend of that name is installed.
    :raises RuntimeError: the backend cannot run on ``device`` (from its ``check_device``).
    """
    installed = _entry_points()
    if name is None:
        name = _auto_choice(device, installed)
    if name not in installed:
        raise ValueError(f"unknown attention backend {name!r}; installed: {', '.join(sorted(installed))}")
    cls = installed[name].load()
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"entry point {name!r} in {GROUP} is {cls!r}, not an AttentionBackend subclass")
    cls.check_device(device)
    return cls


def _auto_choice(device: torch.device, installed: dict[str, EntryPoint]) -> str:
    """FlashAttention on CUDA when importable, else Triton on CUDA, else SDPA (the reference)."""
    candidates = []
    if device.type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            candidates.append("flash_attn")
        candidates.append("triton")
    return next((c for c in candidates if c in installed), "sdpa")
