"""The worker: sets up the device and threads, loads the model, sizes and allocates the KV cache.

Under tensor parallelism there is one worker per rank, each holding its shard of the model and a
KV cache for its own KV heads.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from cadence.backends.registry import load_backend
from cadence.config import CacheConfig, EngineConfig, threads_per_rank
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.partition import head_shard
from cadence.executor.draft_model import load_draft_model
from cadence.executor.malloc_tuning import keep_freed_memory
from cadence.executor.model_runner import ModelRunner
from cadence.executor.sampler import Sampler, SamplerOutput
from cadence.executor.sampling_plan import SamplingRow
from cadence.executor.speculation import Drafter
from cadence.lora.manager import LoRAManager
from cadence.messages import ModelRunnerOutput, SchedulerOutput
from cadence.models.kv_groups import kv_cache_groups_of
from cadence.models.layers import head_dim_of
from cadence.models.loader import load_model
from cadence.quantization.packed import model_row_limit
from cadence.startup_log import startup

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30


class Worker:
    """One rank's model, KV cache and model runner (the only rank under the uni executor).

    ``local_rank`` picks the CUDA device on a machine with several, counted from the configured
    device's index (uni and mp: :meth:`ParallelConfig.device_index`; Ray gives each actor one
    visible GPU, so 0).
    """

    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, group: ParallelGroup = SINGLE_RANK,
                 local_rank: int = 0) -> None:
        start = time.monotonic()
        # Start-up progress on the driver rank only (the others' lines would repeat it).
        progress = startup.info if group.is_driver else logger.info
        device = _rank_device(config.device.torch_device, local_rank)
        keep_freed_memory()
        if config.device.num_threads is not None or config.parallel.world_size_across_dp > 1:
            torch.set_num_threads(threads_per_rank(config.device, config.parallel))
        # Unseeded sampling draws from the global generator (on rank 0, wherever that runs).
        torch.manual_seed(config.model.seed)
        dtype = config.model.torch_dtype
        head_dim = head_dim_of(hf_config)
        backend_cls = load_backend(config.device.attention_backend, device, dtype, head_dim,
                                   config.cache.block_size)
        backend_cls.prepare(device, dtype)  # compiles kernels on a first start (announced there)
        quantization = config.model.quantization
        weights = str(dtype).removeprefix("torch.") + ("" if quantization == "none" else f", {quantization} weights")
        progress("loading weights: %s (%s, %s backend)", config.model.gguf_file or config.model.path, weights,
                 backend_cls.name)
        model = load_model(config.model.path, hf_config, dtype, device, backend_cls, group, quantization,
                           config.model.gguf_file, config.model.enforce_eager)
        # Steps of more rows than this take a float GEMM: the cost model prices the rows under it apart.
        self.kernel_row_limit = model_row_limit(model, dtype, device)
        num_kv_heads = model.num_kv_heads  # this rank's
        # Every rank sizes its pool for rank 0's KV heads (no rank holds more), so all ranks agree on
        # the block count the allocator hands out.
        most_kv_heads = head_shard(hf_config.num_attention_heads, hf_config.num_key_value_heads, 0,
                                   group.world_size).kv.size
        # A block spans the layers of one KV cache group: group_size cache tensors, shared by the
        # groups (docs/architecture.md, "KV cache groups").
        groups = kv_cache_groups_of(hf_config, config.cache.hybrid_kv_cache)
        self.num_blocks = num_kv_blocks(config.cache, groups.group_size, most_kv_heads, head_dim, dtype)
        tensors = backend_cls.allocate_kv_caches(groups.group_size, self.num_blocks, config.cache.block_size,
                                                 num_kv_heads, head_dim, dtype, device)
        sampler = BroadcastSampler(group) if group.world_size > 1 else None
        drafter = self._drafter(config, group, device) if group.is_driver else None  # rank 0's drafts leave
        lora = None if config.lora is None else LoRAManager(model, config.lora, dtype, device)
        self.runner = ModelRunner(model, model.attn_backend, [tensors[slot] for slot in groups.slot_of_layer],
                                  config.cache.block_size, device, sampler, groups.group_of_layer, drafter, lora)
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in tensors)
        ranks = f", rank {group.rank} of {group.world_size}" if group.world_size > 1 else ""
        progress("KV cache: %d blocks of %d tokens (%.2f GiB%s); ready in %.1f s", self.num_blocks,
                 config.cache.block_size, kv_bytes / (1 << 30), ranks, time.monotonic() - start)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def _drafter(self, config: EngineConfig, group: ParallelGroup, device: torch.device) -> Drafter | None:
        """Speculative decoding's proposer: n-gram lookups, or a draft model (unsharded, on the driver
        rank, with a KV pool of the target's block count)."""
        speculative = config.speculative
        if speculative is None:
            return None
        if speculative.draft is None:
            return Drafter(speculative)
        startup.info("loading the draft model: %s", speculative.draft.gguf_file or speculative.draft.path)
        draft = load_draft_model(speculative.draft, config.device.attention_backend, device, self.num_blocks,
                                 config.cache.block_size, speculative.num_speculative_tokens)
        return Drafter(speculative, draft)


class BroadcastSampler(Sampler):
    """Rank 0 samples and broadcasts its tokens; the other ranks take them.

    Every rank appends the same tokens to its persistent batch, and no rank's randomness (seeded or
    not) can make it diverge. Only rank 0's output, with its logprobs, leaves the worker.
    """

    def __init__(self, group: ParallelGroup) -> None:
        super().__init__()
        self.group = group

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if self.group.is_driver:
            out = super().__call__(logits, rows)
            self.group.broadcast(torch.tensor(out.token_ids, dtype=torch.long, device=logits.device))
            return out
        tokens = self.group.broadcast(torch.empty(len(rows), dtype=torch.long, device=logits.device))
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=None)


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda" or local_rank == 0:
        return device  # as configured
    rank_device = torch.device("cuda", (device.index or 0) + local_rank)
    torch.cuda.set_device(rank_device)
    return rank_device


def num_kv_blocks(cache: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Blocks of ``num_layers`` layers each that fit the configured memory (or the configured
    count), null block included."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = 2 * num_layers * cache.block_size * num_kv_heads * head_dim * dtype.itemsize
    memory = cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    blocks = math.floor(memory / bytes_per_block)
    if blocks < 2:
        raise ValueError(f"kv_cache_memory of {memory} bytes holds no KV block "
                         f"(one block needs {bytes_per_block} bytes); raise --kv-cache-memory")
    return blocks
