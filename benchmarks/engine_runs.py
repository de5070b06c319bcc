"""What the A/B benchmarks of engine options share (``speculative_decoding.py``, ``lora.py``): the
model options, and running the engines under comparison side by side, interleaved.

Every engine stays alive in this process, and each unit of work (one request, or one batch) runs on
every engine in turn, in reverse order every other time, ``--repeats`` times over. This machine's
speed drifts by 10-30% between minutes (docs/speculative_decoding.md): engines in processes of their
own, even alternating, saw different minutes and differed by more than the 5% a goal allows, where
units a few seconds apart see the same machine. The engines of one process take turns on its one
model thread (``UniExecutor``), so they do not slow each other down. A ratio comes with a 95%
bootstrap interval over the paired units.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cadence import LLM

# A unit of work: its workload's name, and the work on one engine (given its label and the engine),
# which returns the output tokens.
Unit = tuple[str, Callable[[str, LLM], int]]


@dataclass(frozen=True)
class Timed:
    seconds: float
    tokens: int


def add_model_options(parser: argparse.ArgumentParser, repeats: int = 3) -> None:
    """The model flags every engine of the comparison shares, and ``--repeats``."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=repeats, help="times each unit of work runs on each engine")
    parser.add_argument("--output-json", default=None)


def interleave(engines: Mapping[str, LLM], units: Sequence[Unit], repeats: int) -> dict[str, dict[str, list[Timed]]]:
    """Each unit on every engine in turn, ``repeats`` times: the timings by engine label and
    workload, in the same order for every engine (so that the i-th of each are a pair)."""
    labels = list(engines)
    results: dict[str, dict[str, list[Timed]]] = {label: {name: [] for name, _ in units} for label in labels}
    turn = 0
    for _ in range(repeats):
        for name, work in units:
            for label in labels if turn % 2 == 0 else labels[::-1]:
                start = time.perf_counter()
                tokens = work(label, engines[label])
                results[label][name].append(Timed(time.perf_counter() - start, tokens))
            turn += 1
    return results


def runs_json(runs: Mapping[str, Mapping[str, Sequence[Timed]]]) -> dict[str, Any]:
    """:func:`interleave`'s timings as plain data, for ``--output-json``."""
    return {label: {name: [asdict(t) for t in timed] for name, timed in by_workload.items()}
            for label, by_workload in runs.items()}


def tokens_per_s(runs: Sequence[Timed]) -> float:
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)


def ratio(base: Sequence[Timed], other: Sequence[Timed], resamples: int = 2000,
          seed: int = 0) -> tuple[float, float, float]:
    """``other``'s output tokens/s over ``base``'s, with the 2.5th and 97.5th percentiles of the
    same ratio over resamples of the pairs (a unit and its repeat on both engines)."""
    pairs = np.array([(b.seconds, b.tokens, o.seconds, o.tokens) for b, o in zip(base, other, strict=True)])
    picks = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    sums = pairs[picks].sum(axis=1)  # resamples x 4
    ratios = (sums[:, 3] / sums[:, 2]) / (sums[:, 1] / sums[:, 0])
    low, high = np.percentile(ratios, [2.5, 97.5])
    return tokens_per_s(other) / tokens_per_s(base), float(low), float(high)
