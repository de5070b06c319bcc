"""Per-request scheduling traces ("why was I slow"): what the scheduler did with each request, as JSONL.

Opt-in (``--trace-scheduling FILE``), written by the scheduler itself, so the engine and the
simulator write the same format. One JSON object a line; each has ``event``, ``step`` (the id of
the step being built; a request's events in step ``s`` happened while ``s`` was scheduled) and
``t``, the policy's clock (wall seconds in the engine, the trace's virtual seconds in the
simulator). Events:

- ``engine``, the first line: what the steps ran on. ``simulated``, ``kernel_row_limit`` (the
  quantized kernel's row limit the step shapes are counted with: ``core/cost_model.py``),
  ``speculative`` (the method, or null), and the engine's description
  (``core/engine_description.py``: model, dtype, quantization, threads, ...) or, from the
  simulator, its cost model's. With the ``scheduled`` events and the steps' times it is enough to
  fit a cost model (``cadence simulate calibrate --from-trace``).
- ``arrival``: ``request``, ``client_id`` (the caller's request id, when the engine knows it; each
  of its ``n`` sequences is a request of its own), ``prompt_tokens``, ``max_tokens``, ``priority``,
  ``user``, ``extra_args``.
- ``scheduled``: ``request`` got ``tokens`` from position ``start``; ``samples`` when it reaches
  the end of its known tokens (a new token comes out of this step); on admission ``admitted`` and
  ``cached`` (prompt tokens found in the prefix cache).
- ``skipped``: a running ``request`` got nothing this step (``reason``: ``token_budget`` or
  ``latency_target``).
- ``blocked``: admission stopped at waiting request ``head`` for ``reason`` (``token_budget``,
  ``latency_target``: what the step's decodes left of ``--target-itl-ms``, ``seats``, ``kv_blocks``,
  ``preempted_this_step``, ``prompt_cap``: the step admitted ``--max-prompts-per-step`` already,
  ``memory``: a running request needed blocks this step); the other
  ``waiting - 1`` requests waited behind it (policy order). One a step at most: the volume does
  not grow with the queue.
- ``end``: the step ran; the events after it (finishes) carry its end time.
- ``grammar``: a waiting ``request`` was passed over while its grammar compiles.
- ``adapter``: a waiting ``request`` was passed over: its LoRA adapter would be one more than
  ``--max-loras`` among those running.
- ``preempted``: ``request`` lost its blocks to make room for ``by`` (``reason``: ``kv_blocks``
  for a running request that needed them, ``seats`` or ``kv_blocks`` for a waiting one the policy
  admitted in its place).
- ``finished``: ``request`` left with ``reason`` (``stop``, ``length``, ``abort``, ``error``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import msgspec

from cadence.request import Request

# Why admission stopped at a waiting request (the ``blocked`` event's reason).
TOKEN_BUDGET = "token_budget"
LATENCY_TARGET = "latency_target"  # what the step's decodes leave of --target-itl-ms
SEATS = "seats"
KV_BLOCKS = "kv_blocks"
PREEMPTED_THIS_STEP = "preempted_this_step"
PROMPT_CAP = "prompt_cap"  # the step admitted --max-prompts-per-step already
MEMORY = "memory"


def ranked_path(path: str | Path, rank: int, num_ranks: int) -> str | Path:
    """The trace file of engine core ``rank`` of ``num_ranks``: ``path`` itself, or ``path.dpRANK``
    when there are several (the engine's data-parallel cores, a simulated fleet)."""
    return path if num_ranks == 1 else f"{path}.dp{rank}"


class SchedulingTrace:
    """Writes one scheduler's events to a JSONL file (replacing it), flushed once a step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._encoder = msgspec.json.Encoder()
        self.step = 0
        self.time = 0.0

    def engine(self, description: Mapping[str, Any], simulated: bool) -> None:
        """The first event: what the steps ran on (see the module's docstring)."""
        self.event("engine", simulated=simulated, **description)

    def at(self, step: int, time: float) -> None:
        """The step being built and the policy's time now: stamped on every event until the next call."""
        self.step, self.time = step, time

    def begin_step(self, step: int, time: float) -> None:
        """A step is being built: what the previous one wrote (its finishes included) goes out first."""
        self._file.flush()
        self.at(step, time)

    def event(self, name: str, **fields: Any) -> None:
        self._file.write(self._encoder.encode({"event": name, "step": self.step, "t": self.time, **fields}) + b"\n")

    def end_step(self, step: int, time: float) -> None:
        """The step ran: its outputs (tokens, finishes) are stamped with its end."""
        self.at(step, time)
        self.event("end")

    def arrival(self, request: Request, step: int, time: float) -> None:
        self.at(step, time)
        self.event("arrival", request=request.request_id, client_id=request.client_id,
                   prompt_tokens=request.num_prompt_tokens, max_tokens=request.max_tokens,
                   priority=request.priority, user=request.user, extra_args=dict(request.extra_args))

    def finished(self, request_id: str, reason: str | None, time: float) -> None:
        self.time = time
        self.event("finished", request=request_id, reason=reason)

    def scheduled(self, request: Request, tokens: int, admitted: bool) -> None:
        # The most frequent event (one per request per step): written without the generic path.
        start = request.num_computed_tokens
        event = {"event": "scheduled", "step": self.step, "t": self.time, "request": request.request_id,
                 "tokens": tokens, "start": start, "samples": start + tokens == request.num_tokens}
        if admitted:
            event["admitted"] = True
            event["cached"] = start  # an admission starts after its prefix-cache hit
        self._file.write(self._encoder.encode(event) + b"\n")

    def close(self) -> None:
        self._file.close()
