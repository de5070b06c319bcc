"""The default data-parallel router (``prefix-aware``): least loaded first; with prefix caching on,
the engine whose prefix cache holds the longest prefix of the prompt wins, as long as its load stays
within a slack of the least loaded (so a popular prefix cannot pile every request onto one engine).
Ties, and prompts that no engine has cached, go to the least loaded engine (the lowest rank among
equals).

What each engine has cached is learnt from its KV events, which the engine core folds into one
:class:`KVCacheDelta` per output batch: the router sees evictions as well as stores, so it never
prefers an engine for blocks it has already dropped. An engine's blocks become known once the
step that computed them has reported, so requests sharing a prefix that arrive together are
spread by load, not piled up behind the first of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.core.block_hash import prompt_block_hashes
from cadence.engine.routers.base import Router, RouterContext
from cadence.messages import KVCacheDelta


class PrefixAwareRouter(Router):
    """Chooses an engine per request from the engines' loads and cached block hashes.

    ``slack``/``slack_ratio``: the engine with the longest prefix hit is preferred while its load
    is at most ``least + max(slack, slack_ratio * least)``, ``least`` being the lowest load.
    """

    name = "prefix-aware"

    def __init__(self, context: RouterContext, *, slack: int = 4, slack_ratio: float = 0.25) -> None:
        super().__init__(context)
        self.slack = slack
        self.slack_ratio = slack_ratio
        self._cached: list[set[int]] = [set() for _ in range(self.context.num_engines)]

    @property
    def observes_prefix_caches(self) -> bool:
        return self.context.prefix_caching

    def choose(self, loads: Sequence[float], prompt_token_ids: Sequence[int]) -> int:
        """The rank of the engine for a request with this prompt, given each engine's load."""
        return self.choose_salted(loads, prompt_token_ids, None)

    def choose_salted(self, loads: Sequence[float], prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        least = min(loads)
        if self.context.prefix_caching:
            matched = self.matched_blocks(prompt_token_ids, cache_salt)
            if any(matched):
                bound = least + max(self.slack, self.slack_ratio * least)
                eligible = [e for e in range(self.context.num_engines) if loads[e] <= bound]
                return max(eligible, key=lambda e: (matched[e], -loads[e], -e))
        return loads.index(least)

    def matched_blocks(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Per engine, how many of the prompt's leading full blocks its prefix cache holds (blocks
        whose first one is salted with ``cache_salt``, as the allocator salts a LoRA adapter's).

        Like the allocator's lookup, the last prompt token is never counted as cached. Hashing stops
        at the first block no engine holds, so a prompt nobody has seen costs one hash.
        """
        bs = self.context.block_size
        matched = [0] * self.context.num_engines
        holders = list(range(self.context.num_engines))
        for parent in prompt_block_hashes(list(prompt_token_ids), bs, cache_salt, self.context.hash_algo):
            holders = [e for e in holders if parent in self._cached[e]]
            if not holders:
                break
            for e in holders:
                matched[e] += 1
        return matched

    def apply(self, engine: int, delta: KVCacheDelta) -> None:
        """Take in what engine ``engine`` stored in and dropped from its prefix cache."""
        cached = self._cached[engine]
        if delta.cleared:
            cached.clear()
        cached.difference_update(delta.removed)
        cached.update(delta.stored)
