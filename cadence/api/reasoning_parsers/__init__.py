"""Reasoning parsers: a model's output split into reasoning and content (docs/tools_and_reasoning.md).

``base`` (the contract) · ``think`` (the ``<think>`` ... ``</think>`` parsers: ``qwen3``,
``deepseek_r1``) · ``loader`` (finding a parser by name through its entry point).
"""

from cadence.api.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningSplit, ReasoningStream
from cadence.api.reasoning_parsers.loader import installed_reasoning_parsers, load_reasoning_parser

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningSplit", "ReasoningStream",
           "installed_reasoning_parsers", "load_reasoning_parser"]
