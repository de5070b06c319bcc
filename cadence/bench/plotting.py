"""matplotlib for the benchmarks' and the simulator's PNGs: headless (the Agg backend), and a clear
error naming the extra that brings it (``cadence[sim]``) where it is missing."""

from __future__ import annotations

from types import ModuleType


def pyplot(advice: str = "") -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend.

    :raises RuntimeError: if matplotlib is missing; ``advice`` is appended to the message.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"plots need matplotlib: pip install 'cadence[sim]'{advice}") from exc
    return plt
