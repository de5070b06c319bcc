"""A step's time budget: prefill chunks sized so that requests already decoding get their next token
within a target inter-token latency (``--target-itl-ms``), the way Sarathi-Serve derives its token
budget from a time-between-tokens SLO.

Every decode in a step waits for the whole step, prefill chunks included: a 512-token chunk on the
default model costs about eight decode steps, and every streaming client sees that gap. So when a
step has decodes, the prefills in it get the time the decodes leave under the target, never less
than the decodes' own time (a long decode batch must not starve new prompts: their share of a step
is at least half), nor less than what the batch the waiting requests will join leaves them of such a
step. A step without decodes runs the whole token budget.

Step times come from a :class:`~cadence.core.cost_model.CostModel` refitted as the engine runs: the
engine (or the simulator, with its modelled times) reports each step's shape and duration, and every
``refit_every`` steps the last ``window`` of them are fitted again. Features the window never varied
(no prefill in it, say) keep their previous coefficients, so a run of decodes cannot make prefills
look free, and their share of the steps' times, so that one batch size held for a whole window does
not price its decodes twice; a feature the window moves only as others do (a prompt, then one
request decoding) is held the same way. Until the first refit the given model stands in: the engine
core's, timed on its workers at start (``core/start_fit.py``), else the built-in one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cadence.core.cost_model import FEATURES, CostModel, StepShape, decode_shape, fit_features


class StepBudget:
    """The time a step's prefills may take, and the tokens that fit in it."""

    def __init__(self, target_s: float, model: CostModel | None = None, *, window: int = 256,
                 refit_every: int = 128) -> None:
        if not target_s > 0:
            raise ValueError(f"the target inter-token latency must be > 0 s, got {target_s}")
        self.target_s = target_s
        self.model = model or CostModel.default()
        self.refit_every = refit_every
        # The last ``window`` steps that ran, as rows of feature values and times (a ring).
        # Column-major: the refit reads it by feature (each one's range, the fitted columns).
        self._features = np.zeros((window, len(FEATURES)), order="F")
        self._times = np.zeros(window)
        self._num_samples = 0
        self._since_fit = 0

    # ---- learning step times ------------------------------------------------------------------

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step that ran: its shape and its duration."""
        if seconds <= 0 or not shape.num_seqs:
            return
        row = self._num_samples % len(self._times)
        self._features[row] = shape.features()
        self._times[row] = seconds
        self._count(1)

    def observe_decodes(self, num_seqs: int, kv_tokens: np.ndarray, seconds: np.ndarray) -> None:
        """:meth:`observe` of decode-only steps in turn (``num_seqs`` requests that each sample a token,
        their contexts summing to each of ``kv_tokens``), in bulk (the simulator's fast-forward)."""
        if num_seqs <= 0:
            return
        keep = seconds > 0
        if not keep.all():
            kv_tokens, seconds = kv_tokens[keep], seconds[keep]
        features = decode_shape(num_seqs, 0, self.model.row_limit).features()
        done, window = 0, len(self._times)
        while done < len(seconds):  # up to each refit (and the ring's end), as one step at a time would
            row = self._num_samples % window
            take = min(len(seconds) - done, self.refit_every - self._since_fit, window - row)
            self._features[row:row + take] = features
            self._features[row:row + take, _KV_TOKENS] = kv_tokens[done:done + take]
            self._times[row:row + take] = seconds[done:done + take]
            done += take
            self._count(take)

    def _count(self, num: int) -> None:
        self._num_samples += num
        self._since_fit += num
        if self._since_fit >= self.refit_every:
            self._since_fit = 0
            held = min(self._num_samples, len(self._times))
            self.model = refit(self.model, self._features[:held], self._times[:held])

    # ---- sizing a step ------------------------------------------------------------------------

    def prefill_time(self, decode_ends: Sequence[int], batch: int = 0) -> float:
        """Seconds the prefills of a step may take beside decodes whose contexts end at ``decode_ends``
        (each decode's position after its token): what the decodes leave of the target, and never
        less than the decodes' own time; ``inf`` for a step without decodes.

        ``batch`` is the decode batch the requests in the engine will make once those waiting are
        admitted. Its steps will then take up to twice its decodes' time, so no step before is held
        shorter than that: while a queue is admitted, a step bound to the target would only slow the
        admission (on a CPU where 32 decodes alone take longer than the target, the burst's last
        prompts waited ten times longer), without sparing the streams a gap they would not see after.
        """
        if not decode_ends:
            return math.inf
        n, kv_tokens = len(decode_ends), sum(decode_ends)
        decodes = self._decode_time(n, kv_tokens)
        future = self._decode_time(batch, kv_tokens * batch // n) if batch > n else decodes
        return max(self.target_s, 2 * future) - decodes

    def _decode_time(self, num_seqs: int, kv_tokens: int) -> float:
        return self.model.step_time(decode_shape(num_seqs, kv_tokens, self.model.row_limit))

    def prefill_tokens(self, seconds: float, start: int, rows: int = 0) -> int:
        """The longest chunk, starting at position ``start``, that one request computes in ``seconds``
        beside a step of ``rows`` rows so far (its first rows, up to the quantized kernel's limit, cost
        the kernel's ``kernel_rows`` price as well)."""
        c = self.model.coefficients
        per_token = c.get("prefill_tokens", 0.0) + c.get("prefill_attn", 0.0) * start
        quadratic = c.get("prefill_attn", 0.0)  # chunk n at start s attends n * (s + n) pairs
        room = seconds - c.get("prefills", 0.0) - c.get("sampled", 0.0)
        narrow, kernel = self._narrow(rows), c.get("kernel_rows", 0.0)
        if kernel and room < (per_token + kernel + quadratic * narrow) * narrow:  # short of the limit
            return _longest(room, per_token + kernel, quadratic)
        return _longest(room - kernel * narrow, per_token, quadratic)  # the kernel's part paid in full

    def draft_time(self, num: int, rows: int = 0) -> float:
        """Seconds ``num`` drafted tokens verified with a decode add to a step of ``rows`` rows so far
        (speculative decoding)."""
        return self.model.coefficients.get("draft_tokens", 0.0) * num + self._kernel_time(num, rows)

    def chunk_time(self, num: int, start: int, rows: int = 0) -> float:
        """Seconds a ``num``-token chunk starting at ``start`` adds to a step of ``rows`` rows so far."""
        c = self.model.coefficients
        return (c.get("prefills", 0.0) + c.get("prefill_tokens", 0.0) * num
                + c.get("prefill_attn", 0.0) * num * (start + num) + self._kernel_time(num, rows))

    def _narrow(self, rows: int) -> int:
        """How many more rows a step of ``rows`` rows takes before the kernel's row limit (0: none)."""
        limit = self.model.row_limit
        return 0 if limit is None else max(0, limit - rows)

    def _kernel_time(self, num: int, rows: int) -> float:
        return self.model.coefficients.get("kernel_rows", 0.0) * min(num, self._narrow(rows))


def _longest(room: float, per_token: float, quadratic: float) -> int:
    """The most tokens ``n`` with ``per_token * n + quadratic * n * n <= room``."""
    if room <= 0:
        return 0
    if quadratic > 0:
        n = (-per_token + math.sqrt(per_token * per_token + 4 * quadratic * room)) / (2 * quadratic)
    elif per_token > 0:
        n = room / per_token
    else:
        return 1 << 30  # prefill costs nothing in this model: only the token budget bounds it
    return int(n + 1e-9)  # a chunk that fits exactly, despite rounding


# What the running fit learns. A serving workload's prompts are much alike, so chunk counts, query x
# key pairs and tokens move together, and a fit of all three swings between them from one window to
# the next (measured: the attention term 20x apart), which then mis-sizes chunks of other lengths.
# Tokens alone carry the average attention cost of the prompts being served. Drafted tokens (speculative
# decoding) cost a step differently from prompt tokens, and are learnt apart. So are the rows under the
# quantized kernel's row limit: a serving load's steps are mostly on both sides of it.
ONLINE_FEATURES = ("const", "prefill_tokens", "decode_seqs", "kv_tokens", "draft_tokens", "kernel_rows")


def refit(model: CostModel, features: np.ndarray, times: np.ndarray) -> CostModel:
    """A model of :data:`ONLINE_FEATURES` fitted to steps (rows of :data:`FEATURES` values and their
    times); a feature they never vary, or vary only as the others do, keeps ``model``'s coefficient
    and its share of their times, and so does one that only steps left out as outliers varied."""
    if not len(times) or _predicts(model, features, times):
        return model
    kept = {name: model.coefficients.get(name, 0.0) for name in ONLINE_FEATURES}
    for _ in range(_SELECTIONS):
        fitted_names = _fitted_names(features)
        # A feature held at one value costs every step alike, as the constant term does: fitted with
        # it, that term would learn its share a second time (a decode-only window at one batch size
        # would then price every decode twice). One the window moves only with the others is held
        # too: the steps cannot tell its cost from theirs (a window of a prompt and then one request
        # decoding gave a decode the cost of none, and streams their steps' length ignored).
        held_names = [name for name in kept if name not in fitted_names]
        held = features[:, [_COLUMN[name] for name in held_names]] @ np.array([kept[name] for name in held_names])
        try:
            fitted, inliers = fit_features(features, times, features=fitted_names, offset=held)
        except ValueError:  # too few samples for the features, or a fit that did not converge
            return model
        # The steps left out may have been all that moved a feature: a window's few prompts, which the
        # online form prices worst (a long first chunk's attention). The steps kept say nothing of its
        # cost, and a fit gave it none (prompts free: the next chunk took the whole token budget
        # beside a stream). Fitted again on the steps kept, it is held.
        if inliers.all():
            break
        rest = features[inliers]
        if not _lost_support(rest, fitted_names):
            break
        features, times = rest, times[inliers]
    return CostModel({**kept, **fitted}, {**model.metadata, "source": "refitted while running"})


_SELECTIONS = 3  # fits of a window, each on the steps the one before kept, to settle what is fitted


def _fitted_names(features: np.ndarray) -> list[str]:
    """The online features whose costs ``features``' steps tell apart (the constant always)."""
    low, high = features.min(axis=0), features.max(axis=0)
    varied = [name for name, lo, hi in zip(FEATURES, low, high, strict=True)
              if name == "const" or (name in ONLINE_FEATURES and hi > lo)]
    # Two columns that both vary, one of them the constant, are always told apart.
    return _separable(features, varied) if len(varied) > 2 else varied


def _lost_support(features: np.ndarray, names: list[str]) -> bool:
    """Whether some of ``names`` but the constant is held at one value over ``features``' steps."""
    columns = features[:, [_COLUMN[name] for name in names if name != "const"]]
    return bool((columns.min(axis=0) == columns.max(axis=0)).any())


def _separable(features: np.ndarray, names: list[str]) -> list[str]:
    """Of ``names`` in turn, those whose columns of ``features`` are independent of the ones before:
    the largest set whose costs the steps tell apart. A column (scaled to unit length) within 1e-5
    of the span of those kept before it counts as in it. Cholesky's steps over the columns' Gram
    matrix, skipping the columns that add nothing (a handful of columns: plain floats are the fastest)."""
    x = features[:, [_COLUMN[name] for name in names]]
    gram = x.T @ x
    scale = np.sqrt(np.diagonal(gram))
    g = (gram / np.outer(scale, scale)).tolist()
    kept: list[int] = []
    rows: dict[int, list[float]] = {}  # each kept column's row of the factor, over the kept before it
    for i in range(len(names)):
        row: list[float] = []
        for n, j in enumerate(kept):  # forward substitution: L w = g[kept, i]
            row.append((g[j][i] - sum(a * b for a, b in zip(rows[j][:n], row, strict=True))) / rows[j][n])
        rest = g[i][i] - sum(w * w for w in row)
        if rest > 1e-10:
            rows[i] = [*row, math.sqrt(rest)]
            kept.append(i)
    return [names[i] for i in kept]


def _predicts(model: CostModel, features: np.ndarray, times: np.ndarray) -> bool:
    """Whether ``model``, already of the online fit's form, predicts every step's time (to rounding):
    a refit could only trade weight between features the steps move together (the simulator's times
    are exact, and most of its windows are such)."""
    if not model.coefficients.keys() <= _ONLINE:
        return False
    return bool((np.abs(model.predict(features) - times) <= 1e-9 * times).all())


_ONLINE = frozenset(ONLINE_FEATURES)
_COLUMN = {name: i for i, name in enumerate(FEATURES)}
_KV_TOKENS = _COLUMN["kv_tokens"]
