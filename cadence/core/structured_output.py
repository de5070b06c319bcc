"""Structured output: constraints become xgrammar grammars, and each constrained request a matcher.

- Front end: :func:`check_constraint` builds the constraint's grammar without a tokenizer, so a bad
  schema, regex or grammar is rejected (a 400) before anything is admitted.
- Engine core: :class:`StructuredOutputManager` compiles grammars against the model's vocabulary
  in a worker thread, off the engine loop, with a cache keyed by the constraint; it keeps one
  matcher per request, builds each step's token bitmask for the constrained rows that sample, and
  advances matchers with the tokens the scheduler accepts.
- Worker: :func:`cadence.executor.sampler.apply_grammar_bitmask` masks those rows' logits.

xgrammar (``cadence[structured]``) is imported on the first constrained request only: an engine
that never sees one pays nothing for it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from cadence.messages import GrammarBitmask
from cadence.request import Request, RequestStatus
from cadence.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

ConstraintKey = tuple[str, str]  # StructuredOutputsParams.key: (kind, canonical spec)

# Whitespace is free between JSON tokens, up to this many characters per gap: enough for
# pretty-printed output, and small models cannot fill max_tokens with newlines (they did, unbounded).
JSON_MAX_WHITESPACE = 16
# How long a request waits in the engine core for its grammar (the front end's --grammar-compile-timeout
# checks the constraint before admission; compiling against the vocabulary costs more, and a schema
# the front end took 5 s to check took 90 s here). The compile goes on; the request fails.
COMPILE_TIMEOUT_S = 30.0

_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "json_object": "JSON grammar"}
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs xgrammar: pip install 'cadence[structured]'") from None
    return xgrammar


def build_grammar(key: ConstraintKey) -> xgrammar.Grammar:
    """The tokenizer-free grammar of a constraint. :raises RuntimeError: xgrammar rejects it."""
    kind, spec = key
    xgr = _xgrammar()
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        # JSON string literals are EBNF string literals (same quotes and escapes).
        options = json.loads(spec)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    return xgr.Grammar.builtin_json_grammar()


def check_constraint(constraint: StructuredOutputsParams) -> None:
    """Check that a constraint compiles; cached, so the API's check and the engine's cost one.

    :raises ValueError: naming the problem ("invalid JSON schema: ..."), or when xgrammar is not
        installed.
    """
    _check_key(constraint.key)


@functools.lru_cache(maxsize=256)
def _check_key(key: ConstraintKey) -> None:
    kind, spec = key
    _xgrammar()  # first: without the extra, say so rather than fail on its other imports
    if kind == "json":
        _check_json_schema(json.loads(spec))
    try:
        build_grammar(key)
    except RuntimeError as exc:
        message = _XGRAMMAR_PREFIX.sub("", str(exc)).strip()
        raise ValueError(f"invalid {_WHAT[kind]}: {message}") from None


def _check_json_schema(schema: Any) -> None:
    # jsonschema catches what xgrammar would silently ignore (a misspelt "required": "name", a
    # negative maxLength ...), against the schema's own draft (2020-12 unless "$schema" says).
    import jsonschema

    if not isinstance(schema, dict):
        raise ValueError(f"invalid JSON schema: a schema must be a JSON object, got {json.dumps(schema)}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"invalid JSON schema: {exc.message} (at {exc.json_path})") from None


class StructuredOutputManager:
    """The engine core's grammars and matchers.

    A constrained request is registered on arrival (:meth:`add_request`), which starts its compile
    in the background; the scheduler admits it only once :meth:`is_ready` says its matcher exists.
    Matchers advance with every accepted token and are never rolled back past it: the scheduler
    never discards an output token (a preempted request keeps its outputs and recomputes them).
    Speculative decoding's drafts are checked, and their positions' bitmasks filled, by advancing a
    matcher over them and rolling it back at once.
    """

    def __init__(self, load_tokenizer: Callable[[], PreTrainedTokenizerBase], vocab_size: int,
                 cache_size: int = 256, compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's). A request
        whose grammar has not compiled ``compile_timeout_s`` after it arrived fails (the compile
        goes on, and its grammar is cached for later requests)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._compile_timeout_s = compile_timeout_s
        self._deadlines: dict[str, float] = {}
        # One thread: compiles are milliseconds, and it makes the lazy compiler set-up race-free.
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._grammars: OrderedDict[ConstraintKey, concurrent.futures.Future[xgrammar.CompiledGrammar]] = (
            OrderedDict())
        self._compiling: dict[str, concurrent.futures.Future[xgrammar.CompiledGrammar]] = {}
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is not compiled yet (or failed and not yet taken)."""
        return len(self._compiling)

    @property
    def num_active(self) -> int:
        """Requests with a matcher."""
        return len(self._matchers)

    def add_request(self, request_id: str, constraint: StructuredOutputsParams) -> None:
        """Start compiling the request's grammar (or share a cached or in-flight compile)."""
        key = constraint.key
        future = self._grammars.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cadence-grammar")
            future = self._grammars[key] = self._pool.submit(self._compile, key)
            if len(self._grammars) > self._cache_size:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        self._compiling[request_id] = future
        self._deadlines[request_id] = time.monotonic() + self._compile_timeout_s

    def blocks_all(self, waiting: Collection[Request], running: Collection[Request]) -> bool:
        """Whether nothing can be scheduled until a compile ends: no request runs, and no waiting one
        is ready (each is constrained, and its grammar is compiling or failed and not yet taken by
        :meth:`take_failures`).

        A request that is ready stays ready until it finishes, so when this is False the scheduler's
        next step admits someone; a compile that fails after this check cannot leave an idle engine
        with a step that schedules nothing.
        """
        if not self.num_compiling or running or not waiting:
            return False
        return not any(self.is_ready(request.request_id) for request in waiting)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled: unconstrained, or its matcher exists (made here
        once its compile has finished). False while compiling, and after a failed compile."""
        future = self._compiling.get(request_id)
        if future is None:
            return True
        if not future.done() or future.exception() is not None:
            return False
        self._matchers[request_id] = _xgrammar().GrammarMatcher(future.result())
        del self._compiling[request_id]
        del self._deadlines[request_id]
        return True

    def take_failures(self) -> dict[str, str]:
        """Requests whose grammar failed to compile, or did not compile in time, with the error;
        they are forgotten here."""
        now = time.monotonic()
        failures = {}
        for request_id, future in self._compiling.items():
            if future.done() and future.exception() is not None:
                failures[request_id] = f"the grammar failed to compile: {future.exception()}"
            elif not future.done() and now >= self._deadlines[request_id]:
                failures[request_id] = f"the grammar did not compile within {self._compile_timeout_s:g} s"
        for request_id in failures:
            self.remove(request_id)
        return failures

    def wait(self, timeout_s: float) -> None:
        """Block until some pending compile finishes, or ``timeout_s`` passes (call from a thread)."""
        concurrent.futures.wait(set(self._compiling.values()), timeout_s,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        """Forget a finished request (its compile, if still running, stays cached for others)."""
        self._compiling.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def step_bitmask(self, scheduled: Iterable[str], requests: Mapping[str, Request]) -> GrammarBitmask | None:
        """The bitmask of a step's constrained requests that sample in it (their last token is in
        it; their ``num_computed_tokens`` already counts the step), in the step's order; None when
        there is none. A request verifying drafts has a row for each (speculative decoding)."""
        drafts = {request_id: requests[request_id].drafts for request_id in scheduled if request_id in self._matchers}
        sampling = {request_id: d.token_ids[:d.num_scheduled] for request_id, d in drafts.items()
                    if requests[request_id].num_computed_tokens == requests[request_id].num_tokens + d.num_scheduled}
        return self.grammar_bitmask(sampling) if sampling else None

    def grammar_bitmask(self, drafts: Mapping[str, list[int]]) -> GrammarBitmask:
        """The next-token bitmask of these requests (all with a matcher), in order: one row each,
        then one more after each of its drafts (all of which its grammar accepts: :meth:`num_valid`)."""
        xgr = _xgrammar()
        request_ids = [request_id for request_id, tokens in drafts.items() for _ in range(len(tokens) + 1)]
        bitmask: torch.Tensor = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        row = 0
        for request_id, tokens in drafts.items():
            matcher = self._matchers[request_id]
            for token in (*tokens, None):
                matcher.fill_next_token_bitmask(bitmask, row)
                row += 1
                if token is not None:
                    matcher.accept_token(token)
            matcher.rollback(len(tokens))
        return GrammarBitmask(request_ids=request_ids, bitmask=bitmask)

    def num_valid(self, request_id: str, drafts: list[int]) -> int:
        """How many of ``drafts`` the request's grammar accepts in a row (all, for an unconstrained one)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(drafts)
        accepted = 0
        while accepted < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[accepted]):
            accepted += 1
        matcher.rollback(accepted)
        return accepted

    def verdict(self, request: Request, token_id: int) -> RequestStatus | None:
        """Feed an accepted token to the request's matcher, if it has one: stopped once the grammar
        is complete, an error (with ``request.error`` set) if the grammar refuses the token. It can:
        min_tokens masks the stop token even when the complete grammar allows nothing else."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return None
        if not matcher.accept_token(token_id):
            request.error = (f"the grammar does not allow the sampled token {token_id}; min_tokens or "
                             "logit_bias may have masked every token it allows")
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if matcher.is_terminated() else None

    def _compile(self, key: ConstraintKey) -> xgrammar.CompiledGrammar:
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            # Our cache (by constraint) is the one that counts; xgrammar's would hold a second copy.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler.compile_grammar(build_grammar(key))
