"""A warm ``cadence serve`` start: seconds from launch until ``/health`` answers 200 (issue 18's goal:
under 15 s), against a baseline checkout in the same run.

Each round starts ``python -m cadence serve`` with this checkout's package and, with ``--baseline
DIR``, with DIR's (first on ``PYTHONPATH``: a ``git worktree`` of another commit), alternately, and
stops it once ready. The first round warms the page cache for both and is left out of the figures.
Run it on a quiet machine; a benchmark, never a test:

    git worktree add /tmp/base HEAD~1
    python benchmarks/serve_start.py --baseline /tmp/base [--rounds 5] [-- SERVE_ARGS ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from cadence.api.testing import ServerProcess


def ready_after(args: list[str], pythonpath: str | None, log: Path) -> float:
    """Seconds until the server answered ``/health``; it is stopped before this returns."""
    server = ServerProcess(args, log_path=log, startup_timeout_s=600,
                           env=None if pythonpath is None else {"PYTHONPATH": pythonpath})
    with server:
        assert server.ready_after_s is not None
        return server.ready_after_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="a checkout to compare with (its cadence package first)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds measured, after one warming round")
    parser.add_argument("serve_args", nargs="*", help="after --: options for cadence serve")
    ns = parser.parse_args()
    variants = {"this checkout": str(Path(__file__).resolve().parents[1])}
    if ns.baseline is not None:
        variants["baseline"] = str(Path(ns.baseline).resolve())
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        # The servers run there: ``python -m`` puts the working folder before PYTHONPATH, and a
        # checkout's folder would import that checkout's package for every variant.
        os.chdir(folder)
        for round_ in range(ns.rounds + 1):
            for name, path in variants.items():
                seconds = ready_after(ns.serve_args, path, Path(folder) / "server.log")
                print(f"round {round_}{' (warming)' if round_ == 0 else ''}: {name} ready after {seconds:.1f} s",
                      file=sys.stderr, flush=True)
                if round_:
                    times[name].append(seconds)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f})")
    if ns.baseline is not None:
        ratio = statistics.median(times["this checkout"]) / statistics.median(times["baseline"])
        print(f"this checkout / baseline (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
