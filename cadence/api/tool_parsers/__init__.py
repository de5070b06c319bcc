"""Tool-call parsers: the function calls in a model's output, split from its content
(docs/tools_and_reasoning.md).

``base`` (the contract) · ``markup_stream`` (the buffer, marker hold-back and deltas every stream
shares) · ``json_call`` (calls written as JSON objects) · ``hermes``, ``llama3_json``, ``mistral``,
``pythonic`` (the formats) · ``loader`` (finding a parser by name through its entry point).
"""

from cadence.api.tool_parsers.base import (
    FunctionCall,
    ParsedMessage,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    collect,
)
from cadence.api.tool_parsers.loader import installed_tool_parsers, load_tool_parser

__all__ = ["FunctionCall", "ParsedMessage", "StreamDelta", "ToolCallDelta", "ToolCallStream", "ToolParser",
           "collect", "installed_tool_parsers", "load_tool_parser"]
