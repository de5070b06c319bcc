"""Markup in a stream of generated text: how much of a text's end may still become a marker, the
text a streaming parser holds back (the tool-call and reasoning parsers share it)."""

from __future__ import annotations


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (0 for none)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
