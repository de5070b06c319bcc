"""Structured-output overhead: a batch of JSON-schema requests vs the same batch unconstrained.

Same prompts (chat, SmolLM2-135M-Instruct, greedy). The constrained run goes first; the unconstrained
run then generates exactly as many tokens per request (``max_tokens`` set to each constrained output's
length, EOS ignored), so both runs do the same model work and the ratio of output tokens/s measures
what the grammars cost per step: filling the bitmask, masking the logits and advancing the matchers
(the grammars compile in the warm-up run; later runs find them in the engine's cache). Each run is
repeated and the median kept (the machine is shared). A benchmark, never a test.

    python benchmarks/structured_output.py [--num-requests 32 --repeats 5 --dtype bfloat16 --num-threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from cadence import LLM, SamplingParams
from cadence.sampling_params import StructuredOutputsParams

_TEXT = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "required": ["name", "age", "hobbies"], "properties": {
        "name": _TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": _TEXT, "maxItems": 3}}}),
    ("a book", {"type": "object", "required": ["title", "author", "year"], "properties": {
        "title": _TEXT, "year": {"type": "integer"},
        "author": {"type": "object", "required": ["first", "last"], "properties": {"first": _TEXT, "last": _TEXT}}}}),
    ("a weather report", {"type": "object", "required": ["city", "temperature_c", "condition"], "properties": {
        "city": _TEXT, "temperature_c": {"type": "number"}, "condition": {"enum": ["sunny", "cloudy", "rain"]}}}),
    ("a task list", {"type": "object", "required": ["tasks"], "properties": {"tasks": {
        "type": "array", "maxItems": 3, "items": {"type": "object", "required": ["title", "done"],
                                                  "properties": {"title": _TEXT, "done": {"type": "boolean"}}}}}}),
]
SUBJECTS = ["a library", "a city", "a hobby", "a pet", "a holiday", "a friend", "a job", "a garden"]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[int]]:
    """Seconds for the batch, and each request's output length."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on each constrained output")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()

    llm = LLM(model=ns.model, dtype=ns.dtype, num_threads=ns.num_threads)
    picks = [(SCHEMAS[i % len(SCHEMAS)], SUBJECTS[i % len(SUBJECTS)]) for i in range(ns.num_requests)]
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Describe {what} related to {subject} as JSON."}])
               for (what, _), subject in picks]
    constrained = [SamplingParams(temperature=0, max_tokens=ns.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=schema)) for (_, schema), _ in picks]
    _, lengths = run(llm, prompts, constrained)  # warm-up: the compiler, the grammars, the model
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    run(llm, prompts, free)

    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for _ in range(ns.repeats):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            elapsed, got = run(llm, prompts, params)
            assert got == lengths, f"{name} run produced other lengths: the comparison would be unfair"
            times[name].append(elapsed)
    tokens = sum(lengths)
    rates = {name: tokens / statistics.median(values) for name, values in times.items()}
    ratio = rates["constrained"] / rates["unconstrained"]
    print(f"{ns.num_requests} requests, {tokens} output tokens per run (median of {ns.repeats})")
    for name, rate in rates.items():
        print(f"  {name:>13}: {rate:8.1f} output tokens/s  runs: {', '.join(f'{t:.2f}s' for t in times[name])}")
    print(f"constrained / unconstrained: {ratio:.1%}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"tokens": tokens, "tokens_per_s": rates, "seconds": times, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
