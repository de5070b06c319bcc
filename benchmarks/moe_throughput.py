"""cadence against transformers on a Qwen3-MoE-shaped model (Qwen3-30B-A3B scaled down to 0.75 B
parameters, random weights: benchmarks/shaped_models.py), offline, in the same run.

The workload, the same on both sides: 32 random token-id prompts of 128 tokens (cadence's random
dataset, seed 0), 128 greedy output tokens each with EOS ignored, bf16, prefix caching off, context
length 256. cadence runs it through ``cadence bench throughput``, transformers through ``cadence
bench throughput --backend hf`` (one batched ``generate`` of all the prompts, left-padded, eager
attention). Each run is a process of its own, the two alternating for ``--pairs`` pairs (3); printed:
each pair's output tokens/s and cadence / transformers, then the medians.

    python benchmarks/moe_throughput.py                                       # the full workload
    python benchmarks/moe_throughput.py --num-prompts 4 --output-len 8 --layers 2 --pairs 1   # smoke

A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shaped_models import Side, Workload, add_workload_arguments, model_folder, run_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, num_prompts=32, pairs=3)
    ns = parser.parse_args()
    folder = model_folder("qwen3-moe", ns.layers)
    workload = Workload.from_args(ns)
    print(f"model: {folder}", flush=True)
    sides = (Side("cadence", lambda out: workload.cadence_command(folder, out)),
             Side("transformers", lambda out: workload.cadence_command(folder, out, backend="hf")))
    results = run_pairs(sides, ns.pairs, ns.log_dir)
    if ns.output_json:
        report: dict[str, Any] = {"model": str(folder), "workload": vars(workload), "runs": results}
        Path(ns.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
