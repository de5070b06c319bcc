"""The draft-model proposer: a second, smaller model that drafts each request's next tokens.

After each target step, the draft model runs its greedy continuation of every sampled request:
first a step that computes the tokens it has not seen (the whole prompt the first time, then the
target's last token and whatever of its own drafts were rejected), whose last logits give the first
draft, then one step per further draft. Its KV cache is a pool of its own, in the worker (the
scheduler allocates only the target's blocks): each request keeps a block list there and the tokens
whose KV it holds; positions whose token the target did not keep are computed again on the next
proposal. A request leaving the batch frees its blocks; short of blocks, the requests least recently
drafted for give theirs back (docs/speculative_decoding.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from cadence.backends.registry import load_backend
from cadence.config import ModelConfig
from cadence.executor.step_layout import step_layout
from cadence.models.layers import head_dim_of
from cadence.models.loader import load_hf_config, load_model
from cadence.models.registry import CausalLM


@dataclass
class DraftSequence:
    """A request's KV in the draft's pool: its blocks, and the tokens at the positions they hold."""

    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # How many of ``tokens`` were the target's own (the rest are drafts, kept if the target accepts them).
    num_confirmed: int = 0

    def reusable(self, tokens: list[int]) -> int:
        """How many positions of ``tokens`` hold their KV already; the last is always computed (its
        logits give the first draft)."""
        at, limit = self.num_confirmed, min(len(self.tokens), len(tokens) - 1)
        while at < limit and self.tokens[at] == tokens[at]:
            at += 1
        return min(at, len(tokens) - 1)


@dataclass(frozen=True)
class _Row:
    """One request's part of a proposal: its sequence, tokens, first position to compute, drafts to make."""

    seq: DraftSequence
    tokens: list[int]
    start: int
    num_drafts: int


class DraftModelProposer:
    """Greedy drafts of a draft model over a paged KV pool of its own."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                 block_size: int, device: torch.device, num_speculative_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.backend = model.attn_backend
        self.kv_caches = kv_caches  # one (K, V) pair per layer, of num_blocks blocks
        self.block_size = block_size
        self.device = device
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block, padding block tables
        self.seqs: OrderedDict[str, DraftSequence] = OrderedDict()  # least recently drafted first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Free the blocks of requests that left the batch (finished or preempted)."""
        for request_id in request_ids:
            seq = self.seqs.pop(request_id, None)
            if seq is not None:
                self.free.extend(seq.block_ids)

    def propose(self, requests: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        """Drafts for each ``(request_id, tokens, count)``: up to ``count`` (and
        ``num_speculative_tokens``); none for a request at ``max_model_len`` or whose KV the pool
        cannot hold."""
        batch = {request_id for request_id, _, _ in requests}
        rows: list[_Row | None] = []
        for request_id, tokens, count in requests:
            num_drafts = min(count, self.k, self.max_model_len - len(tokens))
            seq = self.seqs.setdefault(request_id, DraftSequence())
            self.seqs.move_to_end(request_id)
            fits = num_drafts > 0 and self._reserve(seq, len(tokens) + num_drafts - 1, batch)
            rows.append(_Row(seq, tokens, seq.reusable(tokens), num_drafts) if fits else None)
        active = [row for row in rows if row is not None]
        drafts: list[list[int]] = [[] for _ in active]
        with torch.inference_mode():
            step = [(i, row.tokens[row.start:], row.start) for i, row in enumerate(active)]
            while step:
                sampled = self._forward([(active[i].seq, fed, start) for i, fed, start in step])
                for (i, fed, start), token in zip(step, sampled, strict=True):
                    active[i].seq.tokens[start:] = fed
                    drafts[i].append(token)
                # The next position of each row still drafting: after its tokens and drafts but the last.
                step = [(i, [drafts[i][-1]], len(row.tokens) + len(drafts[i]) - 1)
                        for i, row in enumerate(active) if len(drafts[i]) < row.num_drafts]
        for row in active:
            row.seq.num_confirmed = len(row.tokens)
        made = iter(drafts)
        return [[] if row is None else next(made) for row in rows]

    def _forward(self, step: list[tuple[DraftSequence, list[int], int]]) -> list[int]:
        """Compute each sequence's tokens from its position; the greedy token after each one's last."""
        counts = [len(fed) for _, fed, _ in step]
        starts = [start for _, _, start in step]
        layout = step_layout([[seq.block_ids] for seq, _, _ in step], starts, counts, self.block_size)
        metadata = self.backend.build_metadata(layout.layouts[0], self.device)
        input_ids = torch.tensor([t for _, fed, _ in step for t in fed], dtype=torch.long, device=self.device)
        last_rows = torch.from_numpy(layout.query_start_loc[1:] - 1).to(self.device)
        logits = self.model(input_ids, torch.from_numpy(layout.positions).to(self.device), self.kv_caches,
                            [metadata] * len(self.kv_caches), last_rows)
        return logits.argmax(dim=-1).tolist()

    def _reserve(self, seq: DraftSequence, num_positions: int, batch: set[str]) -> bool:
        """Blocks for ``num_positions`` positions of ``seq``, taking those of the requests least
        recently drafted for (outside ``batch``) when the pool is short; False if it stays short."""
        needed = -(-num_positions // self.block_size) - len(seq.block_ids)
        while needed > len(self.free):
            victim = next((request_id for request_id in self.seqs if request_id not in batch), None)
            if victim is None:
                return False
            self.forget([victim])
        if needed > 0:
            seq.block_ids.extend(self.free[-needed:])
            del self.free[-needed:]
        return True


def load_draft_model(draft: ModelConfig, attention_backend: str | None, device: torch.device, num_blocks: int,
                     block_size: int, num_speculative_tokens: int) -> DraftModelProposer:
    """The draft model of ``--speculative-config`` on ``device``, unsharded, with a pool of
    ``num_blocks`` blocks for its KV (the target's count: as many tokens as the target's pool)."""
    hf_config = load_hf_config(draft.path)
    dtype, head_dim = draft.torch_dtype, head_dim_of(hf_config)
    backend_cls = load_backend(attention_backend, device, dtype, head_dim, block_size)
    backend_cls.prepare(device, dtype)
    model = load_model(draft.path, hf_config, dtype, device, backend_cls, quantization=draft.quantization,
                       gguf_file=draft.gguf_file, enforce_eager=draft.enforce_eager)
    kv_caches = backend_cls.allocate_kv_caches(hf_config.num_hidden_layers, num_blocks, block_size,
                                               model.num_kv_heads, head_dim, dtype, device)
    return DraftModelProposer(model, kv_caches, num_blocks, block_size, device, num_speculative_tokens,
                              draft.max_model_len)
