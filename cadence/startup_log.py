"""The ``cadence.startup`` logger: what a start is doing (converting a GGUF file, compiling the CPU
kernels, loading weights, sizing the KV cache), shown at INFO even where everything else shows only
warnings (``cadence serve``'s default), so that a first start that takes a minute does not sit
silent. Silence it with ``logging.getLogger("cadence.startup").setLevel(logging.WARNING)``."""

from __future__ import annotations

import logging

startup = logging.getLogger("cadence.startup")
if startup.level == logging.NOTSET:
    startup.setLevel(logging.INFO)
