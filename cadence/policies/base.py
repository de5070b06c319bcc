"""The scheduling policy contract: the decisions a policy makes, and nothing else.

The scheduler owns the mechanics (token budget, seats, KV blocks, preemption by recompute); a
policy decides

1. **order**: which waiting request is admitted next (:meth:`SchedulingPolicy.order_waiting`) and
   which running request draws on the step's budget first (:meth:`SchedulingPolicy.order_running`);
2. **size**: how many of a request's remaining tokens it gets this step, the whole prefill or a
   chunk (:meth:`SchedulingPolicy.num_tokens`);
3. **preemption**: which running request gives up its blocks when a running one needs more
   (:meth:`SchedulingPolicy.pick_victim`), and whether a waiting request may push a running one out
   when seats or blocks run out (:meth:`SchedulingPolicy.preempt_for`).

It sees read-only request views (never the allocator), may keep its own state, and is told when
requests arrive, are scheduled, are preempted and finish. It reads the time from its context's
clock (:meth:`SchedulingPolicy.now`: wall time in the engine, virtual time in the simulator, on the
timeline of the requests' ``arrival_time``), and a request's own fields from its ``extra_args``
(``vllm_xargs`` in the HTTP API). The same object drives the real engine and the simulator. A
third-party policy is a subclass registered in the ``cadence.policies`` entry-point group (see
``docs/policies.md``).

Chunking is a property of every policy, not a policy of its own: the ``chunked`` option splits
prompts to fit the step and serves running decodes before prefill chunks. It follows the engine's
``enable_chunked_prefill`` flag (on by default, as in vLLM) unless given (``chunked-prefill`` is
always chunked). Without it, prefills are whole: a waiting request whose prefill does not fit what
is left of the budget waits, and so does everything behind it (head of line); with a small budget
and many running decodes a prompt just under the budget can then wait until decodes finish, which
is why it is not the default. A whole-prefill policy still splits a prompt longer than the entire
step budget, which could never run otherwise.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from cadence.config import SchedulerConfig
from cadence.policies.clock import Clock, WallClock
from cadence.request import RequestStatus, RequestView

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class PolicyContext:
    """The scheduler limits a policy may take into account, and the clock it reads the time from."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool  # the engine allows a prompt to be split across steps
    long_prefill_token_threshold: int  # 0: no cap on one chunk
    clock: Clock = field(default_factory=WallClock, compare=False)

    @classmethod
    def of(cls, config: SchedulerConfig, clock: Clock) -> PolicyContext:
        """The context of a scheduler with ``config`` whose time is ``clock``'s."""
        return cls(max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                   enable_chunked_prefill=config.enable_chunked_prefill,
                   long_prefill_token_threshold=config.long_prefill_token_threshold, clock=clock)


class SchedulingPolicy(abc.ABC):
    """Base class of every policy; subclasses are registered in ``cadence.policies`` entry points.

    :raises ValueError: from the constructor, for an option the policy does not take or a bad value.
    """

    name: ClassVar[str]
    #: Whether prompts are split into chunks when the ``chunked`` option is not given; None: as the
    #: engine's ``enable_chunked_prefill`` says.
    chunked_by_default: ClassVar[bool | None] = None
    #: Whether the simulator may run this policy's decode-only steps in bulk (docs/research.md, "Fast-forward"):
    #: True says that while nothing waits and every running request decodes, ``order_running`` keeps
    #: one order, ``num_tokens`` gives each decode its token and ``on_scheduled`` of a decode changes
    #: nothing, so those steps need no hook called. Off unless a policy says so; a subclass that
    #: overrides one of those hooks must say so again (:attr:`decodes_in_bulk`).
    bulk_decodes: ClassVar[bool] = False

    def __init__(self, context: PolicyContext, options: Mapping[str, str] | None = None) -> None:
        self.context = context
        self.options = dict(options or {})
        unknown = set(self.options) - set(self.accepted_options())
        if unknown:
            raise ValueError(f"policy {self.name!r} does not take option(s) {sorted(unknown)}; "
                             f"it accepts {sorted(self.accepted_options()) or 'none'}")
        default = context.enable_chunked_prefill if self.chunked_by_default is None else self.chunked_by_default
        self.chunked = self.bool_option("chunked", default)
        if self.chunked and not context.enable_chunked_prefill:
            raise ValueError(f"policy {self.name!r} with chunked=true splits prompts, which the engine was "
                             "told not to do (--no-enable-chunked-prefill); drop one of the two")

    @property
    def decodes_in_bulk(self) -> bool:
        """``bulk_decodes``, as said by a class whose decode hooks this policy still runs: a subclass
        that overrides ``order_running``, ``num_tokens`` or ``on_scheduled`` without saying it again
        runs its steps one by one."""
        return _decodes_in_bulk(type(self))

    @classmethod
    def accepted_options(cls) -> Mapping[str, str]:
        """The options ``--policy-option KEY=VALUE`` may set, each with what it does (shown by
        ``cadence policies list``); subclasses extend the base's: ``{**super().accepted_options(), ...}``.
        """
        return {"chunked": "split prompts into chunks that fit the step, decodes first "
                           "(default: as --enable-chunked-prefill says)"}

    def describe(self) -> str:
        """``name (key=value, ...)``: the policy with its options, ``chunked`` resolved; the engine
        shows it at start and in ``/metrics``."""
        settings = {"chunked": str(self.chunked).lower(), **self.options}
        return f"{self.name} ({', '.join(f'{key}={value}' for key, value in sorted(settings.items()))})"

    def now(self) -> float:
        """The time now, in seconds on the timeline of the requests' ``arrival_time`` (the engine's
        wall clock, or the simulator's virtual one): ``self.now() - request.arrival_time`` is how
        long ``request`` has been in the engine."""
        return self.context.clock.now()

    # ---- 1. order -----------------------------------------------------------------------------

    @abc.abstractmethod
    def order_waiting(self, waiting: Sequence[RequestView]) -> Iterable[RequestView]:
        """The waiting requests in the order they should be admitted (first = next).

        ``waiting`` is in arrival order, except that preempted requests go back to the front.
        Admission stops at the first request that cannot be admitted (budget, seats or blocks).
        Called once per step in which the scheduler admits, and again after a preemption made for
        a waiting request (its victims are back in ``waiting``). The scheduler reads the result
        lazily, only as far as it admits, so a policy may return an iterator over an order it keeps
        up to date from the notifications (:class:`~cadence.policies.waiting_queue.WaitingQueue`)
        rather than sort ``waiting`` every step.
        """

    def order_running(self, running: Sequence[RequestView]) -> list[RequestView]:
        """The order in which running requests draw on the step's token budget.

        ``running`` is in admission order. The default keeps it; with chunked prefill on, requests
        with one token left (decodes) go first, so a long prompt's chunks only take what they leave.
        """
        ordered = list(running)
        if self.chunked:
            ordered.sort(key=_is_prefilling)  # stable: admission order within each group
        return ordered

    # ---- 2. size ------------------------------------------------------------------------------

    def num_tokens(self, request: RequestView, token_budget: int, num_cached_tokens: int = 0) -> int:
        """Tokens to schedule for ``request`` this step, given what is left of the step's budget.

        ``num_cached_tokens``: for a waiting request, the tokens of its prompt found in the prefix
        cache, which need no computing (0 for a running one); what remains to compute is
        ``request.num_tokens - request.num_computed_tokens - num_cached_tokens``.

        Returning 0 skips a running request this step and stops admission at a waiting one. With
        chunked prefill on: what fits, capped by the long-prefill threshold. Otherwise a waiting
        request gets its whole remainder when it fits, else 0, except that a remainder longer than
        the entire step budget is split (it could never run otherwise); a running request (a decode,
        or the rest of such a split prompt) gets what fits.
        """
        remaining = request.num_tokens - request.num_computed_tokens - num_cached_tokens
        if self.chunked:
            threshold = self.context.long_prefill_token_threshold
            return min(remaining, threshold or remaining, token_budget)
        if remaining <= token_budget:
            return remaining
        if request.status == RequestStatus.RUNNING or (
                self.context.enable_chunked_prefill and remaining > self.context.max_num_batched_tokens):
            return token_budget
        return 0

    def num_speculative_tokens(self, request: RequestView, num_drafts: int) -> int:
        """How many of the ``num_drafts`` drafted tokens a decoding ``request`` verifies this step
        (speculative decoding, docs/speculative_decoding.md): each costs the step a token of its
        budget, like a prompt token. ``num_drafts`` already fits the budget, the request's
        ``max_tokens`` and how well its recent drafts were accepted; return fewer to cap speculation
        (0: decode one token). The default verifies them all.
        """
        return num_drafts

    # ---- 3. preemption ------------------------------------------------------------------------

    def pick_victim(self, running: Sequence[RequestView], needy: RequestView) -> RequestView:
        """Which running request to preempt so that running ``needy`` can get blocks.

        ``running`` is in admission order and includes ``needy``; returning ``needy`` itself means
        it yields. Called again while ``needy`` still does not fit. The default preempts the most
        recently admitted.
        """
        return running[-1]

    def preempt_for(self, request: RequestView, running: Sequence[RequestView]) -> RequestView | None:
        """A running request to preempt so that waiting ``request`` can be admitted, or ``None``.

        Asked when the seats or the KV blocks have run out for ``request`` (called again while it
        still does not fit), and, in a step that already preempted for a running request, to decide
        whether ``request`` may be admitted at all (only if this names a victim). ``running`` holds
        the requests that were running when the step began (in admission order), not those admitted
        in it. The default never preempts for a waiting request.
        """
        return None

    # ---- notifications (default: nothing to track) -------------------------------------------

    def on_arrival(self, request: RequestView) -> None:
        """A request entered the waiting queue for the first time."""

    def on_scheduled(self, request: RequestView, num_tokens: int) -> None:
        """``request`` got ``num_tokens`` in the step just built (once per request per step).

        ``request.num_computed_tokens`` is still the step's starting point; a request whose step
        reaches ``request.num_tokens`` samples one new token. A waiting request's first call is its
        admission.
        """

    def on_preempted(self, request: RequestView) -> None:
        """``request`` lost its blocks and went back to the waiting queue."""

    def on_finished(self, request: RequestView) -> None:
        """``request`` finished (any reason, aborts included) and left the scheduler."""

    # ---- option parsing -----------------------------------------------------------------------

    def bool_option(self, key: str, default: bool) -> bool:
        """Option ``key`` as a boolean (``true/false``, ``1/0``, ``yes/no``, ``on/off``, any case), or
        ``default`` when not given.

        :raises ValueError: naming the policy and the option, for any other value.
        """
        value = self.options.get(key)
        if value is None:
            return default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"policy {self.name!r}: option {key}={value!r} must be true or false")

    def float_option(self, key: str, default: float, minimum: float = 0.0) -> float:
        """Option ``key`` as a finite number at least ``minimum``, or ``default`` when not given.

        :raises ValueError: naming the policy and the option, for anything else.
        """
        value = self.options.get(key)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number >= minimum):
            raise ValueError(f"policy {self.name!r}: option {key}={value!r} must be a number >= {minimum:g}")
        return number


_DECODE_HOOKS = ("order_running", "num_tokens", "on_scheduled")  # what bulk_decodes vouches for


@functools.cache  # asked before every simulated step
def _decodes_in_bulk(cls: type[SchedulingPolicy]) -> bool:
    said = next(c for c in cls.__mro__ if "bulk_decodes" in c.__dict__)
    return cls.bulk_decodes and all(getattr(cls, hook) is getattr(said, hook) for hook in _DECODE_HOOKS)


def _is_prefilling(request: RequestView) -> bool:
    return request.num_tokens - request.num_computed_tokens > 1
