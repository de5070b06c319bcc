"""A step's time budget: prefill chunks sized so that requests already decoding get their next token
within a target inter-token latency (``--target-itl-ms``), the way Sarathi-Serve derives its token
budget from a time-between-tokens SLO.

Every decode in a step waits for the whole step, prefill chunks included: a 512-token chunk on the
default model costs about eight decode steps, and every streaming client sees that gap. So when a
step has decodes, the prefills in it get the time the decodes leave under the target, never less
than the decodes' own time (a long decode batch must not starve new prompts: their share of a step
is at least half). A step without decodes runs the whole token budget.

Step times come from a :class:`~cadence.core.cost_model.CostModel` refitted as the engine runs: the
engine (or the simulator, with its modelled times) reports each step's shape and duration, and every
``refit_every`` steps the last ``window`` of them are fitted again. Features the window never varied
(no prefill in it, say) keep their previous coefficients, so a run of decodes cannot make prefills
look free, and their share of the steps' times, so that one batch size held for a whole window does
not price its decodes twice. Until the first refit the built-in (or given) model stands in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cadence.core.cost_model import FEATURES, CostModel, StepShape, fit_features


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
        features = StepShape(num_seqs=num_seqs, decode_seqs=num_seqs, sampled=num_seqs).features()
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

    def prefill_time(self, decode_ends: Sequence[int]) -> float:
        """Seconds the prefills of a step may take beside decodes whose contexts end at ``decode_ends``
        (each decode's position after its token): what the decodes leave of the target, and never
        less than the decodes' own time; ``inf`` for a step without decodes."""
        if not decode_ends:
            return math.inf
        n = len(decode_ends)
        decodes = self.model.step_time(StepShape(num_seqs=n, decode_seqs=n, kv_tokens=sum(decode_ends), sampled=n))
        return max(self.target_s - decodes, decodes)

    def prefill_tokens(self, seconds: float, start: int) -> int:
        """The longest chunk, starting at position ``start``, that one request computes in ``seconds``."""
        c = self.model.coefficients
        per_token = c.get("prefill_tokens", 0.0) + c.get("prefill_attn", 0.0) * start
        quadratic = c.get("prefill_attn", 0.0)  # chunk n at start s attends n * (s + n) pairs
        room = seconds - c.get("prefills", 0.0) - c.get("sampled", 0.0)
        if room <= 0:
            return 0
        if quadratic > 0:
            n = (-per_token + math.sqrt(per_token * per_token + 4 * quadratic * room)) / (2 * quadratic)
        elif per_token > 0:
            n = room / per_token
        else:
            return 1 << 30  # prefill costs nothing in this model: only the token budget bounds it
        return int(n + 1e-9)  # a chunk that fits exactly, despite rounding

    def draft_time(self, num: int) -> float:
        """Seconds ``num`` drafted tokens verified with a decode add to a step (speculative decoding)."""
        return self.model.coefficients.get("draft_tokens", 0.0) * num

    def chunk_time(self, num: int, start: int) -> float:
        """Seconds a ``num``-token chunk starting at ``start`` adds to a step."""
        c = self.model.coefficients
        return (c.get("prefills", 0.0) + c.get("prefill_tokens", 0.0) * num
                + c.get("prefill_attn", 0.0) * num * (start + num))


# What the running fit learns. A serving workload's prompts are much alike, so chunk counts, query x
# key pairs and tokens move together, and a fit of all three swings between them from one window to
# the next (measured: the attention term 20x apart), which then mis-sizes chunks of other lengths.
# Tokens alone carry the average attention cost of the prompts being served. Drafted tokens (speculative
# decoding) cost a step differently from prompt tokens, and are learnt apart.
ONLINE_FEATURES = ("const", "prefill_tokens", "decode_seqs", "kv_tokens", "draft_tokens")


def refit(model: CostModel, features: np.ndarray, times: np.ndarray) -> CostModel:
    """A model of :data:`ONLINE_FEATURES` fitted to steps (rows of :data:`FEATURES` values and their
    times); a feature they never vary keeps ``model``'s coefficient, and its share of their times."""
    if not len(times) or _predicts(model, features, times):
        return model
    low, high = features.min(axis=0), features.max(axis=0)
    varied = [name for name, lo, hi in zip(FEATURES, low, high, strict=True)
              if name == "const" or (name in ONLINE_FEATURES and hi > lo)]
    kept = {name: model.coefficients.get(name, 0.0) for name in ONLINE_FEATURES}
    # A feature held at one value costs every step alike, as the constant term does: fitted with it,
    # that term would learn its share a second time (a decode-only window at one batch size would
    # then price every decode twice).
    held = sum(kept[name] * low[i] for i, name in enumerate(FEATURES) if name in kept and name not in varied)
    try:
        fitted = fit_features(features, times, features=varied, offset=held)
    except ValueError:  # too few samples for the features, or a fit that did not converge
        return model
    return CostModel({**kept, **fitted}, {**model.metadata, "source": "refitted while running"})


def _predicts(model: CostModel, features: np.ndarray, times: np.ndarray) -> bool:
    """Whether ``model``, already of the online fit's form, predicts every step's time (to rounding):
    a refit could only trade weight between features the steps move together (the simulator's times
    are exact, and most of its windows are such)."""
    if not model.coefficients.keys() <= _ONLINE:
        return False
    return bool((np.abs(model.predict(features) - times) <= 1e-9 * times).all())


_ONLINE = frozenset(ONLINE_FEATURES)
_KV_TOKENS = FEATURES.index("kv_tokens")
