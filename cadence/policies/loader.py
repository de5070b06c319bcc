"""Finds scheduling policies through the ``cadence.policies`` entry-point group."""

from __future__ import annotations

from collections.abc import Mapping

from cadence.plugins import installed_plugins, load_plugin_class
from cadence.policies.base import PolicyContext, SchedulingPolicy

GROUP = "cadence.policies"


def installed_policies() -> list[str]:
    """Names of every policy registered in the ``cadence.policies`` group, sorted."""
    return installed_plugins(GROUP)


def load_policy(name: str, context: PolicyContext, options: Mapping[str, str] | None = None) -> SchedulingPolicy:
    """Instantiate the policy registered as ``name``; unknown names list what is installed."""
    return load_plugin_class(GROUP, name, SchedulingPolicy,  # type: ignore[type-abstract]
                             "scheduling policy", "policies")(context, options)
