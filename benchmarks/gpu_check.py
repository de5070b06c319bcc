"""Check cadence's attention backends on a CUDA GPU, in one command (under 5 minutes on an H200).

1. kernels: every installed backend against ``sdpa`` (fp32 math, rounded once) on random mixed
   paged batches: decodes with long ragged contexts (split-K), prefills over cached prefixes,
   GQA ratios, head dims 64/128, block sizes 16/32 (and 256 for FlashAttention's paged path); then
   sliding windows and logit soft-capping against their fp64 definition (Mistral's, Gemma 2's heads);
2. engine: SmolLM2-135M-Instruct greedy output with each backend on the GPU against the CPU
   reference (``sdpa`` on the CPU): fp32 runs must be equal token for token; bf16 runs are
   compared with the CPU's bf16 run and reported (bf16 may part ways at a near tie);
3. timing: decode and prefill per backend (one layer's ``forward``: cache write + attention) with
   the achieved memory bandwidth against the device's peak (windowed cases count only the keys in
   the windows: a kernel that reads past them shows several times the peak).

    python benchmarks/gpu_check.py                 # everything, on cuda
    python benchmarks/gpu_check.py --skip timing   # or --skip kernels / engine
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --quick   # dry run of this script

Exits 1 when a strict check fails (kernel mismatch, fp32 token mismatch, an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import itertools
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from cuda_timer import time_cuda

from cadence.backends.base import AttentionBackend
from cadence.backends.registry import available_backends, load_backend
from cadence.backends.testing import (
    PagedBatch,
    large_paged_batch,
    naive_reference,
    random_paged_batch,
    run_backend,
    sdpa_reference,
)

START = time.perf_counter()
BUDGET_S = 270.0  # stop starting timing cases past this, to stay under 5 minutes

# Spec-sheet HBM bandwidth (bytes/s) by device-name fragment, first match wins.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12),
    ("GH200", 4.0e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12), ("A800", 2.039e12), ("L40S", 0.864e12), ("L40", 0.864e12), ("L4", 0.3e12),
    ("A10G", 0.6e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12), ("V100", 0.9e12),
]


@dataclass
class Outcome:
    section: str
    name: str
    ok: bool | None  # None: informative only
    detail: str


OUTCOMES: list[Outcome] = []


def record(section: str, name: str, ok: bool | None, detail: str) -> None:
    OUTCOMES.append(Outcome(section, name, ok, detail))
    mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
    print(f"  [{mark}] {name}: {detail}", flush=True)


def guarded(section: str, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # one broken case must not hide the others
        record(section, name, False, f"ERROR {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=4)


def elapsed() -> float:
    return time.perf_counter() - START


# ---- environment ------------------------------------------------------------------------------

def describe(device: torch.device) -> float | None:
    """Print the environment; return the device's peak memory bandwidth (bytes/s) when known."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("triton", "flash_attn"):
        if importlib.util.find_spec(package) is not None:
            versions[package] = getattr(__import__(package), "__version__", "?")
    print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("backends installed:", ", ".join(available_backends()),
          f"| TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    if device.type != "cuda":
        print(f"device: {device} (dry run: no bandwidth figures)")
        return None
    props = torch.cuda.get_device_properties(device)
    peak = next((bw for fragment, bw in PEAK_BANDWIDTH if fragment in props.name), None)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    derived = 2 * clock * 1e3 * width / 8 if clock and width else None  # DDR: two transfers a clock
    peak = peak or derived
    print(f"device: {props.name}, sm {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB; peak bandwidth: spec {_gbs(peak)}, "
          f"from clocks {_gbs(derived)}, copy measured {_gbs(copy_bandwidth(device))}")
    return peak


def copy_bandwidth(device: torch.device) -> float:
    """Achieved device-to-device copy bandwidth (read + write) of a 1 GiB tensor."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * 2**30 / time_cuda(functools.partial(dst.copy_, src), device)


def _gbs(bandwidth: float | None) -> str:
    return "n/a" if bandwidth is None else f"{bandwidth / 1e9:,.0f} GB/s"


# ---- 1. kernels against sdpa ------------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim): Llama-3-8B, SmolLM2, MHA, Qwen2-7B-like (group 7)
SHAPES = [(32, 8, 128), (9, 3, 64), (16, 16, 64), (28, 4, 128)]
MIXED = [(0, 300), (1000, 1), (4000, 1), (17, 64), (0, 1), (2500, 130), (31, 1), (0, 7)]
DECODES = [(n * 377 % 2000 + 1, 1) for n in range(32)]
QUICK_MIXED = [(0, 20), (25, 1), (100, 1), (5, 9), (0, 1)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def kernel_checks(names: list[str], device: torch.device, quick: bool) -> None:
    print("\n== 1. backends against sdpa (fp32 reference rounded once) ==", flush=True)
    shapes = SHAPES[:2] if quick else SHAPES
    batches = [("mixed", QUICK_MIXED)] if quick else [("mixed", MIXED), ("decodes", DECODES)]
    for name in names:
        for i, (heads, kv_heads, dim) in enumerate(shapes):
            flash = name == "flash_attn"  # also its paged path (blocks of 256); no fp32
            block_sizes = [16, 32][i % 2:i % 2 + 1] + ([256] if flash else [])
            dtypes = [torch.bfloat16] if i else [torch.bfloat16, torch.float16] + ([] if flash else [torch.float32])
            for block_size, dtype, (label, requests) in itertools.product(block_sizes, dtypes, batches):
                case = f"{name} H{heads}/{kv_heads} D{dim} bs{block_size} {_dtype(dtype)} {label}"
                guarded("kernels", case, functools.partial(
                    _kernel_case, name, requests, heads, kv_heads, dim, block_size, dtype, device, case))


def _kernel_case(name: str, requests: list[tuple[int, int]], heads: int, kv_heads: int, dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, case: str) -> None:
    batch = random_paged_batch(requests, heads, kv_heads, dim, block_size, dtype, device, seed=len(case))
    backend = make_backend(name, batch, device)
    out, k_cache, v_cache = run_backend(backend, batch)
    ref_out, ref_k, ref_v = sdpa_reference(batch)
    cache_ok = torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    error = (out.float() - ref_out.float()).abs()
    bound = TOLERANCE[dtype] * (1 + ref_out.float().abs())
    ok = cache_ok and bool((error <= bound).all())
    record("kernels", case, ok, f"max |err| {error.max().item():.2e}, cache {'exact' if cache_ok else 'DIFFERS'}")


def backends_for(device: torch.device) -> list[str]:
    names = []
    for name in ("sdpa", "triton", "flash_attn"):
        try:
            load_backend(name, device)
            names.append(name)
        except (RuntimeError, ValueError) as exc:
            record("setup", f"{name} backend", None, f"not run: {exc}")
    return names


def make_backend(name: str, batch: PagedBatch, device: torch.device, **options: Any) -> AttentionBackend:
    """``options``: the backend's keyword arguments (``sliding_window``, ``logits_soft_cap``)."""
    cls = load_backend(name, device, batch.q.dtype, batch.head_dim, batch.k_cache.shape[1])
    return cls(batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.head_dim ** -0.5, **options)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# (label, sliding window, soft-cap); with a cap, q is scaled so that the random scores pass it.
WINDOW_CASES = [("window 1", 1, None), ("window 50", 50, None), ("window 1000", 1000, None),
                ("window past every context", 1 << 20, None), ("soft-cap 2", None, 2.0),
                ("window 1000 soft-cap 2", 1000, 2.0)]
# Decodes past the window (split-K over it), prompts and chunks over prefixes shorter and longer than it;
# small, as the reference computes one token at a time.
WINDOW_BATCH = [(0, 32), (3000, 1), (1500, 1), (17, 33), (1100, 9), (40, 1)]
QUICK_WINDOW_BATCH = [(0, 20), (100, 1), (9, 9), (40, 1)]
# ((heads, KV heads, head dim), block size, dtype): Mistral-7B, Gemma-2-2B (bf16 only, as it is served)
WINDOW_CONFIGS = [((32, 8, 128), 16, torch.float32), ((32, 8, 128), 16, torch.bfloat16),
                  ((32, 8, 128), 256, torch.bfloat16), ((8, 4, 256), 16, torch.bfloat16),
                  ((8, 4, 256), 256, torch.bfloat16)]


def window_checks(names: list[str], device: torch.device, quick: bool) -> None:
    print("\n== 1b. sliding windows and soft-capping against their definition (fp64) ==", flush=True)
    requests = QUICK_WINDOW_BATCH if quick else WINDOW_BATCH
    for (heads, kv_heads, dim), block_size, dtype in WINDOW_CONFIGS[:2] if quick else WINDOW_CONFIGS:
        # FlashAttention wherever in half precision, and alone on its paged path (blocks of 256)
        users = [n for n in names if (dtype != torch.float32 if n == "flash_attn" else block_size == 16)]
        if not users:
            continue
        batch = random_paged_batch(requests, heads, kv_heads, dim, block_size, dtype, device, seed=dim)
        for label, window, cap in WINDOW_CASES:
            tag = f"H{heads}/{kv_heads} D{dim} bs{block_size} {_dtype(dtype)} {label}"
            guarded("windows", tag, functools.partial(_window_case, users, batch, tag, window, cap))


def _window_case(names: list[str], batch: PagedBatch, tag: str, window: int | None, cap: float | None) -> None:
    """Every backend in ``names`` against one reference: fp64, token by token (on the CPU)."""
    if cap is not None:
        batch = dataclasses.replace(batch, q=batch.q * 8)
    ref = naive_reference(batch, batch.head_dim ** -0.5, window, cap)
    for name in names:
        backend = make_backend(name, batch, batch.q.device, sliding_window=window, logits_soft_cap=cap)
        error = (run_backend(backend, batch)[0].double() - ref).abs()
        ok = bool((error <= TOLERANCE[batch.q.dtype] * (1 + ref.abs())).all())
        record("windows", f"{name} {tag}", ok, f"max |err| {error.max().item():.2e}")


# ---- 2. the engine on SmolLM2 -----------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime.", "Explain what a KV cache is in one sentence.",
             "Translate 'good morning' into Spanish, French and German.", "What is 17 times 23?"]


def engine_checks(names: list[str], device: torch.device, max_tokens: int, quick: bool) -> None:
    print("\n== 2. engine: SmolLM2-135M-Instruct greedy, GPU backends against the CPU reference ==", flush=True)
    from cadence import LLM, SamplingParams
    from cadence.models.loader import default_model_path, resolve_model

    model = resolve_model(default_model_path())  # converts the GGUF once (cached)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in (QUESTIONS[:2] if quick else QUESTIONS)]

    def generate(backend: str, dtype: str, on: torch.device, **kwargs: Any) -> list[list[int]]:
        llm = LLM(model=model, dtype=dtype, device=on.type, attention_backend=backend,
                  num_threads=os.cpu_count() if on.type == "cpu" else None, **kwargs)
        try:
            outputs = llm.chat(conversations, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]
        finally:
            del llm
            gc.collect()
            if on.type == "cuda":
                torch.cuda.empty_cache()

    cpu = torch.device("cpu")
    start = time.perf_counter()
    reference = {"float32": generate("sdpa", "float32", cpu), "bfloat16": generate("sdpa", "bfloat16", cpu)}
    print(f"  CPU references in {time.perf_counter() - start:.1f}s; first answer: "
          f"{_decode(model, reference['float32'][0])!r}", flush=True)
    # FlashAttention: no fp32, and also its paged path (blocks of 256); the dry run: bf16 on sdpa only
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (name, dtype, {}) for name in names for dtype in ("float32", "bfloat16")
        if not (name == "flash_attn" and dtype == "float32") and not (quick and name != "sdpa" and dtype == "bfloat16")]
    runs += [("flash_attn", "bfloat16", {"block_size": 256})] if "flash_attn" in names else []
    for name, dtype, kwargs in runs:
        case = f"{name} {dtype}" + "".join(f" {k}={v}" for k, v in kwargs.items())
        guarded("engine", case, functools.partial(_engine_case, case, functools.partial(
            generate, name, dtype, device, **kwargs), reference[dtype], strict=dtype == "float32"))


def _engine_case(case: str, run: Callable[[], list[list[int]]], reference: list[list[int]], strict: bool) -> None:
    tokens = run()
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    detail = f"{same}/{len(reference)} answers equal to the CPU's"
    if same < len(reference):
        first = [_common_prefix(a, b) for a, b in zip(tokens, reference, strict=True) if a != b]
        detail += f"; the others part at token {first}"
    record("engine", case, (same == len(reference)) if strict else None, detail)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _decode(model: str, tokens: list[int]) -> str:
    from cadence.models.loader import load_tokenizer

    return str(load_tokenizer(model).decode(tokens, skip_special_tokens=True))


# ---- 3. timing --------------------------------------------------------------------------------

# (label, requests as (cached, new)); Llama-3-8B attention: 32 query heads over 8 KV heads, D 128.
DECODE_CASES = [
    ("decode B1 ctx4k", [(4095, 1)]), ("decode B1 ctx32k", [(32767, 1)]),
    ("decode B16 ctx4k", [(4095, 1)] * 16), ("decode B64 ctx4k", [(4095, 1)] * 64),
    ("decode B256 ctx1k", [(1023, 1)] * 256), ("decode B128 ctx8k", [(8191, 1)] * 128),
]
PREFILL_CASES = [
    ("prefill 1x2048", [(0, 2048)]), ("prefill 4x512", [(0, 512)] * 4),
    ("extend 512 on 3584", [(3584, 512)]), ("mixed 2x512 + 64 decodes", [(0, 512)] * 2 + [(2047, 1)] * 64),
]
# (label, requests, sliding window): what is outside the window should cost nothing.
WINDOW_TIMING = [("decode B16 ctx32k window 4k", [(32767, 1)] * 16, 4096),
                 ("extend 512 on 16k window 4k", [(16383, 512)], 4096)]


def timing(names: list[str], device: torch.device, peak: float | None, quick: bool) -> None:
    print("\n== 3. timing: one layer's forward (cache write + attention), bf16, H32/8 D128 ==", flush=True)
    scale = 64 if quick else 1  # the dry run shrinks contexts
    rows: list[str] = []
    cases = DECODE_CASES[:2] + PREFILL_CASES[:1] if quick else DECODE_CASES + PREFILL_CASES
    for label, requests, window in [(*case, None) for case in cases] + WINDOW_TIMING:
        requests = [(c // scale, max(1, n // scale) if n > 1 else 1) for c, n in requests]
        window = None if window is None else window // scale
        if elapsed() > BUDGET_S:
            print(f"  {label}: skipped (time budget)")
            continue
        batch = large_paged_batch(requests, 32, 8, 128, 16, torch.bfloat16, device)
        for name in names:
            for block_size in ([16, 256] if name == "flash_attn" else [16]):
                b = batch if block_size == 16 else large_paged_batch(requests, 32, 8, 128, block_size, torch.bfloat16,
                                                               device)
                guarded("timing", f"{name} {label}", functools.partial(
                    _time_case, rows, name, label, b, requests, device, peak, block_size, window))
        del batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n  {'backend':<18}{'case':<28}{'time':>11}{'GB/s':>9}{'% peak':>8}{'TFLOP/s':>9}")
    for row in rows:
        print("  " + row)


def _time_case(rows: list[str], name: str, label: str, batch: PagedBatch, requests: list[tuple[int, int]],
               device: torch.device, peak: float | None, block_size: int, window: int | None) -> None:
    backend = make_backend(name, batch, device, sliding_window=window)
    meta = backend.build_metadata(batch.layout, device)
    k_cache, v_cache = backend.to_kv_cache_layout(batch.k_cache), backend.to_kv_cache_layout(batch.v_cache)
    seconds = time_cuda(lambda: backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, meta), device)
    item = batch.q.element_size()
    w = window or 1 << 62
    # K and V of every context token some query sees read once; q read, out written; the new K/V written.
    context = sum(c + n - max(0, c - w + 1) for c, n in requests)
    new = sum(n for _, n in requests)
    moved = item * (2 * context * batch.num_kv_heads * batch.head_dim + 2 * new * batch.num_heads * batch.head_dim
                    + 2 * new * batch.num_kv_heads * batch.head_dim)
    # QK^T and PV over the visible (causal, in-window) pairs only
    pairs = sum(min(c + i + 1, w) for c, n in requests for i in range(n))
    flops = 4 * pairs * batch.num_heads * batch.head_dim
    bandwidth = moved / seconds
    share = f"{100 * bandwidth / peak:.0f}%" if peak else "n/a"
    tag = name if block_size == 16 else f"{name} bs{block_size}"
    rows.append(f"{tag:<18}{label:<28}{seconds * 1e6:>9.0f}us{bandwidth / 1e9:>9.0f}{share:>8}"
                f"{flops / seconds / 1e12:>9.1f}")


# ---- main -------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the script")
    parser.add_argument("--skip", action="append", default=[], choices=["kernels", "engine", "timing"])
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per engine answer")
    parser.add_argument("--quick", action="store_true", help="few, small cases (for a dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU paths (use --device cpu --quick for a dry run)")
        return 2
    peak = describe(device)
    names = backends_for(device)
    torch.manual_seed(0)
    if "kernels" not in args.skip:
        kernel_checks(names, device, args.quick)
        window_checks(names, device, args.quick)
    if "engine" not in args.skip:
        guarded("engine", "setup", lambda: engine_checks(names, device, args.max_tokens, args.quick))
    if "timing" not in args.skip:
        timing(names, device, peak, args.quick)
    failed = [o for o in OUTCOMES if o.ok is False]
    passed = sum(o.ok is True for o in OUTCOMES)
    print(f"\n== summary: {passed} passed, {len(failed)} failed, "
          f"{sum(o.ok is None for o in OUTCOMES)} informative, {elapsed():.0f}s ==")
    for o in failed:
        print(f"  FAIL {o.section}: {o.name}: {o.detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
