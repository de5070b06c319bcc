"""Plugins: classes that packages register by name in an entry-point group (scheduling policies,
tool-call and reasoning parsers), found and checked the same way for each."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TypeVar

T = TypeVar("T")


def installed_plugins(group: str) -> list[str]:
    """Names of every plugin registered in ``group``, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)})


def load_plugin_class(group: str, name: str, base: type[T], kind: str, kinds: str) -> type[T]:
    """The class registered as ``name`` in ``group``, a subclass of ``base``. (An abstract ``base``
    needs ``# type: ignore[type-abstract]`` where it is passed: mypy's issue 4717.)

    :raises ValueError: for a name not installed (the message lists the installed ``kinds``), or a
        plugin that fails to import (named, with the cause).
    :raises TypeError: the entry point names something that is not a subclass of ``base``.
    """
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        raise ValueError(f"unknown {kind} {name!r}; installed {kinds}: {', '.join(installed_plugins(group)) or 'none'}")
    try:
        cls = matches[0].load()
    except Exception as exc:  # a broken plugin: say which one, keep the cause
        raise ValueError(f"{kind} {name!r} ({matches[0].value}) failed to import: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"entry point {name!r} in {group} must name a {base.__name__} subclass, got {cls!r}")
    return cls
