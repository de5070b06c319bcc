"""A minimal model runner over a paged KV cache, for tests that drive a model's forward step by
step without an engine."""

from __future__ import annotations

import random

import torch

from cadence.backends.base import BatchLayout
from cadence.backends.sdpa_backend import SDPABackend
from cadence.models.gemma import Gemma2ForCausalLM
from cadence.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")


class PagedHarness:
    """A minimal model runner: scattered block ids, a hand-built BatchLayout per step."""

    def __init__(self, model: LlamaForCausalLM | Gemma2ForCausalLM, block_size: int, num_blocks: int = 64,
                 seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = SDPABackend.allocate_kv_caches(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                                                        model.head_dim, model.dtype, torch.device("cpu"))
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, tokens: dict[str, list[int]], schedule: dict[str, int]) -> torch.Tensor:
        """Compute ``schedule[r]`` more tokens of each request; logits of each one's last token."""
        input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for rid, count in schedule.items():
            first = self.computed.get(rid, 0)
            end = first + count
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            for pos in range(first, end):
                input_ids.append(tokens[rid][pos])
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.computed[rid] = end
            starts.append(starts[-1] + count)
            seq_lens.append(end)
        width = max(len(self.blocks[rid]) for rid in schedule)
        table = [self.blocks[rid] + [0] * (width - len(self.blocks[rid])) for rid in schedule]
        layout = BatchLayout(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(table, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(schedule.values()),
            max_seq_len=max(seq_lens),
        )
        metadata = self.model.attn_backend.build_metadata(layout, CPU)
        with torch.inference_mode():
            return self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches,
                              [metadata] * len(self.kv_caches),
                              torch.tensor(starts[1:]) - 1)
