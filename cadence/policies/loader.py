"""Finds scheduling policies through the ``cadence.policies`` entry-point group."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

from cadence.plugins import installed_plugins, load_plugin_class
from cadence.policies.base import PolicyContext, SchedulingPolicy

GROUP = "cadence.policies"


def installed_policies() -> list[str]:
    """Names of every policy registered in the ``cadence.policies`` group, sorted."""
    return installed_plugins(GROUP)


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The class registered as ``name``; unknown names list what is installed."""
    return load_plugin_class(GROUP, name, SchedulingPolicy,  # type: ignore[type-abstract]
                             "scheduling policy", "policies")


def load_policy(name: str, context: PolicyContext, options: Mapping[str, str] | None = None) -> SchedulingPolicy:
    """Instantiate the policy registered as ``name``; unknown names list what is installed."""
    return policy_class(name)(context, options)


@dataclass(frozen=True)
class PolicyInfo:
    """What ``cadence policies list`` shows of one installed policy."""

    name: str
    target: str  # module:Class, or "" when it failed to load
    summary: str  # the class docstring's first paragraph
    options: dict[str, str] = field(default_factory=dict)  # option -> what it does
    error: str | None = None  # why it failed to load


def describe_policies() -> list[PolicyInfo]:
    """Every installed policy with its options, by name; one that fails to load says why."""
    infos = []
    for name in installed_policies():
        try:
            cls = policy_class(name)
        except (ValueError, TypeError) as exc:
            infos.append(PolicyInfo(name, "", "", error=str(exc)))
            continue
        options = cls.accepted_options()
        # A plugin written against the older contract lists bare names.
        described = dict(options) if isinstance(options, Mapping) else dict.fromkeys(options, "")
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        infos.append(PolicyInfo(name, f"{cls.__module__}:{cls.__qualname__}", summary, described))
    return infos
