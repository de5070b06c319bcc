"""Noise in the simulated step times, as a real machine's steps have it (``simulate --step-time-noise``).

A real engine's steps of one shape take different times: on the 2-core development machine a
calibration from a served run's own trace misses each step by a median 8-14%. The engine's step
budget refits its model to those measured times, so it sizes the next chunks by a model that moves
with them; fed the cost model's exact times, the simulated budget settles on another model and is
a different controller. Here each step's modelled time is scaled by a factor of its own, drawn
lognormal with mean 1 (``sigma`` the spread of its logarithm: about the calibration's median
relative error / 0.67), seeded per engine and drawn in step order, so step k of an engine gets the
same factor whether its steps are taken one by one or fast-forwarded. docs/research.md,
"Calibrated from the served run's trace".
"""

from __future__ import annotations

import numpy as np

from cadence.core.cost_model import CostModel

_BLOCK = 4096  # factors drawn at a time
_HALF_NORMAL_MEDIAN = 0.6745  # the median of |N(0, 1)|


class StepNoise:
    """One engine's step-time factors, step by step (steps are asked for in order, never again before)."""

    def __init__(self, sigma: float, seed: int, engine: int) -> None:
        if not (sigma >= 0 and np.isfinite(sigma)):
            raise ValueError(f"the step-time noise must be a finite sigma >= 0, got {sigma}")
        self.sigma = sigma
        self._rng = np.random.default_rng([seed, engine])
        self._factors = np.empty(0)
        self._first = 0  # the step whose factor is self._factors[0]

    def factors(self, first: int, num: int) -> np.ndarray:
        """The factors of steps ``first`` to ``first + num`` (exclusive); the steps before ``first``
        are not asked for again."""
        if first < self._first:
            raise ValueError(f"step {first}'s factor was asked for after step {self._first}'s")
        while self._first + len(self._factors) < first + num:
            # Mean 1: the machine's level is the cost model's, its spread is the noise's.
            drawn = self._rng.lognormal(-self.sigma * self.sigma / 2, self.sigma, _BLOCK)
            self._factors = np.concatenate((self._factors, drawn))
        self._factors, self._first = self._factors[first - self._first:], first
        return self._factors[:num]

    def factor(self, step: int) -> float:
        """Step ``step``'s factor."""
        return float(self.factors(step, 1)[0])


def fitted_sigma(model: CostModel) -> float:
    """The noise a calibration saw: its fit's median relative error over the median of a half-normal
    (a small factor's relative change is about its logarithm). The fit's misses include the shapes it
    prices wrong as well as the machine's noise, so this is an upper bound.

    :raises ValueError: if the model records no fit error (a hand-written one).
    """
    error = (model.metadata.get("fit") or {}).get("median_rel_error")
    if not error:
        raise ValueError("this cost model records no fit error (its metadata's fit.median_rel_error): give "
                         "--step-time-noise a SIGMA")
    return float(error) / _HALF_NORMAL_MEDIAN


def noise_sigma(text: str, model: CostModel) -> float:
    """``--step-time-noise``'s value: a SIGMA, or ``fit`` for :func:`fitted_sigma` of ``model``.

    :raises ValueError: for anything else, or ``fit`` with a model that records no fit error.
    """
    if text == "fit":
        return fitted_sigma(model)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--step-time-noise takes a SIGMA or 'fit', got {text!r}") from None
