"""A stand-in request for exercising the KV allocator without a scheduler (tests and property tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FakeRequest:
    """What the allocator reads of a request: its id, tokens, how many are computed, and what keys
    its blocks apart (its LoRA adapter's salt)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
