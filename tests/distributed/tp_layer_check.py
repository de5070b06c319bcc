"""One rank of the parallel-layer check in test_tensor_parallel.py, in a module of its own so that the
spawned ranks import only torch and cadence.distributed, not the engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.distributed import head_shard, init_tensor_parallel
from cadence.distributed.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, pack_weights
from cadence.distributed.partition import even_split
from cadence.quantization.blocks import BlockCodes, quantize_int8


def check_layers(rank: int, world_size: int, init_method: str) -> None:
    """One rank: its shards, fed the same inputs, must give the unsharded layers' outputs."""
    torch.set_num_threads(1)
    group = init_tensor_parallel(rank, world_size, init_method, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    hidden, head_dim, vocab = 8, 4, 13  # 13: the last rank's vocabulary shard is padded
    q, k, v, bias = randn(9 * head_dim, hidden), randn(3 * head_dim, hidden), randn(3 * head_dim, hidden), randn(36)
    o, x, ids = randn(hidden, 9 * head_dim), randn(5, hidden), torch.tensor([0, 5, 6, 7, 12, 3])
    table = randn(vocab, hidden)
    heads = head_shard(9, 3, rank, world_size)
    qs, kvs = heads.q.scaled(head_dim), heads.kv.scaled(head_dim)

    qkv = ColumnParallelLinear(hidden, [qs, kvs, kvs], True, torch.float32, "cpu")
    for shard, (weight, b) in enumerate([(q, bias), (k, bias[:12]), (v, bias[12:24])]):
        qkv.load("weight", weight, shard)
        qkv.load("bias", b, shard)
    out_q, out_k, out_v = qkv(x).split(qkv.out_sizes, dim=-1)
    torch.testing.assert_close(out_q, F.linear(x, q, bias)[:, qs.indices])
    torch.testing.assert_close(out_k, F.linear(x, k, bias[:12])[:, kvs.indices])
    torch.testing.assert_close(out_v, F.linear(x, v, bias[12:24])[:, kvs.indices])

    attn_out = randn(5, 9 * head_dim)
    o_proj = RowParallelLinear(qs, hidden, True, group, torch.float32, "cpu")
    o_proj.load("weight", o, 0)
    o_proj.load("bias", bias[:hidden], 0)
    torch.testing.assert_close(o_proj(attn_out[:, qs.indices]), F.linear(attn_out, o, bias[:hidden]))

    embed = VocabParallelEmbedding(vocab, hidden, group, torch.float32, "cpu")
    embed.load("weight", table, 0)
    assert torch.equal(embed(ids), F.embedding(ids, table))  # one non-zero addend per token: exact
    torch.testing.assert_close(embed.logits(x), F.linear(x, table))
    # Leave the group before exiting: gloo's threads outliving the interpreter abort the process.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class Blocks:
    """A quantized checkpoint tensor: its floats where indexed, its blocks where a layer keeps them."""

    def __init__(self, codes: BlockCodes) -> None:
        self.codes = codes
        self.shape = codes.shape

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.codes.dequantize()[index]

    def block_codes(self, rows: slice, cols: slice) -> BlockCodes:
        return self.codes.take(rows, cols)


def check_quantized_layers(rank: int, world_size: int, init_method: str) -> None:
    """One rank: its shards of quantized weights (rows for the column split, whole blocks of
    columns for the row split, vocabulary rows) give the unsharded quantized layers' outputs."""
    torch.set_num_threads(1)
    group = init_tensor_parallel(rank, world_size, init_method, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)

    def codes(rows: int, cols: int) -> BlockCodes:
        return quantize_int8(torch.randn(rows, cols, generator=gen))

    hidden, vocab = 64, 13
    gate, up, table = codes(96, hidden), codes(96, hidden), codes(vocab, hidden)
    down = quantize_int8(torch.randn(hidden, 96, generator=gen), block=16)  # 48 columns a rank: blocks of 16
    x, ids = torch.randn(5, hidden, generator=gen), torch.tensor([0, 5, 6, 7, 12, 3])
    part = even_split(96, rank, world_size)  # 48 each
    whole = [even_split(96, 0, 1)] * 2
    single = ColumnParallelLinear(hidden, whole, False, torch.float32, "cpu")
    fused = ColumnParallelLinear(hidden, [part, part], False, torch.float32, "cpu")
    for layer in (single, fused):
        layer.load("weight", Blocks(gate), 0)
        layer.load("weight", Blocks(up), 1)
    row = RowParallelLinear(part, hidden, False, group, torch.float32, "cpu")
    row.load("weight", Blocks(down), 0)
    embed = VocabParallelEmbedding(vocab, hidden, group, torch.float32, "cpu")
    embed.load("weight", Blocks(table), 0)
    for layer in (single, fused, row, embed):
        pack_weights(layer)
    expected = single(x).view(5, 2, 96)[:, :, part.indices].reshape(5, -1)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=0)  # the same rows, the same sums
    hidden_in = torch.randn(5, 96, generator=gen)
    full = F.linear(hidden_in, down.dequantize()[:, :96])
    torch.testing.assert_close(row(hidden_in[:, part.indices]), full, rtol=1e-4, atol=1e-3)
    assert torch.equal(embed(ids), F.embedding(ids, table.dequantize()))
    torch.testing.assert_close(embed.logits(x), F.linear(x, table.dequantize()), rtol=1e-4, atol=1e-3)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
