"""cadence's C++ CPU kernels against what they replace, in one run, on SmolLM2-135M's shapes.

- GEMM: every bf16 linear of the 30 layers plus the LM head, each layer with its own weight (so
  the weights stream from memory as in a real step), at 1, 16, 64 and 2,048 rows: cadence's GEMM
  (``csrc/bf16_linear.cpp``; on a CPU with AMX both its paths, AMX tiles and VDPBF16PS), or on a
  CPU without AVX512-BF16 the AVX2 one (``csrc/bf16_linear_avx2.cpp``), against oneDNN's prepacked
  GEMM (bf16 where oneDNN has it, which takes AMX where the CPU has it; float32, what a float32 model
  runs, where it does not) and plain ``F.linear`` (bf16; up to 64 rows where oneDNN lacks bf16, as
  it then takes minutes at 2,048).
- argmax: the sampler's greedy choice over a [64, 49152] fp32 batch, against ``torch.argmax``.
- layer ops, over 32 and 2,048 rows in bf16 and fp32: silu_and_mul of a gate/up output (SmolLM2's
  2 x 1,536 columns) against torch's ``F.silu(gate) * up``; add_rms_norm over rows of 576 against
  torch's add and ``F.rms_norm`` in fp32 (Llama's op-by-op chain is slower still); scaled_rms_norm
  (Gemma's) against Gemma3RMSNorm's fp32 ops; rotary_embedding of q and k (12 heads of 64) against
  Llama's ``x * cos + rotate_half(x) * sin`` after the gather of the step's cos and sin rows.
- decode attention: 64 requests x 200 tokens of context, 30 layers, read through a block table
  whose blocks are contiguous (a fresh cache) or shuffled (a cache after requests came and went).
- one user's decode attention: one request over 4,096 keys, 30 layers, on every thread against one
  thread (a decode past 512 keys is read in parts that every thread takes).
- prefill attention: one 2,048-token prompt (and a 512-token chunk after 1,536 cached tokens), one
  layer, on each bf16 path the CPU has (packed keys on AMX tiles or by VDPBF16PS, and fp32), against
  torch's causal SDPA over the same keys gathered into contiguous tensors; and goal 6's burst, 32
  prompts' 64 new rows over 1,088 keys, the first 1,024 shared, on each path.
- decodes over a shared prefix: 32 decodes over 1,150 keys each, 30 layers, the first 1,024 keys in
  blocks all 32 share (a system prompt in the prefix cache: cascade attention over packed keys where
  the CPU has AMX or AVX512-BF16, each path the CPU has) or in blocks of their own.

Prints milliseconds (the median of the repeats), GFLOP/s for the GEMMs, and cadence's speed-up.
Needs a CPU with AVX-512 or AVX2. A benchmark, never a test.

    python benchmarks/cpu_kernels.py [--num-threads 2 --repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from cadence.backends import dense_gemm
from cadence.backends.cpu_kernels import attention_path, cpu_ops
from cadence.executor.malloc_tuning import keep_freed_memory

LAYERS = 30
# (out_features, in_features, copies): q/k/v, o, gate/up, down (one per layer), and the LM head.
GEMMS = [(960, 576, LAYERS), (576, 576, LAYERS), (3072, 576, LAYERS), (576, 1536, LAYERS), (49152, 576, 1)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch page faults, oneDNN's primitive cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench_gemm(ops: Any, rows: int, repeats: int) -> None:
    """``ops``: the library whose ``bf16_linear`` is cadence's GEMM here (``cadence_cpu`` or ``cadence_avx2``)."""
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(copies)] for n, k, copies in GEMMS]
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    dtype = torch.bfloat16 if onednn_bf16 else torch.float32  # oneDNN's weights: bf16, or a float32 model's
    inputs = {d: [torch.randn(rows, k).to(d) for _, k, _ in GEMMS] for d in {torch.bfloat16, dtype}}
    ours = [[ops.pack_bf16_linear(w) for w in group] for group in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 64) for w in group] for group in weights]
    baseline = f"oneDNN prepacked {'bf16' if onednn_bf16 else 'float32'}"
    calls: dict[str, tuple[torch.dtype, Callable[[torch.Tensor, int], object]]] = {
        baseline: (dtype, lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, onednn[i // LAYERS][i % LAYERS], None, "none", [], "")),
    }
    if onednn_bf16 or rows <= 64:
        calls["F.linear bf16"] = (torch.bfloat16, lambda x, i: F.linear(x, weights[i // LAYERS][i % LAYERS]))

    def ours_call(x: torch.Tensor, i: int) -> object:
        return ops.bf16_linear(x, ours[i // LAYERS][i % LAYERS], None, GEMMS[i // LAYERS][0])

    def step(dtype: torch.dtype, call: Callable[[torch.Tensor, int], object]) -> None:
        for group, (_, _, copies) in enumerate(GEMMS):  # outputs are dropped at once, as in a forward
            for copy in range(copies):
                call(inputs[dtype][group], group * LAYERS + copy)

    times = {name: median_ms(functools.partial(step, *call), repeats) for name, call in calls.items()}
    paths = {"cadence AMX": True, "cadence VDPBF16PS": False} if hasattr(ops, "use_amx") else {"cadence AVX2": None}
    for name, amx in paths.items():
        if amx is None or ops.use_amx(amx) == amx:  # the AMX path only where the CPU has it
            times[name] = median_ms(functools.partial(step, torch.bfloat16, ours_call), repeats)
    if hasattr(ops, "use_amx"):
        ops.use_amx(True)
    flops = sum(2 * rows * n * k * copies for n, k, copies in GEMMS)
    for name, ms in times.items():
        print(f"  GEMM {rows:>5} rows  {name:<24} {ms:8.2f} ms  {flops / ms / 1e6:6.0f} GFLOP/s")
    for name in (name for name in paths if name in times):  # the table's order
        against = [f"vs {other}: {ms / times[name]:.2f}x" for other, ms in times.items() if other in calls]
        print(f"  GEMM {rows:>5} rows  {name} {', '.join(against)}")


def bench_argmax(ops: Any, repeats: int) -> None:
    logits = torch.randn(64, 49152)
    ours = median_ms(lambda: [ops.argmax_rows(logits) for _ in range(100)], repeats) / 100
    theirs = median_ms(lambda: [logits.argmax(dim=-1) for _ in range(100)], repeats) / 100
    print(f"  argmax [64, 49152]  cadence {ours:.3f} ms  torch {theirs:.3f} ms  {theirs / ours:.2f}x")


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    residual.add_(x)
    return weight * F.rms_norm(residual.float(), (residual.shape[-1],), eps=1e-5).to(weight.dtype)


def _torch_scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # Gemma3RMSNorm
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * scale).to(x.dtype)


def _torch_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> object:
    """q and k rotated as Llama's apply_rotary_pos_emb does, after the step's gather of their rows."""
    heads = qkv[:, :12 * 64].view(-1, 12, 64)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return heads * c + rotate_half(heads) * s


Call = Callable[[], object]


def layer_op_cases(ops: Any, rows: int, dtype: torch.dtype) -> dict[str, tuple[Call, Call]]:
    """Each layer op's (cadence, torch) calls on ``rows`` tokens of SmolLM2's shapes."""
    gate_up, hidden = torch.randn(rows, 2 * 1536).to(dtype), torch.randn(rows, 576).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    weight, scale, out = torch.randn(576).to(dtype), torch.randn(576), torch.empty_like(hidden)
    qkv, positions = torch.randn(rows, 960).to(dtype), torch.randint(0, 4096, (rows,))
    cos, sin = torch.randn(4096, 64).to(dtype), torch.randn(4096, 64).to(dtype)
    return {
        "silu_and_mul [rows, 3072]": (functools.partial(ops.silu_and_mul, out.new_empty(rows, 1536), gate_up),
                                      lambda: F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]),
        "add_rms_norm [rows, 576]": (functools.partial(ops.add_rms_norm, out, residual, hidden, weight, 1e-5),
                                     functools.partial(_torch_add_rms_norm, hidden, residual, weight)),
        "scaled_rms_norm [rows, 576]": (functools.partial(ops.scaled_rms_norm, out, hidden, scale, 1e-6),
                                        functools.partial(_torch_scaled_rms_norm, hidden, scale)),
        "rotary_embedding [rows, 12 x 64]": (functools.partial(ops.rotary_embedding, qkv, positions, cos, sin, 12, 64),
                                             functools.partial(_torch_rope, qkv, positions, cos, sin)),
    }


def bench_layer_ops(ops: Any, repeats: int) -> None:
    for rows in (32, 2048):
        for dtype in (torch.bfloat16, torch.float32):
            for name, (ours_call, torch_call) in layer_op_cases(ops, rows, dtype).items():
                ours, theirs = median_ms(ours_call, repeats), median_ms(torch_call, repeats)
                print(f"  {name.replace('rows', str(rows))} {str(dtype)[6:]}  cadence {ours:.3f} ms"
                      f"  torch {theirs:.3f} ms  {theirs / ours:.2f}x")


def bench_attention(ops: Any, repeats: int) -> None:
    kv_heads, group, head_dim, block_size, requests, context = 3, 3, 64, 16, 64, 200
    blocks_per_request = -(-context // block_size)
    num_blocks = 2 * requests * blocks_per_request  # half of the pool in use
    caches = [tuple(torch.randn(kv_heads, num_blocks, block_size, head_dim, dtype=torch.bfloat16) for _ in "kv")
              for _ in range(LAYERS)]
    q = torch.randn(requests, kv_heads * group, head_dim, dtype=torch.bfloat16)
    out, rows = torch.empty_like(q), torch.arange(requests)
    seq_lens = torch.full((requests,), context)
    used = requests * blocks_per_request
    shuffled = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:used]
    tables = {"contiguous": torch.arange(used), "shuffled": shuffled}
    times = {}
    for name, blocks in tables.items():
        table = blocks.view(requests, blocks_per_request)

        def step(table: torch.Tensor = table) -> None:
            for k, v in caches:
                ops.paged_attention(out, q, k, v, table, rows, seq_lens, head_dim ** -0.5, 0, 0.0)

        times[name] = median_ms(step, repeats)
        print(f"  decode attention, {name} blocks: {times[name]:.2f} ms per 30 layers")
    print(f"  shuffled / contiguous: {times['shuffled'] / times['contiguous']:.2f}x the time")


def bench_long_decode(ops: Any, repeats: int) -> None:
    kv_heads, group, head_dim, block_size, context = 3, 3, 64, 16, 4096
    blocks = context // block_size
    caches = [tuple(torch.randn(kv_heads, blocks, block_size, head_dim, dtype=torch.bfloat16) for _ in "kv")
              for _ in range(LAYERS)]
    q = torch.randn(1, kv_heads * group, head_dim, dtype=torch.bfloat16)
    out, rows, seq_lens = torch.empty_like(q), torch.zeros(1, dtype=torch.long), torch.tensor([context])
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).view(1, -1)

    def step() -> None:
        for k, v in caches:
            ops.paged_attention(out, q, k, v, table, rows, seq_lens, head_dim ** -0.5, 0, 0.0)

    threads = torch.get_num_threads()
    every = median_ms(step, repeats)
    torch.set_num_threads(1)
    try:
        one = median_ms(step, repeats)
    finally:
        torch.set_num_threads(threads)
    print(f"  one decode over {context} keys: {every:.2f} ms per 30 layers on {threads} threads, "
          f"{one:.2f} ms on one ({one / every:.2f}x)")


def attention_paths(ops: Any) -> Iterator[str]:
    """Paged attention's bf16 paths this CPU has, each switched on in turn: "AMX" (packed keys on the
    tile unit), "VDPBF16PS" (packed keys without it), "fp32"; the default again after each."""
    for name, label in (("amx", "AMX"), ("bf16_dot", "VDPBF16PS"), ("fp32", "fp32")):
        with attention_path(ops, name) as available:
            if available:
                yield label


def bench_prefill_attention(ops: Any, repeats: int) -> None:
    kv_heads, group, head_dim, block_size, context = 3, 3, 64, 16, 2048
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv_heads, context // block_size, block_size, head_dim, generator=generator,
                        dtype=torch.bfloat16) for _ in "kv")
    table = torch.arange(context // block_size).view(1, -1)
    keys, values = (c.flatten(1, 2).unsqueeze(0) for c in (k, v))  # [1, kv_heads, context, head_dim]
    for rows in (2048, 512):
        q = torch.randn(rows, kv_heads * group, head_dim, generator=generator, dtype=torch.bfloat16)
        out, requests = torch.empty_like(q), torch.zeros(rows, dtype=torch.long)
        seq_lens = torch.arange(context - rows + 1, context + 1)
        mask = torch.arange(context)[None, :] < seq_lens[:, None]  # each row sees up to its position
        query = q.transpose(0, 1).unsqueeze(0)
        theirs = median_ms(lambda query=query, mask=mask: F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, enable_gqa=True), repeats)
        for path in attention_paths(ops):
            ours = median_ms(lambda q=q, out=out, requests=requests, seq_lens=seq_lens: ops.paged_attention(
                out, q, k, v, table, requests, seq_lens, head_dim ** -0.5, 0, 0.0), repeats)
            print(f"  prefill attention, {rows} rows over {context} keys: cadence {path} {ours:.2f} ms  "
                  f"torch SDPA {theirs:.2f} ms  {theirs / ours:.2f}x")


def shared_prefix_table(requests: int, shared: int, own: int) -> torch.Tensor:
    """Block tables [requests, shared + own]: blocks 0..shared-1 in every row (a prefix they all
    share), then each request's ``own`` blocks after them."""
    return torch.cat([torch.arange(shared).expand(requests, -1),
                      shared + torch.arange(requests * own).view(requests, own)], dim=1)


def bench_shared_prefix_prefill(ops: Any, repeats: int) -> None:
    """Goal 6's burst: 32 prompts' 64 new rows each over 1,088 keys, the first 1,024 in shared blocks."""
    kv_heads, group, head_dim, block_size, requests, new, prefix = 3, 3, 64, 16, 32, 64, 1024
    own, shared = new // block_size, prefix // block_size
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv_heads, shared + requests * own, block_size, head_dim, generator=generator,
                        dtype=torch.bfloat16) for _ in "kv")
    table = shared_prefix_table(requests, shared, own)
    q = torch.randn(requests * new, kv_heads * group, head_dim, generator=generator, dtype=torch.bfloat16)
    out, rows = torch.empty_like(q), torch.arange(requests).repeat_interleave(new)
    seq_lens = torch.arange(prefix + 1, prefix + new + 1).repeat(requests)
    for path in attention_paths(ops):
        ms = median_ms(lambda: ops.paged_attention(out, q, k, v, table, rows, seq_lens, head_dim ** -0.5, 0, 0.0),
                       repeats)
        print(f"  prefill attention, {requests} x {new} rows over {prefix + new} keys, the first {prefix} shared: "
              f"cadence {path} {ms:.2f} ms")


def bench_shared_prefix_decodes(ops: Any, repeats: int) -> None:
    kv_heads, group, head_dim, block_size, requests, context, prefix = 3, 3, 64, 16, 32, 1150, 1024
    per_request = -(-context // block_size)
    q = torch.randn(requests, kv_heads * group, head_dim, dtype=torch.bfloat16)
    out, rows, seq_lens = torch.empty_like(q), torch.arange(requests), torch.full((requests,), context)
    steps = {}
    for shared in (True, False):
        prefix_blocks = prefix // block_size if shared else 0
        own = per_request - prefix_blocks
        caches = [tuple(torch.randn(kv_heads, prefix_blocks + requests * own, block_size, head_dim,
                                    dtype=torch.bfloat16) for _ in "kv") for _ in range(LAYERS)]
        table = shared_prefix_table(requests, prefix_blocks, own)

        def step(table: torch.Tensor = table, caches: list[tuple[torch.Tensor, ...]] = caches) -> None:
            for k, v in caches:
                ops.paged_attention(out, q, k, v, table, rows, seq_lens, head_dim ** -0.5, 0, 0.0)

        steps[shared] = step
    for path in attention_paths(ops):
        times = {shared: median_ms(step, repeats) for shared, step in steps.items()}
        print(f"  {requests} decodes over {context} keys ({path}), the first {prefix} in shared blocks: "
              f"{times[True]:.2f} ms per 30 layers; in blocks of their own: {times[False]:.2f} ms "
              f"({times[False] / times[True]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    torch.set_num_threads(ns.num_threads)
    keep_freed_memory()  # as the engine's workers do: large outputs reuse memory instead of faulting
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("cadence's CPU kernels do not run on this machine (they need AVX-512 or AVX2)")
    print(f"cadence CPU kernels, {ns.num_threads} threads, median of {ns.repeats}")
    gemm = ops if ops.bf16_linear_supported() else dense_gemm.avx2_ops_with_bf16()
    for rows in (1, 16, 64, 2048):
        bench_gemm(gemm, rows, ns.repeats)
    bench_argmax(ops, ns.repeats)
    bench_layer_ops(ops, ns.repeats)
    bench_attention(ops, ns.repeats)
    bench_long_decode(ops, ns.repeats)
    bench_prefill_attention(ops, ns.repeats)
    bench_shared_prefix_prefill(ops, ns.repeats)
    bench_shared_prefix_decodes(ops, ns.repeats)


if __name__ == "__main__":
    main()
