"""A worker's LoRA adapters: the slots in every adapted layer, which adapter each slot holds, and the
adapters kept loaded (docs/lora.md).

Each step the model runner tells :meth:`LoRAManager.prepare` which adapter each scheduled request
runs with. An adapter not in a slot takes the slot used least recently by an adapter this step does
not need (the scheduler admits at most ``--max-loras`` adapters among running requests, so one is
always free), its weights read from the adapters kept loaded (``--max-cpu-loras``, least recently
used dropped first) or else from disk. A small step (decodes) runs the model's C++ decoder stack
with the adapters' deltas added there; a large one, segmented by adapter, runs the layers from
Python, where the layers' hooks add them.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from cadence.config import LoRAConfig
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear
from cadence.lora.adapter import AdapterError, LoRAWeights, load_adapter
from cadence.lora.layer_slots import LoRABatch, LoRASlots
from cadence.lora_request import LoRARequest
from cadence.models.decoder_stack import DecoderStack
from cadence.models.llama import our_name

# The decoder layers' projections, as cadence's models name them (q/k/v and gate/up fused).
_ADAPTED = re.compile(r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")

Linear = ColumnParallelLinear | RowParallelLinear
# An adapter as one rank holds it: per adapted layer, the weights of each of its parts.
RankAdapter = dict[str, list[LoRAWeights | None]]


class LoRAManager:
    """Puts adapter slots in ``model``'s decoder projections and fills them as steps need."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.batch = LoRABatch(config.max_loras, config.max_lora_rank, dtype, device)
        self.layers: dict[str, tuple[Linear, LoRASlots]] = {}
        for name, module in model.named_modules():
            if _ADAPTED.fullmatch(name) and isinstance(module, ColumnParallelLinear | RowParallelLinear):
                slots = (LoRASlots(self.batch, module.in_features, module.out_sizes)
                         if isinstance(module, ColumnParallelLinear)
                         else LoRASlots(self.batch, module.part.size, [module.out_features]))
                module.lora = slots
                self.layers[name] = (module, slots)
        # The model's C++ decoder stack, if it has one: it runs masked steps' deltas too.
        self._stack: DecoderStack | None = getattr(model, "decoder_stack", None)
        self._loaded: OrderedDict[int, RankAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * config.max_loras
        self._slot_used = [0] * config.max_loras  # the step that last used each slot
        self._step = 0

    def prepare(self, loras: Sequence[LoRARequest | None], counts: Sequence[int]) -> None:
        """Set the step's adapters: request ``i`` (of ``counts[i]`` rows) runs with ``loras[i]``.

        :raises RuntimeError: more adapters than slots (the scheduler never schedules that).
        :raises AdapterError: an adapter that cannot be read or does not fit this model.
        """
        self._step += 1
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not needed:
            self.batch.set(None)
            if self._stack is not None:
                self._stack.enabled, self._stack.lora_masks, self._stack.lora_slot = True, [], -1
            return
        if len(needed) > len(self._slot_ids):
            raise RuntimeError(f"a step with {len(needed)} LoRA adapters, above --max-loras {len(self._slot_ids)}")
        slots = {lora_id: self._slot_for(lora, needed) for lora_id, lora in needed.items()}
        per_request = np.array([-1 if lora is None else slots[lora.lora_int_id] for lora in loras], dtype=np.int64)
        self.batch.set(np.repeat(per_request, counts))
        if self._stack is not None:  # a masked step runs in the C++ stack, a segmented one from Python
            self._stack.enabled = self.batch.segments is None
            self._stack.lora_masks = self.batch.masks() if self._stack.enabled else []
            self._stack.lora_slot = self.batch.only_slot

    def _slot_for(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        if lora.lora_int_id in self._slot_ids:
            slot = self._slot_ids.index(lora.lora_int_id)
        else:
            free = [s for s, held in enumerate(self._slot_ids) if held is None or held not in needed]
            slot = min(free, key=lambda s: (self._slot_ids[s] is not None, self._slot_used[s]))
            adapter = self._adapter(lora)
            for name, (module, slots) in self.layers.items():
                slots.load(slot, adapter.get(name, [None] * slots.num_parts))
                if self._stack is not None:  # the C++ stack reads the slots' new (repacked) weights
                    self._stack.set_lora(module, slots.packed, slots.num_parts, self.config.max_lora_rank)
            self._slot_ids[slot] = lora.lora_int_id
        self._slot_used[slot] = self._step
        return slot

    def _adapter(self, lora: LoRARequest) -> RankAdapter:
        """The adapter as this rank holds it: kept loaded, or read now (and kept)."""
        adapter = self._loaded.get(lora.lora_int_id)
        if adapter is None:
            adapter = self._read(lora)
            self._loaded[lora.lora_int_id] = adapter
            while len(self._loaded) > self.config.num_cached:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(lora.lora_int_id)
        return adapter

    def _read(self, lora: LoRARequest) -> RankAdapter:
        adapter: RankAdapter = {}
        for module, weights in load_adapter(lora.lora_path).items():
            name, part = our_name(module + ".weight")
            name = name.removesuffix(".weight")
            if name not in self.layers:
                raise AdapterError(f"LoRA adapter {lora.lora_name!r} adapts {module}, which this model does not have")
            layer, slots = self.layers[name]
            if weights.a.shape[0] > self.config.max_lora_rank:
                raise AdapterError(f"LoRA adapter {lora.lora_name!r}: {module} has rank {weights.a.shape[0]}, "
                                   f"above --max-lora-rank {self.config.max_lora_rank}")
            parts = adapter.setdefault(name, [None] * slots.num_parts)
            parts[part] = self._shard(layer, part, weights)
        return adapter

    def _shard(self, layer: Linear, part: int, weights: LoRAWeights) -> LoRAWeights:
        """This rank's share of a part's weights: its output rows of ``B`` (column-parallel) or its
        input columns of ``A`` (row-parallel), in the model's dtype."""
        a, b = weights.a, weights.b
        if isinstance(layer, ColumnParallelLinear):
            b = b[layer.parts[part].indices]
        else:
            a = a[:, layer.part.indices]
        return LoRAWeights(a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
