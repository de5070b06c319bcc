"""The KV memory one long request holds on Gemma 3 270M (3 global layers, 15 sliding ones with a
window of 512), with the hybrid KV cache manager (KV cache groups: the sliding groups give back
blocks out of their window) and without it (one block table for all layers, every block kept).

The request: a prompt of ``--prompt-len`` (4000) random token ids and ``--output-len`` (96) greedy
tokens, bf16, block size 16, prefix caching off, ``--max-num-batched-tokens`` (512) per step.
Printed for each side: the KV bytes held (blocks held times the bytes of a block of each side)
at its peak and on the last decode step, and the decode speed.

    python benchmarks/hybrid_kv_memory.py                                  # the 4k-token request
    python benchmarks/hybrid_kv_memory.py --prompt-len 600 --output-len 8   # smoke

A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from cadence import LLM, SamplingParams
from cadence.messages import SchedulerOutput
from cadence.models.kv_groups import kv_cache_groups_of
from cadence.models.layers import head_dim_of

MIB = 1 << 20


def run(hybrid: bool, prompt: list[int], output_len: int, budget: int) -> dict[str, float]:
    llm = LLM(model="gemma3-270m", dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=budget,
              max_model_len=len(prompt) + output_len, disable_hybrid_kv_cache_manager=not hybrid)
    config = llm.engine_core.hf_config
    groups = kv_cache_groups_of(config, hybrid)
    block_bytes = (2 * groups.group_size * llm.config.cache.block_size * config.num_key_value_heads
                   * head_dim_of(config) * torch.bfloat16.itemsize)
    scheduler = llm.engine_core.scheduler
    allocator = scheduler.allocator
    held: list[int] = []
    schedule = scheduler.schedule

    def counting_schedule() -> SchedulerOutput:
        output = schedule()
        held.append(allocator.num_blocks - 1 - allocator.num_free_blocks)
        return output

    scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"groups": groups.num_groups, "peak_mib": max(held) * block_bytes / MIB,
            "last_mib": held[-1] * block_bytes / MIB, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    ns = parser.parse_args()
    prompt = [random.Random(0).randrange(1000, 200000) for _ in range(ns.prompt_len)]
    print(f"one request: {ns.prompt_len} prompt + {ns.output_len} output tokens, "
          f"{ns.max_num_batched_tokens} tokens per step", flush=True)
    results = {hybrid: run(hybrid, prompt, ns.output_len, ns.max_num_batched_tokens) for hybrid in (False, True)}
    for hybrid, r in results.items():
        print(f"{'hybrid' if hybrid else 'one table'} ({r['groups']:.0f} groups): peak {r['peak_mib']:.1f} MiB, "
              f"last decode step {r['last_mib']:.1f} MiB; {r['seconds']:.1f} s")
    print(f"hybrid / one table: peak {results[True]['peak_mib'] / results[False]['peak_mib']:.2f}, "
          f"last step {results[True]['last_mib'] / results[False]['last_mib']:.2f}")


if __name__ == "__main__":
    main()
