"""Finds tool-call parsers through the ``cadence.tool_parsers`` entry-point group."""

from __future__ import annotations

from cadence.api.tool_parsers.base import ToolParser
from cadence.plugins import installed_plugins, load_plugin_class

GROUP = "cadence.tool_parsers"


def installed_tool_parsers() -> list[str]:
    """Names of every tool parser registered in the ``cadence.tool_parsers`` group, sorted."""
    return installed_plugins(GROUP)


def load_tool_parser(name: str) -> ToolParser:
    """Instantiate the tool parser registered as ``name``; unknown names list what is installed."""
    return load_plugin_class(GROUP, name, ToolParser, "tool parser", "tool parsers")()  # type: ignore[type-abstract]
