"""``cadence bench soak`` (and ``benchmarks/soak.py``): the flags, the server this starts and stops,
the run, the report and the exit status (0 pass, 1 fail, 2 bad flags or no server, 130 interrupted)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import cadence.bench.soak
from cadence.bench.soak.load import MIX, parse_mix
from cadence.bench.soak.report import report
from cadence.bench.soak.run import run_soak

DESCRIPTION = cadence.bench.soak.__doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load (default 10)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--base-url", default=None, help="a running server (memory then not measured)")
    p.add_argument("--api-key", default=os.environ.get("CADENCE_API_KEY"), help="default: $CADENCE_API_KEY")
    p.add_argument("--model", default=None, help="model for the server this script starts (default: cadence's)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help='more `cadence serve` arguments, split like a shell line; repeatable '
                        '(--server-arg="--max-num-seqs 64")')
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0, help="bound on each process's growth")
    p.add_argument("--warmup-s", type=float, default=None, help="default: 20%% of the run, 60 s to half of it")
    p.add_argument("--long-max-tokens", type=int, default=256, help="longest max_tokens sent (default 256)")
    p.add_argument("--hang-guard-s", type=float, default=300.0, help="a request unfinished after this is lost")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="how long to wait for an idle engine")
    p.add_argument("--sample-interval-s", type=float, default=2.0)
    p.add_argument("--report-every-s", type=float, default=30.0, help="progress line period")
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="for the server to answer /health")
    p.add_argument("--server-log", default=None, help="the started server's log (default: a temporary file)")
    p.add_argument("--mix", default=None, metavar="KIND=W,...",
                   help="reweigh request kinds, e.g. disconnect=40,cancel=0 (kinds: "
                        + ", ".join(k for k, _ in MIX) + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the summary and RSS series here")


def run(ns: argparse.Namespace) -> int:
    try:
        parse_mix(ns.mix)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    server = None
    if ns.base_url:
        base_url, pid = ns.base_url.rstrip("/"), None
        print(f"soaking {base_url} for {ns.minutes:g} min; its processes' memory is not visible from here: "
              "RSS is not measured", flush=True)
    else:
        from cadence.api.testing import ServerProcess

        args = [*(["--model", ns.model] if ns.model else []), *(a for s in ns.server_arg for a in shlex.split(s))]
        log = Path(ns.server_log or tempfile.mkstemp(prefix="cadence-soak-", suffix=".log")[1])
        print(f"starting cadence serve {shlex.join(args)} (log: {log})", flush=True)
        server = ServerProcess(args, log_path=log, startup_timeout_s=ns.startup_timeout_s)
        started = time.monotonic()
        try:
            server.start()
        except RuntimeError as exc:
            print(f"the server did not start: {exc}", file=sys.stderr)
            return 2
        base_url, pid = server.url, server.pid
        print(f"server up on {base_url} (pid {pid}) in {time.monotonic() - started:.0f} s; "
              f"{ns.minutes:g} min of load", flush=True)

    def alive() -> bool:
        return server is None or server.process is None or server.process.poll() is None

    server_problems: list[str] = []
    try:
        result = asyncio.run(run_soak(ns, base_url, pid, alive))
    except KeyboardInterrupt:
        print("interrupted: no verdict", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            died = not alive()
            status = server.stop()
            if died:
                server_problems.append(f"the server exited during the run (status {status})")
            elif status != 0:
                server_problems.append(f"the server exited with status {status} when stopped (SIGTERM)")
            if server_problems:
                print("server log tail:\n" + "\n".join(server.log().splitlines()[-30:]), file=sys.stderr)
    failures, summary = report(base_url, result, server_problems, concurrency=ns.concurrency,
                               max_rss_growth_mib=ns.max_rss_growth_mib, local=pid is not None)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(summary, indent=1))
    if failures:
        print("\nFAIL:\n" + "\n".join(f"- {f}" for f in failures))
        return 1
    print("\nPASS")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/soak.py``: the same flags and run as ``cadence bench soak``, under the script's name."""
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
