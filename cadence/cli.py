"""Command line: ``cadence generate`` (and later verbs) over the same engine options as ``LLM``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cadence.api.server import register as register_serve
from cadence.bench.cli import register as register_bench
from cadence.engine_args import add_engine_args, engine_args_from
from cadence.sampling_params import SamplingParams
from cadence.sim.cli import register as register_simulate


def _generate(ns: argparse.Namespace) -> int:
    # Here, not at the top: only this verb runs the model in this process.
    from cadence.engine.llm import LLM

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


def _list_policies(ns: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from cadence.policies.loader import describe_policies

    infos = describe_policies()
    if ns.json:
        print(json.dumps([asdict(info) for info in infos], indent=2))
        return 0
    for info in infos:
        if info.error is not None:
            print(f"{info.name}  (broken: {info.error})\n")
            continue
        print(f"{info.name}  ({info.target})\n  {info.summary}\n  options (--policy-option KEY=VALUE):")
        width = max(map(len, info.options), default=0)
        for option, text in info.options.items():
            print(f"    {option:<{width}}  {text}")
        print()
    return 0


def _explain_trace(ns: argparse.Namespace) -> int:
    from cadence.sim.trace_story import TraceFile, explain

    print("\n\n".join(explain(story) for story in TraceFile(ns.file).find(ns.request)))
    return 0


def _diff_traces(ns: argparse.Namespace) -> int:
    from cadence.sim.trace_story import TraceFile, diff

    print(diff(TraceFile(ns.a), TraceFile(ns.b), ns.top))
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
    policies = verbs.add_parser("policies", help="the installed scheduling policies").add_subparsers(
        dest="policies_verb", required=True)
    listing = policies.add_parser("list", help="each installed policy (entry point cadence.policies) and its options")
    listing.add_argument("--json", action="store_true", help="as JSON")
    listing.set_defaults(run=_list_policies)
    trace = verbs.add_parser("trace", help="read scheduling traces (--trace-scheduling FILE)").add_subparsers(
        dest="trace_verb", required=True)
    story = trace.add_parser("explain", help="the story of one request: waits and why, chunks, preemptions")
    story.add_argument("file", help="a scheduling trace (JSONL) of serve, generate or simulate")
    story.add_argument("--request", required=True, help="the request's id in the trace, or its caller's request id")
    story.set_defaults(run=_explain_trace)
    compare = trace.add_parser("diff", help="two runs of the same workload (two policies, simulated and real), "
                                            "request by request")
    compare.add_argument("a", help="the first trace")
    compare.add_argument("b", help="the second trace")
    compare.add_argument("--top", type=int, default=20, help="how many of the requests whose TTFT moved most to list")
    compare.set_defaults(run=_diff_traces)
    # Each verb's module adds its own parser.
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
