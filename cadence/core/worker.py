"""The worker: sets up the device and threads, loads the model, sizes and allocates the KV cache."""

from __future__ import annotations

import logging
import math

import torch
from transformers import PretrainedConfig

from cadence.backends.registry import load_backend
from cadence.config import CacheConfig, EngineConfig
from cadence.core.model_runner import ModelRunner
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.models.llama import head_dim_of
from cadence.models.loader import load_model

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30


class Worker:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig) -> None:
        device = config.device.torch_device
        if config.device.num_threads is not None:
            torch.set_num_threads(config.device.num_threads)
        dtype = config.model.torch_dtype
        head_dim = head_dim_of(hf_config)
        backend_cls = load_backend(config.device.attention_backend, device, dtype, head_dim,
                                   config.cache.block_size)
        model = load_model(config.model.path, hf_config, dtype, device, backend_cls)
        num_kv_heads = hf_config.num_key_value_heads
        self.num_blocks = num_kv_blocks(config.cache, hf_config.num_hidden_layers, num_kv_heads, head_dim, dtype)
        shape = backend_cls.kv_cache_shape(self.num_blocks, config.cache.block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded reads of unwritten slots are masked, and 0 * NaN would not be.
        kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                     for _ in range(hf_config.num_hidden_layers)]
        backend = backend_cls(hf_config.num_attention_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        self.runner = ModelRunner(model, backend, kv_caches, config.cache.block_size, device)
        logger.info("KV cache: %d blocks of %d tokens (%s backend, %s)", self.num_blocks,
                    config.cache.block_size, backend_cls.name, dtype)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def num_kv_blocks(cache: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Blocks that fit the configured memory (or the configured count), null block included."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = 2 * num_layers * cache.block_size * num_kv_heads * head_dim * dtype.itemsize
    memory = cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    blocks = math.floor(memory / bytes_per_block)
    if blocks < 2:
        raise ValueError(f"kv_cache_memory of {memory} bytes holds no KV block "
                         f"(one block needs {bytes_per_block} bytes); raise --kv-cache-memory")
    return blocks
