"""Soak test for ``cadence serve``: minutes of mixed load, then a verdict on memory, requests and the KV pool.

The same as ``python -m cadence bench soak`` (``cadence/bench/soak/``, where the flags, the load and
the verdict are described): ``python benchmarks/soak.py --help``.

    python benchmarks/soak.py [--minutes 10] [--concurrency 16] [--model PATH] ...
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 [--api-key KEY]   # a server already running
"""

from __future__ import annotations

import sys

from cadence.bench.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
