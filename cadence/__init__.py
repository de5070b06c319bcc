"""cadence: an LLM inference serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cadence.messages import CompletionOutput, RequestOutput
from cadence.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cadence.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from cadence.llm import LLM
        return LLM
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
