"""The LoRA adapters the server serves by name (docs/lora.md): those of ``--lora-modules``, and with
runtime updating those ``POST /v1/load_lora_adapter`` adds and ``/v1/unload_lora_adapter`` removes.

A request whose ``model`` is an adapter's name runs with its :class:`LoRARequest`. Each adapter
added gets a fresh ``lora_int_id`` (1, 2, ...), also a name loaded again after an unload: workers
keep loaded weights by that id and the prefix cache keys blocks by it, so new weights under an old
name never meet the old ones' state. Removing a name only stops new requests from naming it;
requests already running carry their ``LoRARequest`` and finish with it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from cadence.errors import InvalidRequestError
from cadence.lora_request import LoRARequest

if TYPE_CHECKING:
    from cadence.engine.admission import ModelLimits

# vLLM's switch for the load and unload endpoints, honoured as vLLM reads it.
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoRAModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``--lora-modules`` item (vLLM's ``LoRAModulePath``): the adapter at ``path`` served as
    ``name``, its card's ``parent`` being ``base_model_name`` (default: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


_module_decoder = msgspec.json.Decoder(LoRAModule)


def parse_lora_module(item: str) -> LoRAModule:
    """A ``--lora-modules`` item in either of vLLM's forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}``.

    :raises ValueError: saying which form was expected (argparse reports it as a bad value).
    """
    if item.lstrip().startswith("{"):
        try:
            module = _module_decoder.decode(item)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{item!r} is not a JSON object with name, path and optionally base_model_name: "
                             f"{exc}") from None
    else:
        name, sep, path = item.partition("=")
        module = LoRAModule(name.strip(), path.strip()) if sep else LoRAModule("", "")
    if not module.name or not module.path:
        raise ValueError(f"{item!r}: give NAME=PATH, or a JSON object with name and path")
    return module


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter as served: what its requests run with, the base model's name its card gives as
    ``parent``, and when it was added (its card's ``created``)."""

    lora_request: LoRARequest
    parent: str
    created: int


class LoRAAdapters:
    """Served adapter names -> :class:`ServedAdapter`, none of them a base model's served name.

    Used from the event loop only: each method runs to its end without yielding, so two loads of
    one name cannot both succeed.
    """

    def __init__(self, limits: ModelLimits, base_model_names: Sequence[str]) -> None:
        self._limits = limits
        self._base_names = tuple(base_model_names)
        self._ids = itertools.count(1)
        self._served: dict[str, ServedAdapter] = {}

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``, after checking that it fits the model and
        ``--max-lora-rank`` (reading its config and tensor headers only: the workers read the weights).

        :raises InvalidRequestError: saying what to change; ``param`` is ``lora_name`` (taken),
            ``lora_path`` (no adapter there, or one that does not fit) or ``base_model_name``.
        """
        if self._limits.lora is None:
            raise InvalidRequestError("LoRA is off on this server: start it with --enable-lora to serve adapters")
        if not name:
            raise InvalidRequestError("give the adapter a name", "lora_name")
        if name in self._base_names:
            raise InvalidRequestError(f"{name!r} is the name of a served base model; give the adapter another "
                                      "name", "lora_name")
        if name in self._served:
            raise InvalidRequestError(f"The LoRA adapter {name!r} has already been loaded; unload it first to "
                                      "load other weights under its name", "lora_name")
        if base_model_name is not None and base_model_name not in self._base_names:
            raise InvalidRequestError(f"base_model_name {base_model_name!r} is not a served model name (served: "
                                      f"{', '.join(self._base_names)})", "base_model_name")
        # Imported here: admission pulls in transformers, which parsing --lora-modules must not.
        from cadence.engine.admission import check_lora

        # The id is drawn only once the adapter passed: ids stay 1, 2, ... in the order served.
        try:
            check_lora(self._limits, LoRARequest(name, 1, path))
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from None
        lora_request = LoRARequest(name, next(self._ids), path)
        self._served[name] = ServedAdapter(lora_request, base_model_name or self._base_names[0], int(time.time()))
        return lora_request

    def remove(self, name: str, lora_int_id: int | None = None) -> LoRARequest | None:
        """Stop serving ``name`` (only if its id is ``lora_int_id``, when given); what it ran with,
        or None if no such adapter is served."""
        served = self._served.get(name)
        if served is None or (lora_int_id is not None and served.lora_request.lora_int_id != lora_int_id):
            return None
        del self._served[name]
        return served.lora_request

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)

    def __iter__(self) -> Iterator[ServedAdapter]:
        """In the order they were added."""
        return iter(self._served.values())

    def __len__(self) -> int:
        return len(self._served)
