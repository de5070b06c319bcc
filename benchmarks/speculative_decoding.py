"""Speculative decoding (n-gram, or a draft model) against decoding one token a step, in the same run.

Three workloads, each run without and with ``--speculative-config`` (two engines, one after the
other, the same requests; a warm-up request first):

- **copy**: one user at a time, each prompt a chat asking to repeat a source file from
  ``benchmarks/data/copy_heavy/`` with one name changed (the work speculation is for);
- **random**: one user at a time, prompts of random token ids, sampled at temperature 1 (nothing to
  copy: speculation must back off, and cost at most 5%; seeded, so both runs emit the same tokens);
- **batch**: 64 requests at once, random prompts (W1's shape; speculation must turn itself down
  where a large batch makes verification cost throughput).

Each engine runs in a process of its own, off and on alternating ``--repeats`` times; prints the
median output tokens/s of each, the ratio, and the acceptance counts. A benchmark, never a test:

    python benchmarks/speculative_decoding.py [--quantization none --dtype bfloat16 --num-threads 2]
    python benchmarks/speculative_decoding.py --draft-layers 8 \
        --speculative-config '{"num_speculative_tokens": 4, "quantization": "int8"}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from engine_runs import add_model_options, alternate

from cadence import LLM, SamplingParams
from cadence.config import cache_dir
from cadence.messages import SpecDecodeStats
from cadence.models.loader import resolve_model
from cadence.models.truncation import truncate_model

DATA = Path(__file__).parent / "data" / "copy_heavy"
RENAMES = {"ngram_proposer.py.txt": ("NgramProposer", "PromptLookup"), "clock.py.txt": ("WallClock", "SystemClock"),
           "step_timing.py.txt": ("StepTiming", "StepTimes")}


def copy_prompts() -> list[list[dict[str, str]]]:
    chats = []
    for name, (old, new) in RENAMES.items():
        source = (DATA / name).read_text()
        chats.append([{"role": "user", "content": f"Rewrite this Python code exactly as it is, but rename {old} "
                                                  f"to {new}. Reply with the code only.\n\n{source}"}])
    return chats


def run(llm: LLM, prompts: list[Any], params: SamplingParams, one_at_a_time: bool, chat: bool) -> tuple[float, int]:
    """Seconds and output tokens for the prompts, one request at a time or all at once."""
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        outputs = llm.chat(batch, params, use_tqdm=False) if chat else llm.generate(batch, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return time.perf_counter() - start, tokens


def spec_stats(llm: LLM) -> SpecDecodeStats | None:
    speculation = llm.engine_core.scheduler.speculation
    return None if speculation is None else speculation.stats()


def measure(ns: argparse.Namespace, spec: str | None) -> dict[str, dict[str, Any]]:
    """Every workload on one engine (``spec``: its speculative config, None for off)."""
    rng = random.Random(0)
    randoms = [[rng.randrange(1000, 40000) for _ in range(256)] for _ in range(4 + 64 + 1)]
    workloads = [  # name, prompts, params, one at a time, chat
        ("copy", copy_prompts(), SamplingParams(temperature=0, max_tokens=384), True, True),
        # Sampled: greedy decoding of random prompts falls into loops, which drafts predict well.
        ("random", randoms[:4], SamplingParams(temperature=1.0, seed=0, max_tokens=128, ignore_eos=True), True, False),
        ("batch", randoms[4:68], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), False, False),
    ]
    llm = LLM(model=ns.model, quantization=ns.quantization, dtype=ns.dtype, num_threads=ns.num_threads,
              speculative_config=spec, enable_prefix_caching=False)
    llm.generate([randoms[-1]], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    results = {}
    for name, prompts, params, single, chat in workloads:
        before = spec_stats(llm)
        seconds, tokens = run(llm, prompts, params, single, chat)
        after = spec_stats(llm)
        entry = results[name] = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
        if before is not None and after is not None:
            entry["drafted"] = after.num_draft_tokens - before.num_draft_tokens
            entry["accepted"] = after.num_accepted_tokens - before.num_accepted_tokens
            entry["verifications"] = after.num_drafts - before.num_drafts
    llm.shutdown()
    return results


def draft_config(ns: argparse.Namespace) -> dict[str, Any]:
    """``--speculative-config`` with the model's first ``--draft-layers`` layers as its draft model."""
    folder = resolve_model(ns.model)
    dest = cache_dir() / "drafts" / f"{Path(folder).name}-{ns.draft_layers}-layers"
    if not (dest / "model.safetensors").is_file():
        truncate_model(folder, dest, ns.draft_layers)
    return {**json.loads(ns.speculative_config), "method": "draft_model", "model": str(dest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, ("off", "on"))
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 8}')
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft with the model's first N layers instead (a draft_model built once in cadence's "
                             "cache; --speculative-config then gives its other keys)")
    ns = parser.parse_args()
    if ns.draft_layers is not None:
        ns.speculative_config = json.dumps(draft_config(ns))
    if ns.only is not None:
        print(json.dumps(measure(ns, None if ns.only == "off" else ns.speculative_config)))
        return
    runs: dict[str, list[dict[str, dict[str, Any]]]] = alternate(("off", "on"), ns.repeats)
    print(f"{'workload':8} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} {'drafted':>8} {'accepted':>9}")
    summary = {}
    for name in runs["off"][0]:
        off = statistics.median(r[name]["tok_s"] for r in runs["off"])
        on = statistics.median(r[name]["tok_s"] for r in runs["on"])
        drafted = sum(r[name].get("drafted", 0) for r in runs["on"]) // ns.repeats
        accepted = sum(r[name].get("accepted", 0) for r in runs["on"]) // ns.repeats
        summary[name] = {"off_tok_s": off, "on_tok_s": on, "ratio": on / off, "drafted": drafted, "accepted": accepted}
        print(f"{name:8} {off:10.1f} {on:10.1f} {on / off:7.2f} {drafted:8d} {accepted:9d}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
