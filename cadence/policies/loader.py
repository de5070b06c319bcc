"""Finds scheduling policies through the ``cadence.policies`` entry-point group."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points

from cadence.policies.base import PolicyContext, SchedulingPolicy

GROUP = "cadence.policies"


def installed_policies() -> list[str]:
    """Names of every policy registered in the ``cadence.policies`` group, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load_policy(name: str, context: PolicyContext, options: Mapping[str, str] | None = None) -> SchedulingPolicy:
    """Instantiate the policy registered as ``name``; unknown names list what is installed."""
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        raise ValueError(f"unknown scheduling policy {name!r}; installed policies: "
                         f"{', '.join(installed_policies()) or 'none'}")
    try:
        cls = matches[0].load()
    except Exception as exc:  # a broken plugin: say which one, keep the cause
        raise ValueError(f"scheduling policy {name!r} ({matches[0].value}) failed to import: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        raise TypeError(f"entry point {name!r} in {GROUP} must name a SchedulingPolicy subclass, got {cls!r}")
    return cls(context, options)
