"""From request bodies to what the engine takes: prompts as token ids, and :class:`SamplingParams`.

Every check that can fail runs here, before anything is admitted, and fails with a 400 that says
what to change and names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from cadence.api.errors import APIError, bad_request, from_value_error
from cadence.api.protocol import INT64_MAX, ChatMessage, CompletionRequest, ResponseFormat, SamplingFields
from cadence.engine.admission import ModelLimits
from cadence.engine.prefix_tokenizer import Encode, plain_encode
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

_PARAM_FIELDS = frozenset(SamplingParams.__struct_fields__)
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The legacy completions endpoint's default.
DEFAULT_COMPLETION_TOKENS = 16

def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's ``SamplingParams``, with its ``constraint`` (from :func:`structured_outputs`,
    checked).

    :raises APIError: 400 for a value ``SamplingParams`` rejects, or a ``seed`` whose last sequence's
        seed (``seed + n - 1``: each of the ``n`` sequences gets ``seed + index``) is over 64 bits.
    """

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    stop = req.stop
    n = pick(req.n, 1)
    if req.seed is not None and req.seed + n - 1 > INT64_MAX:
        raise bad_request(f"seed must be at most {INT64_MAX - n + 1} with n={n}: sequence i gets seed + i, which must "
                          f"fit in 64 bits", param="seed")
    try:
        return SamplingParams(
            n=n,
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, 0),
            min_p=pick(req.min_p, 0.0),
            seed=req.seed,
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            logit_bias=req.logit_bias or None,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            structured_outputs=constraint,
            extra_args=req.vllm_xargs or None,
        )
    except ValueError as exc:
        raise from_value_error(exc, _PARAM_FIELDS) from None


def structured_outputs(req: SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint, from ``response_format`` or ``structured_outputs``, and the
    field that holds it; not yet checked (``APIState.constraints`` does that, off the event loop).

    A JSON schema comes back as its compact text (the constraint's key), not as parsed JSON: what
    travels to the engine core is then a string, whatever numbers the schema holds (msgpack carries
    no integer beyond 64 bits).

    :raises APIError: 400 naming the field, for both fields at once, or a ``json_schema`` format
        without a schema.
    """
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        constraint = req.structured_outputs
        if constraint is None:
            return None
        kind, spec = constraint.key
        param = f"structured_outputs.{kind}"
    elif req.structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
    else:
        constraint, param = _response_format_constraint(fmt)
        kind, spec = constraint.key
    if kind == "json":
        constraint = StructuredOutputsParams(json=spec)
    return constraint, param


def _response_format_constraint(fmt: ResponseFormat) -> tuple[StructuredOutputsParams, str]:
    """The constraint of a JSON ``response_format``, and the field that holds it."""
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema), "response_format.json_schema.schema"


def check_stream_options(req: SamplingFields) -> bool:
    """Whether to send a usage chunk. :raises APIError: for stream options without ``stream``."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def max_tokens_for(requested: int | None, default: int | None, num_prompt_tokens: int, limits: ModelLimits,
                   *, param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The request's ``max_tokens``: as asked (if the context has room), else ``default`` or all the
    room left, capped by the context.

    :raises APIError: 400 ``context_length_exceeded`` when the prompt, or the prompt plus an explicit
        ``max_tokens``, does not fit the context.
    """
    limit = limits.max_model_len
    if num_prompt_tokens >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt has "
                          f"{num_prompt_tokens} tokens; shorten it to at most {limit - 1} tokens",
                          param=prompt_param, code="context_length_exceeded")
    room = limit - num_prompt_tokens
    if requested is None:
        kv_room = limits.kv_capacity_tokens - num_prompt_tokens
        return max(1, min(room, kv_room, default if default is not None else room))
    if requested > room:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                          f"for the completion); reduce the prompt or {param}",
                          param=param, code="context_length_exceeded")
    return requested


@dataclass(frozen=True)
class TextBound:
    """The most text that can still fit the context: ``max_model_len`` tokens of at most
    ``token_bytes`` bytes each (:func:`longest_token_bytes`). A longer text is refused before it is
    tokenized, however long it is."""

    max_model_len: int
    token_bytes: int

    @property
    def max_bytes(self) -> int:
        return self.max_model_len * self.token_bytes

    def check(self, text_bytes: int, param: str) -> None:
        """:raises APIError: 400 ``context_length_exceeded`` for ``text_bytes`` over :attr:`max_bytes`."""
        if text_bytes > self.max_bytes:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens, and no token "
                              f"stands for more than {self.token_bytes} bytes of text, so no prompt over "
                              f"{self.max_bytes} bytes can fit; this one has {text_bytes} bytes. Shorten it",
                              param=param, code="context_length_exceeded")


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest entry of the
    vocabulary (added tokens included) as the tokenizer spells it, which is never shorter than the
    text it stands for (byte-level BPE spells a byte in 1 or 2 bytes, SentencePiece a space as "▁",
    3 bytes, a byte-fallback token as "<0x41>"). Assumes no normalizer that deletes text.
    """
    return max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)


def num_prompts(req: CompletionRequest) -> int:
    """How many prompts the request holds (before they are checked)."""
    prompt = req.prompt
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def completion_prompts(req: CompletionRequest, tokenizer: PreTrainedTokenizerBase,
                       bound: TextBound | None = None, encode: Encode | None = None) -> list[tuple[list[int], str]]:
    """The request's prompts (one or a batch) as token ids, each with its text (for ``echo``).

    :raises APIError: 400 for an empty or mixed ``prompt``, or a text over ``bound``.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids", param="prompt")
    if bound is not None:  # every text before any is tokenized
        for item in items:
            if isinstance(item, str):
                bound.check(len(item.encode()), "prompt")
    prompts = []
    tokens_of = encode or plain_encode(tokenizer)
    for item in items:
        if isinstance(item, str):
            prompts.append((tokens_of(item, req.add_special_tokens), item))
        else:
            text = str(tokenizer.decode(item)) if req.echo and all(0 <= t < len(tokenizer) for t in item) else ""
            prompts.append((list(item), text))
    return prompts


@dataclass(frozen=True)
class ChatTemplateArgs:
    """What a chat template gets beside the messages (transformers' ``apply_chat_template``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None  # function objects, as transformers takes them
    template: str | None = None  # the server's --chat-template, else the tokenizer's own
    kwargs: dict[str, Any] | None = None  # the request's chat_template_kwargs


# chat_template_kwargs that would override what the server passes itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_prompt(messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase,
                args: ChatTemplateArgs = ChatTemplateArgs(), bound: TextBound | None = None,
                encode: Encode | None = None) -> list[int]:
    """Render the conversation with the chat template, as ``LLM.chat`` does: tool calls of earlier
    assistant turns with their arguments as objects, tool answers with their call's id.

    :raises APIError: 400 for an unknown role, non-text content, arguments that are not a JSON
        object, a reserved or clashing template option, a template that rejects it, or contents that
        together are over ``bound`` (a template renders every message's content).
    """
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if args.continue_final_message and args.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(args.kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    conversation = [_conversation_entry(message, i) for i, message in enumerate(messages)]
    if bound is not None:
        bound.check(sum(len(entry["content"].encode()) for entry in conversation), "messages")
    if args.template is None and getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        rendered: Any = tokenizer.apply_chat_template(
            conversation, tools=args.tools, chat_template=args.template,
            add_generation_prompt=args.add_generation_prompt, continue_final_message=args.continue_final_message,
            tokenize=False, **(args.kwargs or {}))
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    # What apply_chat_template(tokenize=True) does with the text: the template writes the specials.
    return (encode or plain_encode(tokenizer))(rendered, False)


def _conversation_entry(message: ChatMessage, index: int) -> dict[str, Any]:
    if message.role not in _ROLES:
        raise bad_request(f"messages[{index}].role must be one of {', '.join(sorted(_ROLES))}, got "
                          f"{message.role!r}", param=f"messages[{index}].role")
    entry: dict[str, Any] = {
        # Chat templates know "system"; OpenAI's "developer" is its newer name.
        "role": "system" if message.role == "developer" else message.role,
        "content": _text_content(message, index),
    }
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name, "arguments": call_arguments(
                 call.function.arguments, f"messages[{index}].tool_calls[{j}].function.arguments")}}
            for j, call in enumerate(message.tool_calls)]
    return entry


def call_arguments(text: str, param: str) -> dict[str, Any]:
    """A call's arguments (the field ``param``) as the object templates expect (they render it with
    ``tojson``).

    :raises APIError: 400 naming ``param`` for text that is not a JSON object (or nests past what
        the parser can hold: the body's depth check cannot see inside a string).
    """
    arguments = json_object(text)
    if arguments is None:
        raise bad_request(f"{param} must be a JSON object", param=param)
    return arguments


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` holds; None for anything else (nesting past the parser's stack too)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _text_content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{index}].content[{j}] is of type {part.type!r}; this server takes "
                                "only text parts", param=f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)
