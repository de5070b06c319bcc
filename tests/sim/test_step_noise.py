"""Noise in the simulated step times (``cadence/sim/step_noise.py``, ``simulate(step_time_noise=...)``)."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.core.cost_model import CostModel
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.step_noise import StepNoise, fitted_sigma
from cadence.sim.workload import synthetic_workload

COSTS = CostModel({"const": 0.004, "decode_seqs": 0.0007, "kv_tokens": 3.1e-7, "prefill_tokens": 1.3e-4})
LIMITS = EngineLimits(num_kv_blocks=96, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                      target_itl_ms=8.0)


def test_a_step_gets_its_factor_however_the_steps_are_asked_for() -> None:
    whole = StepNoise(0.2, seed=3, engine=1).factors(0, 9000)
    noise = StepNoise(0.2, seed=3, engine=1)
    pieces = [noise.factors(0, 3), noise.factors(2, 5), [noise.factor(7)], noise.factors(8, 8992)]
    assert np.array_equal(np.concatenate([pieces[0][:2], pieces[1], pieces[2], pieces[3]]), whole)
    assert not np.array_equal(StepNoise(0.2, seed=3, engine=2).factors(0, 10), whole[:10])  # an engine's own
    with pytest.raises(ValueError, match="asked for after"):
        noise.factors(5, 1)


def test_factors_have_mean_one_and_the_spread_asked_for() -> None:
    factors = StepNoise(0.15, seed=0, engine=0).factors(0, 200_000)
    assert factors.mean() == pytest.approx(1.0, abs=2e-3)
    assert np.log(factors).std() == pytest.approx(0.15, rel=1e-2)


@pytest.mark.parametrize("sigma", [-0.1, float("nan")])
def test_a_negative_or_unknown_spread_is_refused(sigma: float) -> None:
    with pytest.raises(ValueError, match="finite sigma >= 0"):
        workload = synthetic_workload(2, input_len="8", output_len="4", seed=0)
        simulate(workload, LIMITS, "fcfs", COSTS, step_time_noise=sigma)


def test_each_step_takes_its_price_times_its_engines_factor_and_fast_forward_keeps_them() -> None:
    workload = synthetic_workload(60, request_rate=40.0, input_len="uniform:4:40", output_len="uniform:8:60", seed=2)
    runs = [simulate(workload, LIMITS, "fcfs", COSTS, seed=5, engines=2, router="least-loaded", step_time_noise=0.3,
                     fast_forward=fast_forward) for fast_forward in (True, False)]
    assert runs[0].steps == runs[1].steps and runs[0].records == runs[1].records
    exact = simulate(workload, LIMITS, "fcfs", COSTS, seed=5, engines=2, router="least-loaded")
    assert runs[0].steps != exact.steps
    for rank, log in enumerate(runs[0].engine_steps):
        price = (0.004 + 0.0007 * log.column("decode_seqs") + 3.1e-7 * log.column("kv_tokens")
                 + 1.3e-4 * log.column("prefill_tokens"))
        factors = StepNoise(0.3, seed=5, engine=rank).factors(0, len(log))
        np.testing.assert_allclose(log.column("duration"), price * factors, rtol=1e-12)


def test_the_fits_noise_is_its_median_error_over_a_half_normals_median() -> None:
    assert fitted_sigma(CostModel.default()) == pytest.approx(0.070 / 0.6745)
    with pytest.raises(ValueError, match="records no fit error"):
        fitted_sigma(COSTS)
