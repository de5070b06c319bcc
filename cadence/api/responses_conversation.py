"""A Responses API request as the chat endpoint's vocabulary (docs/tools_and_reasoning.md): its
input items as chat messages for the chat template, its function tools and ``tool_choice`` as chat
tools (so that cadence/api/tools.py decides the mode and its constraint), its sampling fields, and
its output constraint (``text.format`` or vLLM's ``structured_outputs``).

Input items, in order: a message (role and text, or text parts) is a chat message; a
``function_call`` joins the assistant message before it (or opens one) as a tool call; a
``function_call_output`` is a ``tool`` message answering its call, which must come before it (in
the input or in the stored conversation it continues); a ``reasoning`` item is dropped, as vLLM
drops earlier reasoning. Any other item, or a part that is not text, is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from cadence.api.errors import bad_request, from_validation_error
from cadence.api.params import call_arguments, json_object, structured_outputs
from cadence.api.protocol import (
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JSONSchemaFormat,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
)
from cadence.api.responses_protocol import (
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionToolCall,
    InputPart,
    MessageInput,
    OutputItem,
    OutputMessage,
    ResponsesRequest,
)
from cadence.api.tools import ToolChoice
from cadence.sampling_params import StructuredOutputsParams

T = TypeVar("T")
_ITEM_KINDS: dict[str, type[Any]] = {
    "message": MessageInput, "function_call": FunctionCallInput, "function_call_output": FunctionCallOutputInput}
_TEXT_PARTS = ("input_text", "output_text")


def input_messages(req: ResponsesRequest, earlier: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The request's input as chat messages, after the ``earlier`` conversation it continues.

    :raises APIError: 400 naming the item (``input[i]...``) for an empty input, an item of another
        type, a part that is not text, arguments that are not a JSON object, or an output whose call
        does not come before it.
    """
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise bad_request("input must not be empty", param="input")
    calls = {call.id for message in earlier for call in message.tool_calls or []}
    messages: list[ChatMessage] = []
    for i, raw in enumerate(req.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "reasoning":
            continue
        if not isinstance(kind, str) or kind not in _ITEM_KINDS:
            raise bad_request(f"{where} is of type {kind!r}; this server takes message, function_call, "
                              "function_call_output and reasoning items", param=f"{where}.type")
        item = _item(raw, _ITEM_KINDS[kind], where)
        if isinstance(item, MessageInput):
            messages.append(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")))
        elif isinstance(item, FunctionCallInput):
            call_arguments(item.arguments, f"{where}.arguments")  # templates render them as an object
            calls.add(item.call_id)
            _add_call(messages, MessageToolCall(id=item.call_id,
                                                function=FunctionCall(name=item.name, arguments=item.arguments)))
        else:
            if item.call_id not in calls:
                raise bad_request(f"{where} answers call {item.call_id!r}, but no function_call with that call_id "
                                  "comes before it", param=f"{where}.call_id")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output,
                                                                                              f"{where}.output")))
    return messages


def with_instructions(req: ResponsesRequest, messages: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation the template renders: ``instructions`` (this request's only, as OpenAI) first."""
    return messages if req.instructions is None else [ChatMessage(role="system", content=req.instructions), *messages]


def output_messages(items: Sequence[OutputItem]) -> list[ChatMessage]:
    """A response's output as the assistant turn a later request continues from: its text and its
    calls (reasoning dropped, and calls whose arguments are no JSON object: cut short, or cut by a
    stop string, they would make every later turn a 400 about a field the client never sent)."""
    texts = [part.text for item in items if isinstance(item, OutputMessage) for part in item.content]
    calls = [MessageToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in items if isinstance(item, FunctionToolCall) and item.status == "completed"
             and json_object(item.arguments) is not None]
    if not texts and not calls:
        return []
    message = ChatMessage(role="assistant", content="".join(texts) if texts else None)
    if calls:
        message.tool_calls = calls
    return [message]


def chat_tools(req: ResponsesRequest) -> list[ChatTool]:
    return [ChatTool(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
        for tool in req.tools or []]


def chat_tool_choice(req: ResponsesRequest) -> ToolChoice | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))


def sampling_fields(req: ResponsesRequest) -> SamplingFields:
    """The fields ``params.sampling_params`` reads, from the request's own."""
    return SamplingFields(
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stop, logit_bias=req.logit_bias,
        user=req.user, top_k=req.top_k, repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        priority=req.priority, structured_outputs=req.structured_outputs, vllm_xargs=req.vllm_xargs)


def has_output_constraint(req: ResponsesRequest) -> bool:
    return req.structured_outputs is not None or (req.text is not None and req.text.format.type != "text")


def output_constraint(req: ResponsesRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The request's own output constraint and the field it comes from: ``text.format`` (JSON, or
    JSON under a schema) or ``structured_outputs``; not yet checked.

    :raises APIError: 400 naming the field, for both at once or a ``json_schema`` without a schema or a name.
    """
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return structured_outputs(SamplingFields(structured_outputs=req.structured_outputs))
    if req.structured_outputs is not None:
        raise bad_request("give text.format or structured_outputs, not both", param="structured_outputs")
    if fmt.type == "json_object":
        found = structured_outputs(SamplingFields(response_format=ResponseFormat(type="json_object")))
        param = "text.format"
    else:
        for name in ("schema", "name"):
            if getattr(fmt, name) is None:
                raise bad_request(f"text.format of type json_schema needs {name}", param=f"text.format.{name}")
        found = structured_outputs(SamplingFields(response_format=ResponseFormat(
            type="json_schema", json_schema=JSONSchemaFormat(name=fmt.name, schema=fmt.schema))))
        param = "text.format.schema"
    assert found is not None  # a JSON format always has its constraint
    return found[0], param


def template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """What the chat template gets from ``reasoning``: ``effort: "none"`` turns thinking off, as vLLM does."""
    return {"enable_thinking": False} if req.reasoning is not None and req.reasoning.effort == "none" else None


def _item(raw: dict[str, Any], kind: type[T], where: str) -> T:
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        inner = from_validation_error(exc).param
        raise bad_request(f"{where}: {exc}", param=f"{where}.{inner}" if inner else where) from None


def _text(content: str | list[InputPart], where: str) -> str | list[ContentPart]:
    """An item's text, or its text parts (the template joins them as chat parts)."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"{where}[{j}] is of type {part.type!r}; this server takes only text parts "
                              f"({', '.join(_TEXT_PARTS)})", param=f"{where}[{j}].type")
    return [ContentPart(type="text", text=part.text) for part in content]




def _add_call(messages: list[ChatMessage], call: MessageToolCall) -> None:
    """A call joins the assistant message just before it (its text, or the calls of the same turn)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
