"""A conversation turned into the prompt of a chat-style request (``/v1/chat/completions``,
``/v1/responses``): admission asked first (an overloaded server does no work for a request it
refuses), the chat template rendered and tokenized off the event loop within its deadline, then
the output constraint checked."""

from __future__ import annotations

from cadence.api.errors import APIError
from cadence.api.offload import in_thread
from cadence.api.params import ChatTemplateArgs, chat_prompt
from cadence.api.protocol import ChatMessage
from cadence.api.serving import APIState
from cadence.sampling_params import StructuredOutputsParams


async def conversation_prompt(state: APIState, messages: list[ChatMessage], args: ChatTemplateArgs,
                              constraint: tuple[StructuredOutputsParams, str] | None, *,
                              param: str = "messages") -> list[int]:
    """The prompt's token ids; ``param`` is the request field that holds the conversation.

    :raises APIError: as :meth:`APIState.check_admission`, :func:`chat_prompt` (its errors about the
        whole conversation name ``param``), and ``APIState.constraints.check`` for the constraint and
        the field it comes from.
    """
    state.check_admission(1)
    settings = state.settings
    try:
        prompt_ids = await in_thread(lambda: chat_prompt(messages, state.tokenizer, args, state.text_bound,
                                                         state.prompt_tokens.encode),
                                     timeout_s=settings.preprocess_timeout_s,
                                     what="rendering and tokenizing the messages", param=param)
    except APIError as exc:
        if exc.param == "messages":
            exc.param = param
        raise
    if constraint is not None:
        await state.constraints.check(*constraint)
    return prompt_ids
