"""``cadence bench throughput``: offline throughput in the manner of ``vllm bench throughput``.

The same requests run through cadence's ``LLM`` or, as the in-run baseline, transformers' batched
``generate`` (``--backend hf``); both print requests/s, total tokens/s and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from cadence.bench.datasets import BenchRequest, file_requests, random_requests
from cadence.core.step_timing import TimingTotals
from cadence.engine_args import add_engine_args, engine_args_from

_OVERHEAD_BATCH = 64


@dataclass(frozen=True)
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    # cadence only: the engine's own step timing over the steps of the largest batches.
    overhead: TimingTotals | None = None
    overhead_batch_size: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_json(self) -> dict[str, object]:
        figures = {**asdict(self), "requests_per_s": self.requests_per_s,
                   "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s}
        if self.overhead is not None:
            figures["engine_overhead_fraction"] = self.overhead.overhead_fraction
        return figures

    def summary(self) -> str:
        text = (f"{self.backend}: {self.requests_per_s:.2f} requests/s, "
                f"{self.total_tokens_per_s:.1f} total tokens/s, {self.output_tokens_per_s:.1f} output tokens/s "
                f"({self.num_requests} requests in {self.elapsed_s:.1f} s)")
        if self.overhead is not None:
            text += f"\n  steps with >= {self.overhead_batch_size} requests: {self.overhead.summary()}"
        return text


def run_cadence(ns: argparse.Namespace, requests: list[BenchRequest]) -> ThroughputResult:
    from cadence import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from(ns)))
    llm.generate([requests[0].prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    timing = llm.engine_core.timing
    timing.reset()
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    # The yardstick is batch 64: the largest batch this workload reaches, up to that.
    batch = min(_OVERHEAD_BATCH, len(requests), llm.config.scheduler.max_num_seqs)
    return ThroughputResult("cadence", len(requests), elapsed, sum(r.prompt_len for r in requests), produced,
                            timing.at_least(batch), batch)


def run_hf(ns: argparse.Namespace, requests: list[BenchRequest]) -> ThroughputResult:
    """transformers' batched ``generate``, batches of ``--hf-batch-size`` left-padded prompts."""
    from transformers import AutoModelForCausalLM

    config = engine_args_from(ns).create_config()
    if config.device.num_threads:
        torch.set_num_threads(config.device.num_threads)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=config.model.torch_dtype,
                                                 attn_implementation=ns.hf_attn_implementation).eval()
    model.generation_config.eos_token_id = None
    token_ids = [_as_ids(config.model.path, r.prompt) for r in requests]
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), ns.hf_batch_size):
            batch = token_ids[first:first + ns.hf_batch_size]
            out_len = max(r.output_len for r in requests[first:first + ns.hf_batch_size])
            ids, mask = _left_pad(batch)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, do_sample=False, pad_token_id=0)
            produced += (out.shape[1] - ids.shape[1]) * len(batch)
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf", len(requests), elapsed, sum(r.prompt_len for r in requests), produced)


def _as_ids(model_path: str, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    from cadence.models.loader import load_tokenizer

    return list(load_tokenizer(model_path)(prompt).input_ids)


def _left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def load_requests(ns: argparse.Namespace) -> list[BenchRequest]:
    from cadence.models.loader import load_hf_config, load_tokenizer, resolve_model

    path = resolve_model(ns.model)
    if ns.dataset_path:
        return file_requests(ns.dataset_path, load_tokenizer(path), ns.num_prompts, ns.output_len, ns.seed)
    vocab = load_hf_config(path).vocab_size
    return random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, ns.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("workload")
    g.add_argument("--backend", default="cadence", choices=["cadence", "hf"],
                   help="cadence, or transformers' batched generate as the baseline")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128, help="random dataset: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (random dataset, or default)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths vary by +- this ratio")
    g.add_argument("--dataset-path", default=None, help="ShareGPT .json or .jsonl of {prompt, output_len}")
    g.add_argument("--hf-batch-size", type=int, default=64, help="hf backend: prompts per generate call")
    # Measured here: bf16 batched generate is ~2x faster with eager attention than with sdpa.
    g.add_argument("--hf-attn-implementation", default="eager", choices=["eager", "sdpa"])
    g.add_argument("--output-json", default=None, help="write the figures to this file")
    g.add_argument("--disable-tqdm", action="store_true")


def run(ns: argparse.Namespace) -> int:
    requests = load_requests(ns)
    result = (run_hf if ns.backend == "hf" else run_cadence)(ns, requests)
    print(result.summary())
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0
