"""What the A/B benchmarks of engine options share (``speculative_decoding.py``, ``lora.py``): the
model options, and running each engine in a process of its own, alternating.

Each engine runs in a child process (the script itself, with ``--only LABEL``), because two
engines alive in one process run several times slower (their OpenMP pools spin against each
other), and alternating (in reverse every other round) spreads the machine's drift (5-10% between
minutes, more on some days) over every engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def add_model_options(parser: argparse.ArgumentParser, labels: Sequence[str], repeats: int = 3) -> None:
    """The model flags every engine of the comparison shares, ``--repeats``, and the hidden ``--only``."""
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=repeats, help="rounds of the engines, alternating")
    parser.add_argument("--only", choices=labels, help=argparse.SUPPRESS)  # one engine, in a child process
    parser.add_argument("--output-json", default=None)


def alternate(labels: Sequence[str], repeats: int) -> dict[str, list[Any]]:
    """Run this script once per label and round (``--only LABEL``, the other flags as given); each
    run's last line of output, as JSON, by label."""
    runs: dict[str, list[Any]] = {label: [] for label in labels}
    for round_ in range(repeats):
        # Every other round in reverse, so that a machine slowing down (or speeding up) within a
        # round favours no engine.
        for label in labels if round_ % 2 == 0 else labels[::-1]:
            child = subprocess.run([sys.executable, sys.argv[0], *sys.argv[1:], "--only", label],
                                   check=True, capture_output=True, text=True)
            runs[label].append(json.loads(child.stdout.strip().splitlines()[-1]))
    return runs
