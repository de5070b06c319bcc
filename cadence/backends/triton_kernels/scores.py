"""Score transforms the attention kernels share: logit soft-capping (Gemma 2).

A helper called from inside the kernels, so it is defined after the package has read
``TRITON_INTERPRET`` and is interpreted or compiled with them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, CAP: tl.constexpr):
    """``CAP * tanh(s / CAP)``, with tanh from ``exp``: ``tl`` has no tanh, and libdevice's cannot
    run in the interpreter. ``t = exp(-2|x|)`` lies in (0, 1], so nothing overflows however large
    the score; near 0 the result is within an fp32 ulp of 1, times ``CAP``, of the exact one."""
    x = s / CAP
    t = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - t) / (1.0 + t)
    return CAP * tl.where(x < 0, -magnitude, magnitude)
