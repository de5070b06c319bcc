"""The data-parallel router contract: which engine core serves a new request.

With ``--data-parallel-size N`` the front end asks a router, once per request, for the rank of the
engine core to send it to, given each core's load (the requests pending there) and the prompt. A
router is a plugin: a subclass registered in the ``cadence.routers`` entry-point group, chosen with
``--router NAME`` (``docs/distributed.md``). A router that wants to know what each engine's prefix
cache holds says so (:attr:`Router.observes_prefix_caches`) and is told every change (``apply``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from cadence.config import check_hash_algo
from cadence.messages import KVCacheDelta
from cadence.plugins import installed_plugins, load_plugin_class

GROUP = "cadence.routers"


@dataclass(frozen=True)
class RouterContext:
    """What a router may take into account besides the loads and the prompt."""

    num_engines: int
    block_size: int  # the KV cache's, for routers that hash prompt blocks as the engines do
    prefix_caching: bool  # the engines keep a prefix cache
    seed: int = 0  # for routers that draw at random
    hash_algo: str = "sha256"  # the engines' prefix-cache keys (cadence/core/block_hash.py)

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {self.num_engines}")
        check_hash_algo(self.hash_algo)


class Router(abc.ABC):
    """Base class of every router; subclasses are registered in ``cadence.routers`` entry points."""

    name: ClassVar[str]

    def __init__(self, context: RouterContext) -> None:
        self.context = context

    @abc.abstractmethod
    def choose(self, loads: Sequence[float], prompt_token_ids: Sequence[int]) -> int:
        """The rank of the engine for a request with this prompt, given each engine's load."""

    def choose_salted(self, loads: Sequence[float], prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        """:meth:`choose` for a request whose prefix-cache blocks the engines salt with ``cache_salt``
        (its LoRA adapter's; None: unsalted). A router that ignores prefixes need not override it."""
        return self.choose(loads, prompt_token_ids)

    @property
    def observes_prefix_caches(self) -> bool:
        """Whether :meth:`apply` should be told what each engine's prefix cache stores and drops."""
        return False

    def apply(self, engine: int, delta: KVCacheDelta) -> None:
        """Take in what engine ``engine`` stored in and dropped from its prefix cache."""


def installed_routers() -> list[str]:
    """Names of every router registered in the ``cadence.routers`` group, sorted."""
    return installed_plugins(GROUP)


def router_class(name: str) -> type[Router]:
    """The class registered as ``name``; unknown names list what is installed."""
    return load_plugin_class(GROUP, name, Router, "router", "routers")  # type: ignore[type-abstract]


def load_router(name: str, context: RouterContext) -> Router:
    return router_class(name)(context)
