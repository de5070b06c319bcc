"""The simulator's step-time model: a linear cost over what a step computes, fitted to real timings.

``step_time = const + prefill_tokens·c + decode_seqs·c + kv_tokens·c + prefill_attn·c + prefills·c
+ sampled·c + draft_tokens·c + kernel_rows·c + draft_rounds·c + draft_rows·c`` where, for one engine step,

- ``prefill_tokens``: tokens of requests given more than one token (linear layers, KV writes);
- ``decode_seqs``: requests given exactly one token (the same layers, one row each);
- ``kv_tokens``: cached tokens the decodes attend over, the sum of their contexts: the ``sdpa``
  backend's C++ kernels read each request's own cache up to its position, its threads sharing the
  keys evenly whatever the contexts' spread (its torch fallback, on CPUs with neither AVX-512 nor
  AVX2, pads every decode to the longest: a fit there averages the padding in);
- ``prefill_attn``: query × key pairs of the prefills (``Σ new · context``), the quadratic part;
- ``prefills``: requests given more than one token (one attention call per layer each);
- ``sampled``: requests that reach the end of their known tokens (LM head rows and sampling);
- ``draft_tokens``: speculative decoding's drafted tokens verified with the decodes (a decode that
  verifies ``k`` drafts counts as a decode plus ``k`` of these: more rows of every layer, a short
  attention tile). A fit calibrated without speculation has none, and prices them at 0.
- ``kernel_rows``: the step's rows (its tokens) up to the quantized kernel's row limit, the limit
  beyond it (``min(rows, limit)``; 0 where the kernel takes every batch). On a CPU with AVX2 and no
  VNNI, float32 rows past the limit go through a float GEMM of dequantized weights instead
  (``quantization/packed.py``), whose cost per row is a fraction of the kernel's, and the limit sits
  where the two cost the same: so the linear layers cost the kernel's slope up to it and the
  GEMM's after, a hinge. Without it one slope for both had to split the difference: measured on
  the first-generation Zen machine, a decode priced at 5.1 ms where steps of up to 16 rows cost
  8 ms a row and wider ones 3-4 (docs/research.md, "Fidelity"). The limit is the model's
  ``metadata["kernel_row_limit"]``, read from the loaded weights (:attr:`CostModel.row_limit`).
- ``draft_rounds``, ``draft_rows``: a draft model's proposals after the step (``method:
  draft_model``): its forwards (as many as the most drafts asked of one request) and the drafts
  asked in all (one row each). N-gram lookups cost nothing here; a fit without a draft model
  prices them at 0.

``const`` holds the fixed per-step cost: input preparation, the engine loop, actor messages.
Coefficients are seconds per unit, fitted by least squares with non-negative coefficients on
timings of the real engine (``cadence simulate calibrate``), and stored as JSON with how and
where they were measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = ("const", "prefill_tokens", "decode_seqs", "kv_tokens", "prefill_attn", "prefills", "sampled",
            "draft_tokens", "kernel_rows", "draft_rounds", "draft_rows")
# What a draft model's proposals cost (the step time's part that ModelRunnerOutput.draft_time_s is).
DRAFT_FEATURES = ("draft_rounds", "draft_rows")
_FORMAT = "cadence-cost-model"
_REWEIGHTS = 8
# A step far off the fit was slowed by something else on the machine (or was a one-off, like a
# first call): it is left out of the next iteration. Quiet runs have a few percent of noise.
_OUTLIER_SIGMAS = 3.0
_MIN_OUTLIER_BAND = 0.1
# The reweighting's last change that counts as none. Each reweighting shrinks the change a
# hundredfold or more (measured on the simulator's windows: 2%, then 5e-5, then 1e-7), so a change
# under 1e-4 leaves the fit within about 1e-6 of its fixed point, far inside any step time's noise,
# and saves the solve (a quarter of a refit) that a tighter test spends confirming it.
_FIXED_POINT = 1e-4
# 2: kv_tokens is the decodes' summed contexts (1: decodes x the longest context). 3: kernel_rows;
# a version 2 file has no such coefficient, and prices steps as it did.
_VERSION = 3
_READS = (2, 3)

# The fallback (`--cost-model builtin`): fitted by `cadence simulate calibrate` for the default model
# (SmolLM2-135M-Instruct, Q4_1 GGUF, bf16 activations, sdpa, 2 threads, serve's defaults then: a
# 512-token budget, a 100-ms target) on the 2-core development machine (see DEFAULT_METADATA).
# Another machine or model gets its own fit.
DEFAULT_COEFFICIENTS: dict[str, float] = {
    "const": 6.07e-3,
    "prefill_tokens": 7.25e-4,
    "decode_seqs": 1.09e-3,
    "kv_tokens": 2.12e-6,
    "prefill_attn": 1.02e-6,
    "prefills": 3.70e-3,
    "sampled": 0.0,
    # Not from that fit: the marginal cost of a verified draft on the same model and machine, measured
    # with benchmarks/speculative_decoding.py's engine (a step of 1, 5 and 9 rows: 4.5, 9.5, 14 ms).
    "draft_tokens": 1.2e-3,
    # Not from that fit either: the default model's Q4_1 GGUF drafting (for its bf16 self), one forward
    # for one request 5.7 ms (docs/speculative_decoding.md), of which a row is taken to cost what a
    # decode row of the same model costs in the fit above.
    "draft_rounds": 4.6e-3,
    "draft_rows": 1.09e-3,
}
DEFAULT_METADATA: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct.Q4_1", "dtype": "bfloat16", "quantization": "gguf", "attention_backend": "sdpa",
    "threads": 2, "cpu_count": 2, "date": "2026-12-02T07:36", "source": "built-in fallback",
    "fit": {"num_samples": 1809, "median_rel_error": 0.070, "total_time_ratio": 1.004},
}


@dataclass(slots=True)
class StepShape:
    """What one engine step computes; see the module docstring for each field."""

    num_seqs: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens: int = 0
    prefill_attn: int = 0
    prefills: int = 0
    sampled: int = 0
    draft_tokens: int = 0
    kernel_rows: int = 0
    draft_rounds: int = 0
    draft_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs + self.draft_tokens

    def features(self) -> list[float]:
        """Values in :data:`FEATURES` order (``const`` is 1)."""
        return [1.0, self.prefill_tokens, self.decode_seqs, self.kv_tokens, self.prefill_attn, self.prefills,
                self.sampled, self.draft_tokens, self.kernel_rows, self.draft_rounds, self.draft_rows]


def kernel_rows(rows: int, row_limit: int | None) -> int:
    """The ``kernel_rows`` of a step of ``rows`` rows, for the kernel's ``row_limit`` (None: none)."""
    return 0 if row_limit is None else min(rows, row_limit)


def decode_shape(num_seqs: int, kv_tokens: int, row_limit: int | None) -> StepShape:
    """A decode-only step of ``num_seqs`` requests that each sample a token, none drafting, their
    contexts summing to ``kv_tokens``: :func:`step_shape` of such a step."""
    return StepShape(num_seqs=num_seqs, decode_seqs=num_seqs, kv_tokens=kv_tokens, sampled=num_seqs,
                     kernel_rows=kernel_rows(num_seqs, row_limit))


def step_shape(chunks: Iterable[tuple[int, int, bool, int]], row_limit: int | None = None) -> StepShape:
    """The shape of a step from each request's part in it: (tokens scheduled, its position after
    them, whether it samples a token, how many of those tokens are drafts it verifies), for the
    quantized kernel's ``row_limit`` (:attr:`CostModel.row_limit`)."""
    prefill_tokens = decode_seqs = prefills = prefill_attn = sampled = kv_tokens = draft_tokens = 0
    for num, end, samples, drafts in chunks:
        if num - drafts == 1:
            decode_seqs += 1
            kv_tokens += end - drafts
            draft_tokens += drafts
        else:
            prefills += 1
            prefill_tokens += num
            prefill_attn += num * end
        sampled += samples
    return StepShape(num_seqs=decode_seqs + prefills, prefill_tokens=prefill_tokens, decode_seqs=decode_seqs,
                     kv_tokens=kv_tokens, prefill_attn=prefill_attn, prefills=prefills, sampled=sampled,
                     draft_tokens=draft_tokens,
                     kernel_rows=kernel_rows(prefill_tokens + decode_seqs + draft_tokens, row_limit))


@dataclass(frozen=True)
class FitQuality:
    """How well a fit reproduces its own samples (relative errors are |pred - true| / true)."""

    num_samples: int
    r2: float
    median_rel_error: float
    p90_rel_error: float
    total_time_ratio: float  # sum(pred) / sum(true): the bias that throughput sees

    def to_dict(self) -> dict[str, float]:
        return {"num_samples": self.num_samples, "r2": self.r2, "median_rel_error": self.median_rel_error,
                "p90_rel_error": self.p90_rel_error, "total_time_ratio": self.total_time_ratio}


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature; features left out cost nothing."""

    coefficients: Mapping[str, float]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost-model feature(s) {sorted(unknown)}; known: {', '.join(FEATURES)}")
        bad = [k for k, v in self.coefficients.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"cost-model coefficients must be finite and >= 0: {sorted(bad)}")
        # The hot path reads a tuple, not the mapping.
        object.__setattr__(self, "_c", tuple(float(self.coefficients.get(name, 0.0)) for name in FEATURES))

    @classmethod
    def default(cls) -> CostModel:
        return cls(DEFAULT_COEFFICIENTS, DEFAULT_METADATA)

    @classmethod
    def constant(cls, step_time_s: float) -> CostModel:
        """Every step takes the same time: handy for tests that care about order, not speed."""
        return cls({"const": step_time_s}, {"source": "constant"})

    def with_metadata(self, **more: Any) -> CostModel:
        """The same coefficients, with ``more`` in the metadata."""
        return CostModel(self.coefficients, {**self.metadata, **more})

    def step_time(self, shape: StepShape) -> float:
        c: tuple[float, ...] = self._c  # type: ignore[attr-defined]
        return (c[0] + c[1] * shape.prefill_tokens + c[2] * shape.decode_seqs + c[3] * shape.kv_tokens
                + c[4] * shape.prefill_attn + c[5] * shape.prefills + c[6] * shape.sampled + c[7] * shape.draft_tokens
                + c[8] * shape.kernel_rows + self.draft_time(shape))

    def decode_step_times(self, num_seqs: int, kv_tokens: np.ndarray) -> np.ndarray:
        """:meth:`step_time` of decode-only steps of ``num_seqs`` requests (each samples, none drafts)
        whose contexts sum to each of ``kv_tokens``, bit for bit: the terms :meth:`step_time` adds
        that are not zero, in its order (adding 0.0 changes no sum of non-negative terms)."""
        c: tuple[float, ...] = self._c  # type: ignore[attr-defined]
        times = c[3] * kv_tokens
        times += c[0] + c[2] * num_seqs  # a sum of two floats is the same either way round
        times += c[6] * num_seqs
        rows = c[8] * kernel_rows(num_seqs, self.row_limit)
        if rows:
            times += rows
        return times

    def predict(self, features: np.ndarray) -> np.ndarray:
        """:meth:`step_time` of steps given as rows of :data:`FEATURES` values (to rounding)."""
        return features @ np.array(self._c)  # type: ignore[attr-defined]

    def draft_time(self, shape: StepShape) -> float:
        """The part of :meth:`step_time` a draft model's proposals take."""
        c: tuple[float, ...] = self._c  # type: ignore[attr-defined]
        return c[9] * shape.draft_rounds + c[10] * shape.draft_rows

    @property
    def row_limit(self) -> int | None:
        """The quantized kernel's row limit this model's ``kernel_rows`` are counted with (None: the
        kernel takes every batch, or no weight is quantized): step shapes priced by this model are
        counted with it (:func:`step_shape`)."""
        limit = self.metadata.get("kernel_row_limit")
        return None if limit is None else int(limit)

    @property
    def prices_speculation(self) -> bool:
        """Whether verified drafts have their price: a cost, or a calibration with speculation that
        found them free."""
        return bool(self.coefficients.get("draft_tokens")) or bool(self.metadata.get("speculative"))

    @property
    def prices_draft_models(self) -> bool:
        return any(self.coefficients.get(name) for name in DRAFT_FEATURES)

    # ---- files ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "version": _VERSION, "coefficients": dict(self.coefficients),
                "metadata": dict(self.metadata)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """:raises ValueError: if the file is not a cost model this version reads."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read cost model {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a cadence cost model (write one with `cadence simulate calibrate`)")
        if data.get("version") not in _READS:
            raise ValueError(f"{path} is cost-model version {data.get('version')}; this cadence reads {_VERSION}: "
                             "calibrate again (`cadence simulate calibrate`)")
        return cls({k: float(v) for k, v in data["coefficients"].items()}, data.get("metadata", {}))

    def describe(self) -> str:
        terms = ", ".join(f"{name}={self.coefficients[name]:.3g}" for name in FEATURES
                          if self.coefficients.get(name))
        return f"step_time_s = {terms or '0'}"


# ---- fitting --------------------------------------------------------------------------------


def fit_cost_model(
    shapes: Sequence[StepShape],
    times: Sequence[float],
    *,
    features: Iterable[str] = FEATURES,
    relative: bool = True,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[CostModel, FitQuality]:
    """Least-squares coefficients, all >= 0, for ``times[i] ≈ cost(shapes[i])``.

    ``relative`` fits relative errors, so that short decode steps count as much as long prefills:
    the noise of step timings is multiplicative (and skewed: a busy machine only ever slows a
    step). Weighing each sample by ``1 / time`` would favour the fast draws and predict too
    little time overall, so the weights are ``1 / predicted time``, iterated from there (the
    maximum-likelihood fit of a mean under Gamma-distributed noise), leaving out steps more than
    three robust standard deviations off (a step another process slowed down). A coefficient that would go
    negative is held at 0 (Lawson and Hanson's NNLS). Nearly collinear features (decodes and
    sampled rows) can trade weight between them; their sum, and so the predicted time, is stable.

    :raises ValueError: with fewer samples than features, a non-positive time, or a fit that does not
        converge.
    """
    if len(shapes) != len(times):
        raise ValueError(f"{len(shapes)} shapes but {len(times)} times")
    x = np.array([shape.features() for shape in shapes], dtype=np.float64).reshape(len(shapes), len(FEATURES))
    y = np.asarray(times, dtype=np.float64)
    model = CostModel(fit_features(x, y, features=features, relative=relative)[0], dict(metadata or {}))
    return model, _quality(model.predict(x), y)


def fit_features(
    x: np.ndarray,
    y: np.ndarray,
    *,
    features: Iterable[str] = FEATURES,
    relative: bool = True,
    offset: float | np.ndarray = 0.0,
) -> tuple[dict[str, float], np.ndarray]:
    """:func:`fit_cost_model`'s coefficients of ``features``, for steps given as rows of feature values
    (:data:`FEATURES` order) and their times, and which steps the fit kept (a boolean per step: the
    others were left out as outliers). ``offset`` is a part of every step's time already known
    (features held at known coefficients; one value, or one per step): ``features`` are fitted to the rest.

    :raises ValueError: with fewer samples than features, a non-positive time, or a fit that does not
        converge.
    """
    wanted = set(features)
    columns = [i for i, name in enumerate(FEATURES) if name in wanted]
    names = [FEATURES[i] for i in columns]
    if len(y) < len(names):
        raise ValueError(f"need at least {len(names)} samples to fit {len(names)} features, got {len(y)}")
    if not (y > 0).all():
        raise ValueError("step times must be > 0")
    x = x[:, columns]
    w = 1.0 / y if relative else np.ones_like(y)
    rest = y - offset
    coef = _nonnegative_lstsq(x * w[:, None], rest * w)
    floor, keep = 1e-3 * y.mean(), None  # None: every step kept
    for _ in range(_REWEIGHTS if relative else 0):
        predicted = np.maximum(offset + x @ coef, floor)
        off = np.abs((y - predicted) / predicted)
        spread = 1.4826 * _median(off if keep is None else off[keep])  # a robust standard deviation
        keep = off <= max(_OUTLIER_SIGMAS * spread, _MIN_OUTLIER_BAND)
        weights = predicted[keep]
        previous, coef = coef, _nonnegative_lstsq(x[keep] / weights[:, None], rest[keep] / weights)
        # Near a fixed point (the same weights and outliers next time): the engine refits every few
        # steps, and the simulator's times, without noise, get there at once.
        if all(abs(c - p) <= _FIXED_POINT * abs(p) for c, p in zip(coef.tolist(), previous.tolist(), strict=True)):
            break
    return dict(zip(names, coef.tolist(), strict=True)), np.ones(len(y), dtype=bool) if keep is None else keep


_NNLS_ITERATIONS = 30  # per feature; SciPy's default, 3, can stop short of a degenerate window's answer


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` subject to ``x >= 0`` (Lawson and Hanson's NNLS, SciPy's)."""
    # Columns are scaled to unit norm first: raw features span ~10 orders of magnitude.
    scale = np.sqrt(np.add.reduce(a * a, axis=0))  # np.linalg.norm's arithmetic, without its overhead
    scale[scale == 0] = 1.0
    # Imported here: SciPy's optimizers take most of a second to import, which the API process and
    # the CLI, that never fit, would pay on every start.
    from scipy.optimize import nnls

    try:
        return nnls(a / scale, b, maxiter=_NNLS_ITERATIONS * a.shape[1])[0] / scale
    except RuntimeError as exc:  # SciPy's iteration limit: a window too degenerate to fit
        raise ValueError(f"the step-cost fit did not converge: {exc}") from exc


def _median(values: np.ndarray) -> float:
    """``np.median`` of a 1-d array without NaNs, to the bit, without its overhead (the step budget refits
    thousands of times a second in a fleet simulation)."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    low, high = np.partition(values, (half - 1, half))[half - 1:half + 1]
    return float((low + high) / 2)


def fit_quality(model: CostModel, shapes: Sequence[StepShape], times: Sequence[float]) -> FitQuality:
    return _quality(np.array([model.step_time(s) for s in shapes]), np.asarray(times, dtype=np.float64))


def _quality(pred: np.ndarray, y: np.ndarray) -> FitQuality:
    rel = np.abs(pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    return FitQuality(num_samples=len(y), r2=1.0 - ss_res / ss_tot, median_rel_error=float(np.median(rel)),
                      p90_rel_error=float(np.percentile(rel, 90)), total_time_ratio=float(pred.sum() / y.sum()))
