"""How much of a small decode's attention on a GPU is the host's launching: each backend's ``forward``
(cache write + attention, bf16, 32 query / 8 KV heads, head dim 128) timed as one call, as 30 calls
back to back (a model's layers), and as the same 30 calls replayed from a CUDA graph; microseconds a
call. cadence captures no graphs; this measures what capturing them would save
(docs/attention_backends.md). On a CUDA machine only; a benchmark, never a test:

    python benchmarks/gpu_launch_floor.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from cuda_timer import time_cuda

from cadence.backends.registry import available_backends, load_backend
from cadence.backends.testing import large_paged_batch

LAYERS = 30
CASES = [("decode B1 ctx4k", [(4095, 1)]), ("decode B16 ctx4k", [(4095, 1)] * 16),
         ("decode B64 ctx4k", [(4095, 1)] * 64), ("decode B1 ctx32k", [(32767, 1)])]


def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn``'s kernels as a CUDA graph (warmed up on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _us(fn: Callable[[], object], device: torch.device) -> float:
    return 1e6 * time_cuda(fn, device)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this measures GPU launches")
        return 2
    device = torch.device("cuda")
    names = [name for name in ("triton", "sdpa", "flash_attn") if name in available_backends()]
    print(f"{'backend':<11}{'case':<19}{'one call':>10}{f'{LAYERS} in a row':>13}{'graph':>10}  (us a call)")
    for label, requests in CASES:
        batch = large_paged_batch(requests, 32, 8, 128, 16, torch.bfloat16, device)
        for name in names:
            try:
                backend = load_backend(name, device, torch.bfloat16, 128, 16)(32, 8, 128, 128 ** -0.5)
            except (RuntimeError, ValueError) as exc:
                print(f"{name:<11}not run: {exc}")
                continue
            meta = backend.build_metadata(batch.layout, device)
            k_cache, v_cache = backend.to_kv_cache_layout(batch.k_cache), backend.to_kv_cache_layout(batch.v_cache)

            def one() -> object:
                return backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, meta)  # noqa: B023

            def layers() -> None:
                for _ in range(LAYERS):
                    one()

            stream = torch.cuda.current_stream()
            try:
                graph = f"{_us(captured(layers).replay, device) / LAYERS:>10.1f}"
            except RuntimeError as exc:  # a backend that syncs with the host cannot be captured
                torch.cuda.set_stream(stream)  # a failed capture leaves its own stream current
                graph = f"  capture failed: {exc}"
            print(f"{name:<11}{label:<19}{_us(one, device):>10.1f}{_us(layers, device) / LAYERS:>13.1f}{graph}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
