"""The Responses API's bodies (``POST /v1/responses``) as msgspec Structs: the request, decoded and
range-checked in one pass, and the ``response`` object with its output items, encoded as OpenAI's
published spec has them (its stream events are in ``responses_events.py``).

``input`` stays a list of plain objects here: an input message may leave out its ``type``, which a
tagged union cannot take, so ``responses_conversation.py`` reads each item by its type and names the
item in any error. Request fields keep OpenAI's names, plus vLLM's extensions for the Responses API
(``top_k``, ``repetition_penalty``, ``seed``, ``stop``, ``structured_outputs`` ...). Unknown fields
are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from cadence.api.protocol import INT32_MAX, ExtraArgs, Priority, Probability, Seed, Temperature, TokenId, TopK
from cadence.sampling_params import StructuredOutputsParams

# ---- requests ------------------------------------------------------------------------------

# OpenAI's rule for a function's name (as for chat tools).
ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
# OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=16)]


class InputPart(Struct, kw_only=True):
    """A part of an input item's content; text parts (``input_text``, ``output_text``) are served."""

    type: str
    text: str | None = None


class MessageInput(Struct, kw_only=True):
    """An input message (OpenAI's easy form and its item form): a role and text."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    type: Literal["message"] = "message"


class FunctionCallInput(Struct, kw_only=True):
    """A call the model made in an earlier turn."""

    call_id: Annotated[str, Meta(min_length=1)]
    name: str
    arguments: str
    type: Literal["function_call"] = "function_call"


class FunctionCallOutputInput(Struct, kw_only=True):
    """What the client's function answered to an earlier call."""

    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[InputPart]
    type: Literal["function_call_output"] = "function_call_output"


class FunctionTool(Struct, kw_only=True):
    """A function the model may call (the Responses API's flat form of a chat tool); echoed whole."""

    type: Literal["function"]
    name: ToolName
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # accepted: required and named choices always enforce the schema
    description: str | None = None


class FunctionChoice(Struct, kw_only=True):
    """A ``tool_choice`` that names the function to call."""

    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    """``text.format``: plain text, any JSON object, or JSON under a schema (``name`` and ``schema``
    are required for the last, as OpenAI requires them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


def _plain_text() -> TextFormat:
    return TextFormat(type="text")


class TextConfig(Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=_plain_text)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Struct, kw_only=True):
    """``reasoning``: accepted and echoed; ``effort: "none"`` turns a template's thinking off."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    """``POST /v1/responses``: text or items in, output items out, optionally continuing a stored
    response (``previous_response_id``)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # null: true, as OpenAI
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    background: bool | None = None
    # Features of OpenAI's that this server does not have: refused by name, never ignored.
    conversation: Any = None
    prompt: Any = None
    # vLLM's extensions
    seed: Seed | None = None
    top_k: TopK | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[TokenId, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Priority = 0
    structured_outputs: StructuredOutputsParams | None = None
    vllm_xargs: ExtraArgs | None = None


# ---- responses -----------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """The model's reasoning, as its reasoning parser split it off (no summary is made)."""

    id: str
    status: ItemStatus
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)


class OutputMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    content: list[OutputText] = msgspec.field(default_factory=list)
    role: Literal["assistant"] = "assistant"


class FunctionToolCall(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionToolCall


class InputTokensDetails(Struct):
    cached_tokens: int
    cache_write_tokens: int = 0  # the spec requires it; cadence bills no cache writes


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"]


class Response(Struct, kw_only=True):
    """The ``response`` object: what was made, and the request's settings echoed as the spec requires
    (``temperature`` and ``top_p`` as applied)."""

    id: str
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    instructions: str | None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    reasoning: ReasoningConfig | None
    text: TextConfig
    metadata: dict[str, str] | None
    store: bool
    object: Literal["response"] = "response"
    completed_at: int | None = None
    error: None = None  # a failure is an HTTP error, or an ``error`` event once streaming
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | UnsetType = UNSET  # once done
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    user: str | UnsetType = UNSET
