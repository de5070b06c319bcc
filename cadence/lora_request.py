"""Which LoRA adapter a request runs with (docs/lora.md), as vLLM's ``LoRARequest`` names it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``) by name.

    ``lora_int_id`` (>= 1) identifies the weights: workers keep loaded adapters by it, and the
    prefix cache keys a request's blocks by it and the name, so two adapters never share KV blocks.
    Give different weights different ids (the server numbers the adapters it loads itself).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> str:
        """What keys the adapter's prefix-cache blocks apart from the base model's and other adapters'."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
