"""Offline throughput, cadence vs transformers' batched ``generate``: same requests, same run, one ratio.

Default workload (the engine foundation issue's): 64 random prompts of 128 tokens, 128 greedy output
tokens each with EOS ignored, bf16, SmolLM2-135M-Instruct. Any ``cadence bench throughput`` flag
works here too. A benchmark, never a test.

    python benchmarks/throughput.py [--dtype bfloat16 --num-prompts 64 --input-len 128 --output-len 128]
"""

from __future__ import annotations

import argparse
import json

from cadence.bench.throughput import add_arguments, load_requests, run_cadence, run_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(dtype="bfloat16", disable_tqdm=True)
    ns = parser.parse_args()
    requests = load_requests(ns)
    ours = run_cadence(ns, requests)
    print(ours.summary())
    baseline = run_hf(ns, requests)
    print(baseline.summary())
    ratio = ours.output_tokens_per_s / baseline.output_tokens_per_s
    print(f"cadence / transformers output tokens/s: {ratio:.2f}x")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"cadence": ours.to_json(), "hf": baseline.to_json(), "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
