"""Benchmark workloads: synthetic random prompts (independent, shaped like ShareGPT, or sharing
prefixes), prompts read from a JSONL / ShareGPT file, or a timed trace (``cadence simulate``'s)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cadence.sampling_params import ExtraArg
from cadence.sim.trace_formats import TraceOptions, load_workload
from cadence.sim.workload import FIRST_ORDINARY_ID, LengthDist

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class BenchRequest:
    """One request to send; a trace's requests also carry when (seconds from the first) and as whom."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    arrival_time: float | None = None
    priority: int = 0
    user: str | None = None
    extra_args: Mapping[str, ExtraArg] | None = None


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """Token-id prompts with lengths drawn uniformly from ``len * [1 - range_ratio, 1 + range_ratio]``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        n_in = length(input_len)
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(prompt, n_in, length(output_len)))
    return requests


def text_of_length(tokenizer: PreTrainedTokenizerBase, ids: list[int], rng: random.Random, tries: int = 10) -> str:
    """Text that ``tokenizer`` encodes (without special tokens) to as many tokens as ``ids``, as vLLM's
    client makes its random prompts (``gen_prompt_decode_to_target_len``). Random ids decoded to text
    do not encode back to as many: byte-level merges join and split them (SmolLM2's random 128-token
    prompts came back as 128-139 tokens, so a burst of 32 no longer filled two 2,048-token steps but
    spilled into a third, which vLLM's client never sent). The ids are cut, or extended with random
    ones, and decoded again, up to ``tries`` times; the last text stands, near the length if not at it."""
    target, text = len(ids), str(tokenizer.decode(ids))
    for _ in range(tries):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == target:
            break
        extra = [rng.randrange(FIRST_ORDINARY_ID, tokenizer.vocab_size) for _ in range(target - len(ids))]
        text = str(tokenizer.decode(ids[:target] + extra))
    return text


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths drawn from two distributions (``cadence simulate``'s forms), each
    clipped to a cap."""

    input_len: LengthDist
    output_len: LengthDist
    max_input_len: int
    max_output_len: int

    def describe(self) -> str:
        return (f"prompt {self.input_len} up to {self.max_input_len} tokens, "
                f"output {self.output_len} up to {self.max_output_len}")


# Lengths shaped like ShareGPT conversations: heavy-tailed prompts and replies, means of about 240
# prompt and 190 output tokens (vLLM's ShareGPT benchmark averages with a Llama tokenizer), spread
# of the logs 1.0 and 0.8, capped to fit a 2,048-token context. Synthetic: the same token ids drawn
# at random as the random dataset, so nothing is shared between prompts.
SHAREGPT_LIKE = LengthMix(LengthDist("lognormal", (240.0, 1.0)), LengthDist("lognormal", (190.0, 0.8)),
                          max_input_len=1024, max_output_len=1024)


def length_mix_requests(num: int, mix: LengthMix, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Token-id prompts and output lengths drawn from ``mix`` with ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = np.minimum(mix.input_len.sample(num, rng), mix.max_input_len)
    outputs = np.minimum(mix.output_len.sample(num, rng), mix.max_output_len)
    return [BenchRequest(rng.integers(FIRST_ORDINARY_ID, vocab_size, size=int(n_in)).tolist(), int(n_in), int(n_out))
            for n_in, n_out in zip(inputs, outputs, strict=True)]


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                               vocab_size: int, seed: int) -> list[BenchRequest]:
    """vLLM's prefix-repetition workload: ``num_prefixes`` random prefixes of ``prefix_len`` tokens
    (a shared system prompt), each request one of them (in turn) and a distinct random suffix of
    ``suffix_len`` tokens (its question)."""
    if num_prefixes < 1:
        raise ValueError(f"the number of prefixes must be at least 1, got {num_prefixes}")
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(count)]

    prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
    return [BenchRequest(prefixes[i % num_prefixes] + tokens(suffix_len), prefix_len + suffix_len, output_len)
            for i in range(num)]


def file_requests(path: str | Path, tokenizer: PreTrainedTokenizerBase, num: int, default_output_len: int,
                  seed: int) -> list[BenchRequest]:
    """Prompts from a ShareGPT JSON file (first human turn; the reply's length sets the output length)
    or a JSONL file of ``{"prompt": ..., "output_len": ...}`` rows; ``num`` of them, sampled with ``seed``."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        pairs = [(row["prompt"], row.get("output_len")) for row in rows]
    else:
        found = [_sharegpt_pair(item, tokenizer) for item in json.loads(text)]
        pairs = [p for p in found if p is not None]
    if not pairs:
        raise ValueError(f"{path} holds no usable prompts")
    rng = random.Random(seed)
    chosen = [pairs[rng.randrange(len(pairs))] for _ in range(num)] if num > len(pairs) else rng.sample(pairs, num)
    return [BenchRequest(prompt, len(tokenizer(prompt).input_ids), out or default_output_len)
            for prompt, out in chosen]


def _sharegpt_pair(item: dict, tokenizer: PreTrainedTokenizerBase) -> tuple[str, int] | None:
    turns = item.get("conversations") or item.get("conversation") or []
    if len(turns) < 2:
        return None
    reply_len = len(tokenizer(turns[1]["value"]).input_ids)
    return turns[0]["value"], max(reply_len, 1)


def trace_requests(path: str | Path, options: TraceOptions, vocab_size: int,
                   num: int | None = None) -> list[BenchRequest]:
    """A trace (any format :mod:`cadence.sim.trace_formats` reads, read with ``options``) as timed
    requests, in arrival order, the first ``num`` (all by default). A prompt given as token ids is
    sent as them; one given as a count gets random ids (seeded), distinct from every other prompt's."""
    specs = load_workload(path, options)[:num]
    rng = random.Random(options.seed)
    return [BenchRequest(
        list(spec.prompt_token_ids) if spec.prompt_token_ids is not None
        else [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(spec.prompt_tokens)],
        spec.prompt_tokens, spec.output_tokens, arrival_time=spec.arrival_time,
        priority=spec.priority, user=spec.user, extra_args=spec.extra_args) for spec in specs]
