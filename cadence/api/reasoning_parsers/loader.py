"""Finds reasoning parsers through the ``cadence.reasoning_parsers`` entry-point group."""

from __future__ import annotations

from cadence.api.reasoning_parsers.base import ReasoningParser
from cadence.plugins import installed_plugins, load_plugin_class

GROUP = "cadence.reasoning_parsers"


def installed_reasoning_parsers() -> list[str]:
    """Names of every reasoning parser registered in the ``cadence.reasoning_parsers`` group, sorted."""
    return installed_plugins(GROUP)


def load_reasoning_parser(name: str) -> ReasoningParser:
    """Instantiate the reasoning parser registered as ``name``; unknown names list what is installed."""
    return load_plugin_class(GROUP, name, ReasoningParser,  # type: ignore[type-abstract]
                             "reasoning parser", "reasoning parsers")()
