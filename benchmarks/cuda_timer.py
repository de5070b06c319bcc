"""The timer of the GPU benchmarks (``gpu_check.py``, ``gpu_launch_floor.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA events; wall clock on the CPU), after warm-up."""
    for _ in range(3):
        fn()
    samples = []
    if device.type != "cuda":
        for _ in range(2):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(samples)
