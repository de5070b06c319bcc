"""cadence against llama.cpp on the same GGUF file, quantized weights on both sides.

Two workloads, each side in a process of its own per run, alternating for ``--pairs`` pairs
(benchmarks/shaped_models.py: run_pairs), 2 threads, prefix caching off, EOS ignored, greedy:

- ``single``: one user's decode: 1 prompt of 32 tokens, 256 out. llama.cpp through llama-cpp-python
  (this file, with ``--llama-worker``, in its venv): the same prompt, after the same 2-token
  warm-up, timed around the prompt's evaluation and the 256 sampled tokens; cadence through
  ``cadence bench throughput``. Output tokens/s: 256 over that time on both sides.
- ``batched``: 64 prompts of 128 tokens, 128 out each. llama.cpp through its ``llama-batched-bench``
  (``-npl 64 -npp 128 -ntg 128``: the 64 prompts in one batch, then 64 sequences decoded together);
  output tokens/s = 64 x 128 over its whole time (T). cadence as above with 64 prompts.

``--model`` is a .gguf file or a short name (``smollm2``, ``gemma3-270m``). llama.cpp, once:

    python3 -m venv /root/llama-venv && /root/llama-venv/bin/pip install llama-cpp-python
    pip download --no-deps --no-binary :all: llama-cpp-python -d /root/llama-src     # its sdist
    cd /root/llama-src && tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    ninja -C build llama-server llama-batched-bench llama-bench llama-quantize

Then, on a quiet machine:

    python benchmarks/vs_llama_cpp.py --model smollm2 --workload single
    python benchmarks/vs_llama_cpp.py --model smollm2 --workload batched --llama-bin /root/llama-src/.../build/bin

A benchmark, never a test.
"""

from __future__ import annotations

# Only the standard library up here: under --llama-worker this file runs in llama-cpp-python's venv.
import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_LLAMA_PYTHON = "/root/llama-venv/bin/python"
THREADS = 2
WORKLOADS = {"single": (1, 32, 256), "batched": (64, 128, 128)}  # prompts, input length, output length


def llama_worker(ns: argparse.Namespace) -> None:
    """One timed single-stream run in llama-cpp-python's venv, figures to ``--output-json``."""
    from llama_cpp import Llama

    request = json.loads(Path(ns.requests).read_text())[0]
    prompt, output_len = request["prompt"], request["output_len"]
    llm = Llama(model_path=ns.model, n_ctx=len(prompt) + output_len + 8, n_threads=THREADS, n_threads_batch=THREADS,
                n_batch=512, verbose=False)

    def run(tokens: int) -> int:
        llm.reset()
        produced = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # never stops on its own: EOS ignored
            produced += 1
            if produced == tokens:
                break
        return produced

    run(2)  # warm-up
    start = time.perf_counter()
    produced = run(output_len)
    elapsed = time.perf_counter() - start
    figures = {"backend": "llama.cpp", "num_requests": 1, "elapsed_s": elapsed, "output_tokens": produced,
               "output_tokens_per_s": produced / elapsed}
    Path(ns.output_json).write_text(json.dumps(figures, indent=2))
    print(f"llama.cpp: {produced / elapsed:.1f} output tokens/s")


def batched_bench(binary: Path, model: str, prompts: int, input_len: int, output_len: int,
                  output_json: Path) -> list[str]:
    """The command that runs ``llama-batched-bench`` once and writes its output tokens/s to ``output_json``."""
    bench = [str(binary), "-m", model, "-c", str(prompts * (input_len + output_len) + 64), "-b", "2048", "-ub", "512",
             "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(prompts), "-t", str(THREADS), "-tb",
             str(THREADS), "--output-format", "jsonl"]
    return [sys.executable, str(Path(__file__).resolve()), "--batched-worker", str(output_json), "--", *bench]


def batched_worker(output_json: str, command: list[str]) -> None:
    """Runs ``llama-batched-bench`` and keeps its figures: output tokens over its total time."""
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    print(out)
    row = json.loads(next(line for line in out.splitlines() if re.match(r"\s*\{", line)))
    produced = row["pl"] * row["tg"]
    figures = {"backend": "llama.cpp", "num_requests": row["pl"], "elapsed_s": row["t"], "output_tokens": produced,
               "output_tokens_per_s": produced / row["t"], "llama_batched_bench": row}
    Path(output_json).write_text(json.dumps(figures, indent=2))


def compare(ns: argparse.Namespace) -> None:
    from shaped_models import Side, Workload, run_pairs

    from cadence.models.loader import gguf_file_of, resolve_model

    gguf = gguf_file_of(ns.model)
    if gguf is None:
        raise SystemExit(f"{ns.model} is not a GGUF file")
    prompts, input_len, output_len = WORKLOADS[ns.workload]
    workload = Workload(prompts, input_len, output_len, 0, None, "2GiB")
    logs = Path(ns.log_dir or tempfile.mkdtemp(prefix="cadence-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    requests = logs / f"requests-{ns.workload}.json"
    requests.write_text(json.dumps(workload.requests(Path(resolve_model(gguf)))))
    print(f"model: {gguf}; workload {ns.workload}: {prompts} x {input_len} in / {output_len} out", flush=True)

    def llama_command(output_json: Path) -> list[str]:
        if ns.workload == "batched":
            return batched_bench(Path(ns.llama_bin) / "llama-batched-bench", gguf, prompts, input_len, output_len,
                                 output_json)
        return [ns.llama_python, str(Path(__file__).resolve()), "--llama-worker", "--model", gguf,
                "--requests", str(requests), "--output-json", str(output_json)]

    def cadence_command(output_json: Path) -> list[str]:
        return [*workload.cadence_command(Path(gguf), output_json), "--quantization", ns.quantization]

    results = run_pairs((Side("cadence", cadence_command), Side("llama_cpp", llama_command)), ns.pairs, str(logs))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"model": gguf, "workload": ns.workload, "runs": results}, indent=2))


def main() -> None:
    if sys.argv[1:2] == ["--llama-worker"]:
        worker = argparse.ArgumentParser(prog=f"{sys.argv[0]} --llama-worker")
        for flag in ("--model", "--requests", "--output-json"):
            worker.add_argument(flag, required=True)
        llama_worker(worker.parse_args(sys.argv[2:]))
        return
    if sys.argv[1:2] == ["--batched-worker"]:
        batched_worker(sys.argv[2], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a .gguf file or a short name")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="single")
    parser.add_argument("--quantization", default="gguf", help="cadence's --quantization (none: its bf16 baseline)")
    parser.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON, help="the python of llama-cpp-python's venv")
    parser.add_argument("--llama-bin", default="/root/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin",
                        help="the folder of llama.cpp's built tools (llama-batched-bench)")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--log-dir", default=None, help="each run's output goes here (default: a temporary folder)")
    parser.add_argument("--output-json", default=None, help="write every run's figures to this file")
    compare(parser.parse_args())


if __name__ == "__main__":
    main()
