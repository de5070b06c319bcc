"""LoRA adapters against the base model, in the same run (docs/lora.md).

Two workloads (random prompt tokens, greedy, EOS ignored, prefix caching off): **batch**, 64
requests at once (W1's shape: 128 tokens in, 128 out), and **single**, one request of 128 in and 256
out (one user's decode speed). Three engines, side by side in this process, take turns at each
workload ``--repeats`` times (``engine_runs.py``; a warm-up request first):

- **base**: the base model, LoRA off;
- **lora-off-rows**: ``--enable-lora`` but no request names an adapter (what enabling costs);
- **4-adapters**: the 64 requests spread over 4 adapters of rank 16 on all seven projections
  (``--max-loras 4 --max-lora-rank 16``; the goal: at least 0.8x base's output tokens/s), and the
  single request on one of them.

The adapters are written here in PEFT's format with random weights (no training, no download).
Prints the output tokens/s of each and the ratio to base, with its 95% interval. A benchmark, never a test:

    python benchmarks/lora.py [--quantization none --dtype bfloat16] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from engine_runs import add_model_options, interleave, ratio, runs_json, tokens_per_s
from safetensors.torch import save_file

from cadence import LLM, LoRARequest, SamplingParams
from cadence.lora.adapter import TARGETS, AdapterLimits
from cadence.models.loader import load_hf_config, resolve_model

LABELS = ("base", "lora-off-rows", "4-adapters")


def write_adapter(folder: Path, limits: AdapterLimits, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of ``rank`` on every decoder projection, with random weights."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(limits.num_layers):
        for kind, (fan_in, fan_out) in limits.shapes:
            group = "self_attn" if kind in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{group}.{kind}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) / rank ** 0.5 / 8
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return folder


def engines(ns: argparse.Namespace) -> tuple[dict[str, LLM], list[LoRARequest]]:
    """The three engines, warmed up, and the 4 adapters."""
    warm = [random.Random(1).randrange(1000, 40000) for _ in range(128)]
    made = {}
    for label in LABELS:
        lora_args: dict[str, Any] = {} if label == "base" else {"enable_lora": True, "max_loras": 4,
                                                                "max_lora_rank": 16}
        made[label] = LLM(model=ns.model, quantization=ns.quantization, dtype=ns.dtype, num_threads=ns.num_threads,
                          enable_prefix_caching=False, **lora_args)
        made[label].generate([warm], SamplingParams(max_tokens=16), use_tqdm=False)
    limits = AdapterLimits.of(load_hf_config(resolve_model(ns.model)), 16)
    folder = Path(tempfile.mkdtemp(prefix="cadence-lora-bench-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(folder / f"a{i}", limits, 16, i))) for i in range(4)]
    made["4-adapters"].generate([warm] * 4, SamplingParams(max_tokens=4), lora_request=adapters, use_tqdm=False)
    return made, adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    ns = parser.parse_args()
    llms, adapters = engines(ns)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(65)]

    def work(batch: list[list[int]], max_tokens: int) -> Callable[[str, LLM], int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        def run(label: str, llm: LLM) -> int:
            loras = [adapters[i % 4] for i in range(len(batch))] if label == "4-adapters" else None
            outputs = llm.generate(batch, params, lora_request=loras, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outputs)
        return run

    runs = interleave(llms, [("batch", work(prompts[:64], 128)), ("single", work(prompts[64:], 256))], ns.repeats)
    print(f"{'workload':8} {'engine':14} {'out tok/s':>10} {'vs base':>8} {'95% interval':>14}"
          f"   ({ns.repeats} repeats, interleaved)")
    summary: dict[str, dict[str, Any]] = {}
    for workload in ("batch", "single"):
        for label in LABELS:
            tok_s = tokens_per_s(runs[label][workload])
            mid, low, high = ratio(runs["base"][workload], runs[label][workload])
            summary.setdefault(workload, {})[label] = {"tok_s": tok_s, "ratio": mid, "interval": [low, high]}
            print(f"{workload:8} {label:14} {tok_s:10.1f} {mid:8.2f} {f'{low:.2f}-{high:.2f}':>14}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"summary": summary, "runs": runs_json(runs)}, indent=2))


if __name__ == "__main__":
    main()
