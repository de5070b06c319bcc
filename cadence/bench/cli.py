"""The ``cadence bench`` verb and its sub-verbs."""

from __future__ import annotations

import argparse
from typing import Any

from cadence.bench import serve, sweep, throughput
from cadence.bench.soak import cli as soak


def register(verbs: argparse._SubParsersAction[Any]) -> None:
    bench = verbs.add_parser("bench", help="benchmarks that report the way vLLM's do")
    kinds = bench.add_subparsers(dest="bench", required=True)
    offline = kinds.add_parser("throughput", help="offline throughput (like vllm bench throughput)")
    throughput.add_arguments(offline)
    offline.set_defaults(run=throughput.run)
    online = kinds.add_parser("serve", help="load an OpenAI-compatible server (like vllm bench serve)")
    serve.add_arguments(online)
    online.set_defaults(run=serve.run)
    curve = kinds.add_parser("sweep", help="a throughput-latency curve: bench serve at several request rates, "
                                           "for one or more servers, with goodput and a PNG")
    sweep.add_arguments(curve)
    curve.set_defaults(run=sweep.run)
    endurance = kinds.add_parser("soak", help="minutes of mixed load on cadence serve, then a verdict on "
                                              "memory, requests and the KV pool",
                                 description=soak.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    soak.add_arguments(endurance)
    endurance.set_defaults(run=soak.run)
