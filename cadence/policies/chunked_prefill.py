"""FCFS with chunked prefill: decodes first, prompts split to fill what they leave of the budget."""

from __future__ import annotations

from cadence.policies.fcfs import FCFSPolicy


class ChunkedPrefillPolicy(FCFSPolicy):
    """``fcfs`` with ``chunked=true``: running decodes are scheduled before any prefill chunk, and a
    prompt takes at most ``--long-prefill-token-threshold`` tokens a step, so a long prompt never
    stalls the requests that are already generating."""

    name = "chunked-prefill"
    chunked_by_default = True
