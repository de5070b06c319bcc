"""The engine's configuration: a tree of frozen dataclasses, built once and validated at the boundary.

Each component receives only its own part. Values that depend on the model (its context length,
the default dtype) are resolved by :func:`cadence.models.loader.resolve_model` before the tree is
built, so nothing here is mutated afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_MEMORY_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
                 "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30}


class ConfigError(ValueError):
    """A configuration value a user chose is not usable; the message says what to change."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and at what precision. ``path`` is a resolved folder or ``.gguf`` file."""

    path: str
    dtype: str
    max_model_len: int
    seed: int = 0
    # How the weights are kept (resolve_quantization): floats of ``dtype``, the GGUF file's own
    # quantized types (read from ``gguf_file``), or int8 per output channel (docs/quantization.md).
    quantization: str = "none"
    gguf_file: str | None = None
    # Run the layers op by op from Python, never as the model's faster path (models/decoder_stack.py).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {self.dtype!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {list(QUANTIZATIONS)} or 'auto', got {self.quantization!r}")
        _require(self.quantization != "gguf" or self.gguf_file is not None,
                 "quantization 'gguf' keeps a GGUF file's quantized weights: give a .gguf model file")
        _require(self.max_model_len >= 2, f"max_model_len must be at least 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory (or how many blocks) it gets."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # a block's key (cadence/core/block_hash.py)
    # Sliding and global layers in KV cache groups of their own (cadence/models/kv_groups.py).
    hybrid_kv_cache: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                 f"block_size must be a power of two up to 128, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_blocks must be at least 2 (one is the null block), got {self.num_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        check_hash_algo(self.prefix_caching_hash_algo)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits per step and the scheduling policy (an entry point in ``cadence.policies``)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's prefill chunk
    # Waiting requests one step admits at most (0: no cap): a burst of short prompts then gets its
    # first tokens a few at a time instead of all at the end of one long step.
    max_prompts_per_step: int = 0
    # Steps with decodes are sized to end within this (ms); 0: only the token budget sizes a step.
    target_itl_ms: float = 0.0
    policy: str = "fcfs"
    policy_options: dict[str, str] = field(default_factory=dict)
    # A JSONL file for every scheduling decision about each request (core/scheduling_trace.py).
    trace_scheduling: str | None = None
    # LoRA: the most adapters the running requests may use at once (0: LoRA off, no limit).
    max_loras: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        _require(self.long_prefill_token_threshold >= 0,
                 f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        _require(self.max_prompts_per_step >= 0,
                 f"max_prompts_per_step must be >= 0, got {self.max_prompts_per_step}")
        _require(self.target_itl_ms >= 0, f"target_itl_ms must be >= 0, got {self.target_itl_ms}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# --speculative-config's keys that take text; the others take integers.
_SPECULATIVE_TEXT_KEYS = ("method", "model", "quantization")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``--speculative-config`` takes it (docs/speculative_decoding.md).

    ``ngram`` drafts the tokens that followed the latest earlier occurrence of the sequence's last
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, in its prompt and output.
    ``draft_model`` drafts with a second, smaller ``model`` (a folder, ``.gguf`` file or alias, as
    ``--model`` takes; its weights kept as ``quantization`` says) that shares the target's
    vocabulary: its greedy continuation. Drafting stops while more than ``disable_by_batch_size``
    requests run: a large batch is no longer bound by reading the weights, and verifying drafts then
    costs throughput.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 8
    model: str | None = None
    quantization: str = "auto"
    # The draft model resolved (EngineArgs.create_config): not a key users give.
    draft: ModelConfig | None = None

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        _require(1 <= self.num_speculative_tokens <= 16,
                 f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 "prompt_lookup_min must be at least 1 and at most prompt_lookup_max, got "
                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require(self.disable_by_batch_size >= 1,
                 f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        _require((self.model is not None) == (self.method == "draft_model"),
                 "--speculative-config: method 'draft_model' needs a 'model' (the draft's path), "
                 "and only it takes one")

    @property
    def uses_draft_model(self) -> bool:
        """Whether proposals take a model's forwards (n-gram lookups cost next to nothing)."""
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """``--speculative-config``'s JSON (or ``LLM(speculative_config={...})``'s dict); None: off.

        :raises ConfigError: for JSON that does not parse, or a key or value this config does not take.
        """
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)} - {"draft"}
        unknown = sorted(set(value) - known)
        _require(not unknown, f"--speculative-config does not take {unknown}; it takes {sorted(known)}")
        for key, item in value.items():
            if key in _SPECULATIVE_TEXT_KEYS:
                _require(isinstance(item, str), f"--speculative-config: {key} must be a string, got {item!r}")
            else:
                _require(isinstance(item, int) and not isinstance(item, bool),
                         f"--speculative-config: {key} must be an integer, got {item!r}")
        return cls(**value)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (``--enable-lora``, docs/lora.md): at most ``max_loras`` adapters in one step
    (each worker keeps that many adapter slots in every adapted layer), each of rank at most
    ``max_lora_rank``, and ``max_cpu_loras`` adapters kept loaded (least recently used goes first)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        _require(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def num_cached(self) -> int:
        """How many adapters a worker keeps loaded."""
        return self.max_cpu_loras or self.max_loras


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split (tensor parallel ranks) and how many engine cores serve (data parallel).

    ``distributed_executor_backend``: ``uni`` runs one worker in the engine core's process, ``mp``
    starts one worker process per tensor-parallel rank, ``ray`` places the ranks as Ray actors.
    None picks ``uni`` for one rank and ``mp`` for more.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_rank: int = 0  # which engine core this is; set per engine core by its launcher
    router: str = "prefix-aware"  # which engine core serves a request (entry point in cadence.routers)

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        _require(self.data_parallel_size >= 1,
                 f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        _require(0 <= self.data_parallel_rank < self.data_parallel_size,
                 f"data_parallel_rank must be in [0, {self.data_parallel_size}), got {self.data_parallel_rank}")
        _require(self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
                 f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                 f"got {self.distributed_executor_backend!r}")
        _require(not (self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1),
                 "the uni executor runs one worker; use mp or ray for tensor_parallel_size > 1")
        # Each engine core connects on its own: without an address, each would start a local Ray
        # instance of its own, and they would compete for the same cores and GPUs.
        _require(not (self.distributed_executor_backend == "ray" and self.data_parallel_size > 1
                      and not os.environ.get("RAY_ADDRESS")),
                 "data_parallel_size > 1 with the ray executor needs one Ray cluster for every engine core: "
                 "start it (ray start --head) and set RAY_ADDRESS, or use --distributed-executor-backend mp")

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def world_size_across_dp(self) -> int:
        """Every worker of every engine core: what one machine's cores are shared among."""
        return self.tensor_parallel_size * self.data_parallel_size

    def device_index(self, tp_rank: int) -> int:
        """The accelerator a rank of this engine core uses when every engine core's ranks share one
        machine (the mp and uni executors): engine core ``d``'s ranks take devices ``d * tp`` on."""
        return self.data_parallel_rank * self.tensor_parallel_size + tp_rank


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and with how many intra-op threads (None: every core)."""

    device: str = "cpu"
    num_threads: int | None = None
    attention_backend: str | None = None  # None: chosen by device

    def __post_init__(self) -> None:
        _require(self.num_threads is None or self.num_threads >= 1,
                 f"num_threads must be at least 1, got {self.num_threads}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per request per step
    lora: LoRAConfig | None = None  # None: requests cannot name an adapter

    def for_data_parallel_rank(self, rank: int) -> EngineConfig:
        """This configuration for engine core ``rank`` of ``data_parallel_size``."""
        return replace(self, parallel=replace(self.parallel, data_parallel_rank=rank))

    def __post_init__(self) -> None:
        if not self.scheduler.enable_chunked_prefill:
            _require(self.scheduler.max_num_batched_tokens >= self.model.max_model_len,
                     f"without chunked prefill, max_num_batched_tokens ({self.scheduler.max_num_batched_tokens})"
                     f" must be at least max_model_len ({self.model.max_model_len}) so every prompt fits a step")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a container's cpuset), else
    every core the machine has."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """Intra-op threads when ``--num-threads`` is not given: ``$OMP_NUM_THREADS`` where set to a
    positive number (as torch and every OpenMP program read it), else every usable core."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else usable_cores()


def threads_per_rank(device: DeviceConfig, parallel: ParallelConfig) -> int:
    """``--num-threads``, else an equal share of the default threads for each worker of every
    engine core (tensor times data parallel): processes that each use every core run several
    times slower than one."""
    return device.num_threads or max(1, default_threads() // parallel.world_size_across_dp)


def cache_dir() -> Path:
    """cadence's cache folder, ``$CADENCE_CACHE_DIR`` or ``~/.cache/cadence``: converted GGUF models
    (``gguf/``, :mod:`cadence.models.loader`) and the compiled CPU kernels (``kernels/``,
    :mod:`cadence.backends.cpu_kernels`)."""
    return Path(os.environ.get("CADENCE_CACHE_DIR") or Path.home() / ".cache" / "cadence")


def parse_memory(text: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int of bytes -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ConfigError(f"cannot read memory size {text!r}; write e.g. 2GiB, 512MB or a byte count")
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


QUANTIZATIONS = ("none", "gguf", "int8")
# The digests a KV block's prefix-cache key may take (cadence/core/block_hash.py).
HASH_ALGOS = ("sha256", "xxhash")


def check_hash_algo(algo: str) -> str:
    """``algo`` if it names a block hash algorithm; a ConfigError naming the choices otherwise."""
    _require(algo in HASH_ALGOS, f"prefix caching hash algorithm must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
    return algo


def resolve_quantization(quantization: str, gguf_file: str | None, device: str = "cpu") -> str:
    """``auto`` keeps a GGUF file's quantized types (``gguf``) on the CPU, whose kernel runs them,
    and runs any other model, or any model on another device (which has no kernel for them: the
    weights would be kept twice, quantized and dequantized), unquantized."""
    if quantization != "auto":
        return quantization
    return "gguf" if gguf_file is not None and torch.device(device).type == "cpu" else "none"


def resolve_dtype(dtype: str) -> str:
    """``auto`` is bf16 where cadence has a bf16 GEMM for the CPU, else fp32: native bf16 (AVX512-BF16,
    AMX), or AVX2 with FMA and F16C, whose kernel widens bf16 weights in registers
    (``backends/csrc/bf16_linear_avx2.cpp``). On such a CPU bf16 now runs the default model's 32-decode
    steps about a fifth faster than fp32 and its prefills a tenth, one stream level (docs/quantization.md)."""
    if dtype != "auto":
        return dtype
    if torch.cuda.is_available():
        return "bfloat16"
    return "bfloat16" if _cpu_runs_bf16() else "float32"


_CPUINFO = "/proc/cpuinfo"


def _cpu_runs_bf16() -> bool:
    try:
        with open(_CPUINFO) as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & flags) or {"avx2", "fma", "f16c"} <= flags
