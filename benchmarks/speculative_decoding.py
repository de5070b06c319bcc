"""Speculative decoding (n-gram, or a draft model) against decoding one token a step, in the same run.

Three workloads, each run without and with ``--speculative-config`` (two engines, the same
requests; a warm-up request first):

- **copy**: one user at a time, each prompt a chat asking to repeat a source file from
  ``benchmarks/data/copy_heavy/`` with one name changed (the work speculation is for);
- **random**: one user at a time, prompts of random token ids, sampled at temperature 1 (nothing to
  copy: speculation must back off, and cost at most 5%; seeded, so both runs emit the same tokens);
- **batch**: 64 requests at once, random prompts (W1's shape; speculation must turn itself down
  where a large batch makes verification cost throughput).

Both engines stay alive in this process and take turns at each request (the batch: each round),
``--repeats`` times (``engine_runs.py``: the machine's drift between minutes exceeds the 5% the
random goal allows); prints the output tokens/s of each, the ratio with its 95% interval, and the
drafted and accepted tokens per repeat. A benchmark, never a test:

    python benchmarks/speculative_decoding.py [--quantization none --dtype bfloat16 --num-threads 2]
    python benchmarks/speculative_decoding.py --draft-layers 8 \
        --speculative-config '{"num_speculative_tokens": 4, "quantization": "int8"}'
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from engine_runs import Unit, add_model_options, interleave, ratio, runs_json, tokens_per_s

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


def workloads() -> list[tuple[str, list[Any], SamplingParams, bool, bool]]:
    """Name, prompts, parameters, one request at a time (else all at once), chat."""
    rng = random.Random(0)
    randoms = [[rng.randrange(1000, 40000) for _ in range(256)] for _ in range(4 + 64)]
    return [
        ("copy", copy_prompts(), SamplingParams(temperature=0, max_tokens=384), True, True),
        # Sampled: greedy decoding of random prompts falls into loops, which drafts predict well.
        ("random", randoms[:4], SamplingParams(temperature=1.0, seed=0, max_tokens=128, ignore_eos=True), True, False),
        ("batch", randoms[4:68], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), False, False),
    ]


def units(speculation: dict[str, Counter[str]], only: set[str]) -> list[Unit]:
    """Each single-stream request, and the whole batch, as a unit; the speculating engine's counts
    go to ``speculation`` by workload."""
    made: list[Unit] = []
    for name, prompts, params, single, chat in workloads():
        if name not in only:
            continue
        for batch in [[p] for p in prompts] if single else [prompts]:
            def work(label: str, llm: LLM, batch: list[Any] = batch, params: SamplingParams = params,
                     chat: bool = chat, name: str = name) -> int:
                before = spec_stats(llm)
                outputs = llm.chat(batch, params, use_tqdm=False) if chat else llm.generate(batch, params,
                                                                                             use_tqdm=False)
                after = spec_stats(llm)
                if before is not None and after is not None:
                    speculation[name].update(drafted=after.num_draft_tokens - before.num_draft_tokens,
                                             accepted=after.num_accepted_tokens - before.num_accepted_tokens)
                return sum(len(o.outputs[0].token_ids) for o in outputs)
            made.append((name, work))
    return made


def spec_stats(llm: LLM) -> SpecDecodeStats | None:
    speculation = llm.engine_core.scheduler.speculation
    return None if speculation is None else speculation.stats()


def draft_config(ns: argparse.Namespace) -> dict[str, Any]:
    """``--speculative-config`` with the model's first ``--draft-layers`` layers as its draft model."""
    folder = resolve_model(ns.model)
    dest = cache_dir() / "drafts" / f"{Path(folder).name}-{ns.draft_layers}-layers"
    if not (dest / "model.safetensors").is_file():
        truncate_model(folder, dest, ns.draft_layers)
    return {**json.loads(ns.speculative_config), "method": "draft_model", "model": str(dest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 8}')
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="draft with the model's first N layers instead (a draft_model built once in cadence's "
                             "cache; --speculative-config then gives its other keys)")
    parser.add_argument("--workloads", default="copy,random,batch", help="which to run, comma-separated")
    ns = parser.parse_args()
    if ns.draft_layers is not None:
        ns.speculative_config = json.dumps(draft_config(ns))
    engines = {}
    for label, spec in (("off", None), ("on", ns.speculative_config)):
        engines[label] = LLM(model=ns.model, quantization=ns.quantization, dtype=ns.dtype, num_threads=ns.num_threads,
                             speculative_config=spec, enable_prefix_caching=False)
        engines[label].generate([[1000 + i for i in range(64)]], SamplingParams(max_tokens=16), use_tqdm=False)
    speculation: dict[str, Counter[str]] = defaultdict(Counter)
    runs = interleave(engines, units(speculation, set(ns.workloads.split(","))), ns.repeats)
    print(f"{'workload':8} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} {'95% interval':>13} {'drafted':>8} "
          f"{'accepted':>9}   ({ns.repeats} repeats, interleaved)")
    summary = {}
    for name in runs["off"]:
        off, on = tokens_per_s(runs["off"][name]), tokens_per_s(runs["on"][name])
        mid, low, high = ratio(runs["off"][name], runs["on"][name])
        drafted, accepted = (speculation[name][k] // ns.repeats for k in ("drafted", "accepted"))
        summary[name] = {"off_tok_s": off, "on_tok_s": on, "ratio": mid, "interval": [low, high],
                         "drafted": drafted, "accepted": accepted}
        print(f"{name:8} {off:10.1f} {on:10.1f} {mid:7.2f} {f'{low:.2f}-{high:.2f}':>13} {drafted:8d} {accepted:9d}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"summary": summary, "runs": runs_json(runs)}, indent=2))


if __name__ == "__main__":
    main()
