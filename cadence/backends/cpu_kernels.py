"""cadence's C++ CPU kernels (``csrc/``), compiled with torch's extension builder on first use.

``paged_attention.cpp`` reads decode attention straight from the paged KV cache; ``layer_ops.cpp``
fuses a decoder layer's per-token ops (RMSNorm with its residual add, RoPE, SiLU-and-multiply);
``bf16_linear.cpp`` is the bf16 GEMM of the linear layers on CPUs with AVX512-BF16; ``greedy.cpp``
is the sampler's argmax.
The build runs once per machine: about 85 CPU-seconds here (48 s on 2 cores), so it says so on the
``cadence.startup`` logger before and after, with a progress bar of the files compiled on a
terminal. torch caches it under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
so later processes load it in about 0.1 s, silently. The cache is one folder per name, not per
checkout: two checkouts sharing it rebuild it in turn, its build file naming the sources' paths.
Where the kernels cannot run (no AVX-512, no C++ compiler, a failed build) :func:`cpu_ops` returns
None and callers keep their torch-op path, after one warning that says why.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from cadence.startup_log import startup

logger = logging.getLogger(__name__)

_NAME = "cadence_cpu_kernels"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "bf16_linear.cpp", "greedy.cpp")
# The instruction sets the kernels use (the build targets exactly these, not the build machine); no
# contraction of a multiply and an add into one FMA where torch rounds the product first.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# The build's cost, measured on a 2-core AVX-512 machine: about 85 CPU-seconds in all, the three large
# sources about 25 s each (mostly torch's headers and -O3), greedy.cpp 10 s; ninja compiles them in
# parallel, so the wall time is about the larger of the slowest file and the total over the cores.
_BUILD_CPU_S = 90.0
_SLOWEST_SOURCE_S = 25.0
# A build not foreseen (flags or torch changed, another process building) is announced once it has
# taken this long; a cached load takes about 0.1 s.
_UNFORESEEN_BUILD_S = 2.0
_POLL_S = 0.5


@functools.cache
def cpu_ops() -> Any | None:
    """``torch.ops.cadence_cpu`` (``store_kv``, ``paged_attention``, ``rms_norm``, ``add_rms_norm``,
    ``silu_and_mul``, ``rotary_embedding``, ``bf16_linear_supported``, ``pack_bf16_linear``,
    ``bf16_linear``, ``argmax_rows``; signatures in ``csrc/``), or None where the kernels cannot run here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.info("cadence CPU kernels off: the CPU lacks AVX-512 (%s); using torch ops", capability)
        return None
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_directory()
        with _BuildProgress(build_dir):
            load(_NAME, sources=[str(_CSRC / name) for name in _SOURCES], extra_cflags=_FLAGS,
                 extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)],
                 build_directory=None if build_dir is None else str(build_dir), is_python_module=False)
    except Exception as exc:  # a missing compiler or a failed build: the torch path still works
        logger.warning("cadence CPU kernels unavailable, using torch ops instead: %s", exc)
        return None
    return torch.ops.cadence_cpu


def runs_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` on ``device`` go through the kernels (building them if needed)."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and cpu_ops() is not None


def _build_directory() -> Path | None:
    """Where torch builds and caches the kernels (``$TORCH_EXTENSIONS_DIR/cadence_cpu_kernels`` ...),
    or None if torch no longer says (the build then goes unwatched, announced only once slow)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(_NAME, False))
    except Exception:  # a private helper of torch's: its absence must not cost the kernels
        return None


def _needs_build(build_dir: Path | None) -> bool:
    """Whether ``load`` will compile: no library yet, or one older than a source or header."""
    if build_dir is None:
        return False
    library = build_dir / f"{_NAME}.so"
    if not library.is_file():
        return True
    built = library.stat().st_mtime
    return any(source.stat().st_mtime > built for source in _CSRC.iterdir() if source.suffix in (".cpp", ".h"))


def build_estimate_s() -> int:
    """About how long the build takes on this machine's cores, in seconds (rounded to 5)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    estimate = max(_SLOWEST_SOURCE_S, _BUILD_CPU_S / min(cores, len(_SOURCES)))
    return 5 * math.ceil(estimate / 5)


def _terminal() -> TextIO | None:
    """stderr where it is a terminal and start-up lines show: where a progress bar may be drawn."""
    stream = sys.stderr
    return stream if startup.isEnabledFor(logging.INFO) and stream is not None and stream.isatty() else None


class _BuildProgress:
    """Around ``load``: a line before and after a build, and on a terminal a bar of the object files
    written (compiles then the link), with the elapsed time; nothing for a cached load.

    A build foreseen (:func:`_needs_build`) is announced at once, any other once it has taken
    ``_UNFORESEEN_BUILD_S``.
    """

    def __init__(self, build_dir: Path | None) -> None:
        self._dir = build_dir
        self._delay = 0.0 if _needs_build(build_dir) else _UNFORESEEN_BUILD_S
        self._done = threading.Event()
        self._announced = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cadence-kernel-build", daemon=True)
        self._start = self._wall_start = 0.0

    def __enter__(self) -> _BuildProgress:
        self._start, self._wall_start = time.monotonic(), time.time()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join()
        if self._announced.is_set() and exc is None:
            where = "" if self._dir is None else f" (cached in {self._dir})"
            startup.info("compiled the CPU kernels in %.1f s%s", time.monotonic() - self._start, where)

    def _watch(self) -> None:
        if self._done.wait(self._delay):
            return
        self._announced.set()
        estimate = build_estimate_s()
        startup.info("compiling the CPU kernels, once per machine (about %d s) ...", estimate)
        terminal = _terminal()
        if terminal is None:
            return  # the two lines only, in logs and tests
        from tqdm import tqdm

        steps = len(_SOURCES) + 1  # the compiles, then the link
        with tqdm(total=steps, desc="compiling CPU kernels", file=terminal, leave=False, mininterval=0,
                  bar_format="{desc} |{bar}| {n}/{total} files [{elapsed} of about "
                             f"{tqdm.format_interval(estimate)}]") as bar:
            while True:
                finished = self._done.wait(_POLL_S)
                bar.update(max(0, min(self._written(), steps) - bar.n))
                bar.refresh()  # the elapsed time, between files
                if finished:
                    break

    def _written(self) -> int:
        """Object files and the library written since the build began (1 s slack for coarse mtimes)."""
        if self._dir is None:
            return 0
        try:
            return sum(1 for f in self._dir.iterdir()
                       if f.suffix in (".o", ".so") and f.stat().st_mtime >= self._wall_start - 1)
        except OSError:  # a file replaced while listed
            return 0
