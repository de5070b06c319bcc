"""cadence's C++ CPU kernels (``csrc/``), compiled with torch's extension builder on first use.

``paged_attention.cpp`` reads decode attention straight from the paged KV cache; ``layer_ops.cpp``
fuses a decoder layer's per-token ops (RMSNorm with its residual add, RoPE, SiLU-and-multiply);
``bf16_linear.cpp`` is the bf16 GEMM of the linear layers on CPUs with AVX512-BF16,
``quant_linear.cpp`` the GEMM over quantized weights on CPUs with AVX512-VNNI; ``greedy.cpp``
is the sampler's argmax, ``race.cpp`` its random choice (an exponential race).
The build runs once per set of sources: about 80 CPU-seconds here (41-48 s on 2 cores), so it says so
on the ``cadence.startup`` logger before and after, with a progress bar of the files compiled on a
terminal. It goes into a folder of cadence's cache, ``<cache>/kernels/<key>/`` (:func:`cadence.config.cache_dir`:
``$CADENCE_CACHE_DIR`` or ``~/.cache/cadence``; ``$TORCH_EXTENSIONS_DIR`` plays no part), where
the key (:func:`build_key`) hashes the bytes of every ``.cpp`` and ``.h`` of ``csrc/``, the compile
flags, the torch version and the Python ABI: checkouts with the same sources share one build, and
different sources never overwrite each other's. The sources are compiled from a copy in the
folder's ``src/``, so the build file names the same paths whichever checkout wrote it. Later
processes load it in about 0.1 s, silently.
Processes take turns in a folder under an advisory lock (``build_lock.py``: waiting at most
``$CADENCE_KERNEL_LOCK_TIMEOUT_S`` for another one's build, and clearing a torch ``lock`` file a
killed build left).
With AVX2 but not AVX-512 the same sources build over SIMDe (``csrc/vec.h``), where the VNNI and
BF16 GEMMs say they do not run; ``quant_linear_avx2.cpp``, equal to ``quant_linear.cpp`` bit for bit,
and ``bf16_linear_avx2.cpp``, the bf16 GEMM of CPUs without AVX512-BF16, are a library of their own
for any CPU with AVX2 (:func:`avx2_ops`). Where no kernels run (neither
instruction set, no compiler, a failed build) :func:`cpu_ops` returns None and callers keep their
torch-op path, after one warning that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from cadence.backends.build_lock import UNFORESEEN_BUILD_S, build_lock
from cadence.config import cache_dir, usable_cores
from cadence.startup_log import startup

logger = logging.getLogger(__name__)

_NAME = "cadence_cpu_kernels"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("paged_attention.cpp", "attention_packed.cpp", "decode_dot.cpp", "layer_ops.cpp", "bf16_linear.cpp",
            "quant_linear.cpp", "quant_rows.cpp", "greedy.cpp", "race.cpp", "logit_filters.cpp",
            "top_k_rows.cpp", "penalties.cpp", "decoder_stack.cpp")
# The instruction sets the kernels use (the build targets exactly these, not the build machine); no
# contraction of a multiply and an add into one FMA where torch rounds the product first.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"]
_LDFLAGS = ["-fopenmp"]
_AVX2_NAME = "cadence_cpu_avx2"
_AVX2_SOURCES = ("quant_linear_avx2.cpp", "bf16_linear_avx2.cpp")
_AVX2_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
# On the 2-core AVX2 machine (2026-12-03): its one file 41 s; the main kernels over SIMDe 178 s of
# wall time (242 CPU-seconds, unevenly over the cores: these make that the 2-core estimate).
_AVX2_BUILD_S = 45.0
_AVX2_MAIN_BUILD_CPU_S = 350.0
_AVX2_MAIN_SLOWEST_S = 60.0
# Part of the build key: bump it when the build folder's layout or its locking changes.
_LAYOUT = 1
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# The build's cost, measured on a 2-core AVX-512 machine: 74-85 CPU-seconds in all (41 s of wall time
# with quant_linear.cpp's templates among them), the large sources about 15-25 s each (mostly torch's
# headers and -O3), greedy.cpp 10 s; with decoder_stack.cpp and quant_rows.cpp (2026-12-02) 110
# CPU-seconds, 64-69 s of wall time. ninja compiles them in parallel, so the wall time is about the
# larger of the slowest file and the total over the cores.
_BUILD_CPU_S = 110.0
_SLOWEST_SOURCE_S = 25.0
# A build not foreseen (flags or torch changed, another process building) is announced once it has
# taken this long; a cached load takes about 0.1 s.
_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class _Library:
    """One build of ``csrc/``: name, sources, flags, its name in start-up lines, its cost in seconds."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    what: str
    build_cpu_s: float
    slowest_source_s: float


def _main() -> _Library:
    """The AVX-512 kernels, as the module's constants say now (tests replace them)."""
    return _Library(_NAME, tuple(_SOURCES), tuple(_FLAGS), "the CPU kernels", _BUILD_CPU_S, _SLOWEST_SOURCE_S)


def _main_over_avx2() -> _Library:
    """The same kernels built for AVX2 over SIMDe (its version in the flags: a new one rebuilds)."""
    import simde_py

    simde = [f"-I{simde_py.get_include()}", f"-DCADENCE_SIMDE={importlib.metadata.version('simde-py')}", "-Wno-psabi"]
    return dataclasses.replace(_main(), flags=(*_AVX2_FLAGS, *simde), what="the CPU kernels (AVX2 build)",
                               build_cpu_s=_AVX2_MAIN_BUILD_CPU_S, slowest_source_s=_AVX2_MAIN_SLOWEST_S)


def _avx2() -> _Library:
    return _Library(_AVX2_NAME, _AVX2_SOURCES, tuple(_AVX2_FLAGS), "the AVX2 kernels",
                    _AVX2_BUILD_S, _AVX2_BUILD_S)


@functools.cache
def cpu_ops() -> Any | None:
    """``torch.ops.cadence_cpu`` (the ops the ``TORCH_LIBRARY_FRAGMENT`` blocks of ``csrc/`` define, and
    the classes ``Linear`` and ``DecoderStack`` in ``torch.classes.cadence_cpu``), or None where none run."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):
        logger.info("cadence CPU kernels off: the CPU lacks AVX-512 and AVX2 (%s); using torch ops", capability)
        return None
    return torch.ops.cadence_cpu if _load(_main() if capability == "AVX512" else _main_over_avx2()) else None


def row_ops(x: torch.Tensor) -> Any | None:
    """:func:`cpu_ops` where its row kernels (the sampler's: argmax, filters, race, top-k, penalties)
    take ``x``: float32 ``[B, V]`` on the CPU with dense rows; else None (torch ops run)."""
    dense_rows = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    return cpu_ops() if dense_rows else None


@functools.cache
def avx2_ops() -> Any | None:
    """``torch.ops.cadence_avx2`` (``quant_linear[_supported]`` as ``cadence_cpu``'s, ``bf16_linear[_supported]``,
    ``pack_bf16_linear``), or None where the CPU lacks AVX2, FMA or F16C or the build failed."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not _load(_avx2()):
        return None
    ops = torch.ops.cadence_avx2
    return ops if ops.quant_linear_supported() else None


def build_for(device: torch.device, dtype: torch.dtype) -> str:
    """The build of the kernels an engine on ``device`` in ``dtype`` runs on this CPU (its
    :func:`build_key`), or "none" where it runs torch's ops: what a step time measured here depends on
    besides the model and threads. Read from the sources; nothing is built."""
    capability = torch.backends.cpu.get_cpu_capability()
    if device.type != "cpu" or dtype not in KERNEL_DTYPES or capability not in ("AVX512", "AVX2"):
        return "none"
    return build_key(library=_main() if capability == "AVX512" else _main_over_avx2())


# Paged attention's bf16 paths, by the switches (use_amx, use_bf16_dot) that select them: packed keys
# on the tile unit, packed keys by VDPBF16PS (decodes reading bf16 pairs), and the fp32 path.
ATTENTION_PATHS = {"amx": (True, False), "bf16_dot": (False, True), "fp32": (False, False)}


@contextlib.contextmanager
def attention_path(ops: Any, name: str) -> Iterator[bool]:
    """Paged attention's bf16 path ``name`` (:data:`ATTENTION_PATHS`) switched on in ``ops`` for the block:
    True, or False where this CPU has no such path; every path the CPU has on again after (tests and
    benchmarks compare them in one process)."""
    amx, dot = ATTENTION_PATHS[name]
    try:
        yield ops.use_amx(amx) == amx and ops.use_bf16_dot(dot) == dot
    finally:
        ops.use_amx(True)
        ops.use_bf16_dot(True)


def attention_takes_prefills() -> bool:
    """Whether the paged-attention kernel also takes steps with prefill rows: on AVX-512. Over SIMDe it
    ran prefills 4-8x slower than torch's SDPA, decodes as fast or faster (docs/performance.md)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _load(library: _Library) -> bool:
    """Builds ``library`` unless its folder has a current build, and loads it; False (warned) on failure."""
    try:
        from torch.utils.cpp_extension import load

        sources = _kernel_sources()
        key = build_key(sources, library)
        build_dir = _build_directory(key, library)
        with build_lock(build_dir):
            src = _stage_sources(build_dir, sources)
            with _BuildProgress(build_dir, key, library):
                load(_module_name(key, library), sources=[str(src / name) for name in library.sources],
                     extra_cflags=list(library.flags), extra_ldflags=_LDFLAGS, extra_include_paths=[str(src)],
                     build_directory=str(build_dir), is_python_module=False)
    except Exception as exc:  # a missing compiler or a failed build: the torch path still works
        logger.warning("cadence: %s unavailable, using torch ops instead: %s", library.what, exc)
        return False
    return True


def runs_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` on ``device`` go through the kernels (building them if needed)."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and cpu_ops() is not None


def _kernel_sources() -> dict[str, bytes]:
    """Every file of ``csrc/`` the build reads (the sources and the headers they include), by name."""
    return {path.name: path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.suffix in (".cpp", ".h")}


def build_key(sources: Mapping[str, bytes] | None = None, library: _Library | None = None) -> str:
    """The build folder's name: a hash of the kernel files' names and bytes (``csrc/``'s by default),
    the library's name and the files it compiles, the compile and link flags, the torch version and
    the Python ABI."""
    library = library or _main()
    digest = hashlib.sha256()

    def part(data: bytes) -> None:  # length-prefixed: no two lists of parts hash alike
        digest.update(len(data).to_bytes(8, "little") + data)

    part(json.dumps([_LAYOUT, library.name, [*library.sources], [*library.flags], _LDFLAGS, torch.__version__,
                     sys.implementation.cache_tag, getattr(sys, "abiflags", "")]).encode())
    for name, data in sorted((_kernel_sources() if sources is None else sources).items()):
        part(name.encode())
        part(data)
    return digest.hexdigest()[:16]


def _build_directory(key: str | None = None, library: _Library | None = None) -> Path:
    """Where the kernels of this key (default: ``csrc/``'s) are built and cached: ``<cache>/kernels/<key>``."""
    return cache_dir() / "kernels" / (build_key(None, library) if key is None else key)


def _module_name(key: str, library: _Library | None = None) -> str:
    """The library's name, one per key: torch renames (``_v1``) a name met again with other sources."""
    return f"{(library or _main()).name}_{key}"


def _stage_sources(build_dir: Path, sources: Mapping[str, bytes]) -> Path:
    """``build_dir/src`` holding ``sources``, written where missing or different (atomically, so
    their times change only then): the paths the build file names, the same for every checkout."""
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name, data in sources.items():
        target = src / name
        if target.is_file() and target.read_bytes() == data:
            continue
        partial = src / f".{name}.{os.getpid()}.tmp"
        partial.write_bytes(data)
        os.replace(partial, target)
    return src


def _needs_build(build_dir: Path, key: str, library: _Library) -> bool:
    """Whether ``load`` will compile: no library yet, or one older than a staged source or header."""
    built_file = build_dir / f"{_module_name(key, library)}.so"
    if not built_file.is_file():
        return True
    built = built_file.stat().st_mtime
    return any(source.stat().st_mtime > built for source in (build_dir / "src").iterdir()
               if source.suffix in (".cpp", ".h"))


def build_estimate_s(library: _Library | None = None) -> int:
    """About how long the build takes on this machine's cores, in seconds (rounded to 5)."""
    library = library or _main()
    estimate = max(library.slowest_source_s, library.build_cpu_s / min(usable_cores(), len(library.sources)))
    return 5 * math.ceil(estimate / 5)


def _terminal() -> TextIO | None:
    """stderr where it is a terminal and start-up lines show: where a progress bar may be drawn."""
    stream = sys.stderr
    return stream if startup.isEnabledFor(logging.INFO) and stream is not None and stream.isatty() else None


class _BuildProgress:
    """Around ``load``: a line before and after a build, and on a terminal a bar of the object files
    written (compiles then the link), with the elapsed time; nothing for a cached load. A build
    foreseen (:func:`_needs_build`) is announced at once, any other after ``UNFORESEEN_BUILD_S``."""

    def __init__(self, build_dir: Path, key: str, library: _Library) -> None:
        self._dir = build_dir
        self._library = library
        self._delay = 0.0 if _needs_build(build_dir, key, library) else UNFORESEEN_BUILD_S
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
            startup.info("compiled %s in %.1f s (cached in %s)", self._library.what, time.monotonic() - self._start,
                         self._dir)

    def _watch(self) -> None:
        if self._done.wait(self._delay):
            return
        self._announced.set()
        estimate = build_estimate_s(self._library)
        startup.info("compiling %s, once for these sources (about %d s) ...", self._library.what, estimate)
        terminal = _terminal()
        if terminal is None:
            return  # the two lines only, in logs and tests
        from tqdm import tqdm

        steps = len(self._library.sources) + 1  # the compiles, then the link
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
        try:
            return sum(1 for f in self._dir.iterdir()
                       if f.suffix in (".o", ".so") and f.stat().st_mtime >= self._wall_start - 1)
        except OSError:  # a file replaced while listed
            return 0
