"""KV cache groups: which layers share a block table (docs/architecture.md, "KV cache groups").

A model whose layers all see the same context (all global, or all with one sliding window) has one
group of every layer: a block holds a span of tokens for all layers. A hybrid model (Gemma 2/3:
sliding and global layers) splits its layers into groups of equal size, each of one kind, as vLLM's
hybrid KV cache manager does: a block then holds a span of tokens for the layers of one group, so
a sliding group can give back the blocks its window has left while the global group keeps them.
Equal sizes let every group draw from one pool of equal blocks: the cache is ``group_size`` tensors
of ``num_blocks`` blocks, and layer ``i`` reads and writes tensor ``slot[i]`` through the block
table of group ``group[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from cadence.models.layers import layer_windows


@dataclass(frozen=True)
class KVCacheGroups:
    """The groups of one model: each group's window (None: global) and layers."""

    windows: tuple[int | None, ...]  # per group; a group of global layers first where there is one
    layers: tuple[tuple[int, ...], ...]  # per group
    group_size: int  # layers in the largest group: the KV tensors a block spans

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_of_layer(self) -> list[int]:
        """Each layer's group."""
        return self._per_layer()[0]

    @property
    def slot_of_layer(self) -> list[int]:
        """Each layer's position in its group: which of the ``group_size`` cache tensors it uses."""
        return self._per_layer()[1]

    def _per_layer(self) -> tuple[list[int], list[int]]:
        num_layers = sum(len(layers) for layers in self.layers)
        group, slot = [0] * num_layers, [0] * num_layers
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                group[layer], slot[layer] = g, j
        return group, slot


def kv_capacity_tokens(num_blocks: int, block_size: int, num_groups: int) -> int:
    """The longest request a pool of ``num_blocks`` (null block included) holds for sure: with every
    group holding all its blocks (a sliding group does while its window covers the whole request,
    or over a prefill in one chunk)."""
    return (num_blocks - 1) // num_groups * block_size


def kv_cache_groups(windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
    """Group layers with the given windows (per layer, None: global).

    One group when every layer has the same window, or when ``hybrid`` is off (then no block is
    released before the request ends, since the global layers need them all). Else each kind of
    layer (one per window) is cut into groups of the smallest kind's size, the last group of a kind
    short where its count is not a multiple (its blocks leave a slot unused).
    """
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1 or not hybrid:
        window = kinds[0] if len(kinds) == 1 else None
        return KVCacheGroups((window,), (tuple(range(len(windows))),), len(windows))
    members = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in members.values())
    group_windows: list[int | None] = []
    group_layers: list[tuple[int, ...]] = []
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), size):
            group_windows.append(kind)
            group_layers.append(tuple(layers[start:start + size]))
    return KVCacheGroups(tuple(group_windows), tuple(group_layers), size)


def kv_cache_groups_of(config: PretrainedConfig, hybrid: bool = True) -> KVCacheGroups:
    """The groups of a Hugging Face config's layers (:func:`cadence.models.layers.layer_windows`)."""
    return kv_cache_groups(layer_windows(config), hybrid)
