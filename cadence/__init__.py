"""cadence: an LLM inference serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cadence.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from cadence.lora_request import LoRARequest
from cadence.messages import CompletionOutput, RequestOutput
from cadence.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cadence.engine.admission import TextPrompt, TokensPrompt
    from cadence.engine.async_engine import AsyncEngine
    from cadence.engine.llm import LLM

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineDeadError", "EngineOverloadedError",
           "InvalidRequestError", "LoRARequest", "RequestOutput", "SamplingParams", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Both pull in torch and transformers; import them only when asked for.
    if name == "LLM":
        from cadence.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from cadence.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name in ("TextPrompt", "TokensPrompt"):  # vLLM's prompt dicts, for LLM.generate
        from cadence.engine import admission
        return getattr(admission, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
