"""The HTTP API's bodies as msgspec Structs: requests (decoded and range-checked in one pass) and
responses (encoded as OpenAI's published spec has them).

Request fields keep OpenAI's names and ranges, plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``priority``,
``structured_outputs``, ``vllm_xargs`` ...). Most
are nullable, as in the spec: a client may send ``null`` for "the default". Unknown fields are
ignored, as vLLM does.

Responses: a field the spec marks nullable and required is always sent (``null`` when empty); an
optional field without a value is omitted (``msgspec.UNSET``), never sent as ``null``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from cadence.sampling_params import StructuredOutputsParams

# ---- requests ------------------------------------------------------------------------------

# vLLM's default cap on logprobs (the spec allows 5 for completions, 20 for chat).
MAX_LOGPROBS = 20
# Every integer is range-checked here, at the edge, to what the engine carries: msgpack (the engine
# core's codec) holds no integer beyond 64 bits, and nothing downstream should meet one it cannot
# store. JSON numbers are always finite here: msgspec refuses 1e999 ("Number out of range").
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Temperature = Annotated[float, Meta(ge=0, le=2)]
Probability = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TokenCount = Annotated[int, Meta(ge=0, le=INT32_MAX)]
# Vocabularies are far below 2**31; the model's own bound is checked at admission.
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
# SamplingParams says what a too small top_k means; here only the storage bound.
TopK = Annotated[int, Meta(ge=INT32_MIN, le=INT32_MAX)]
# 64 bits, as vLLM's; sequence i of n gets seed + i, checked in params.sampling_params.
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
# 32 bits: any ordering a client needs, and room for a policy's arithmetic (aging) within 64 bits.
Priority = Annotated[int, Meta(ge=INT32_MIN, le=INT32_MAX)]
# vllm_xargs: scalars only, integers within what msgpack carries, a bounded count and key length.
ExtraArgs = Annotated[
    dict[Annotated[str, Meta(max_length=64)], str | bool | Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | float],
    Meta(max_length=64)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; cadence never obfuscates


class JSONSchemaFormat(Struct, kw_only=True):
    name: str | None = None  # OpenAI requires a name; nothing here uses it
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(Struct, kw_only=True):
    """OpenAI's ``response_format``: plain text, any JSON object (JSON mode), or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields both generation endpoints share."""

    model: str | None = None
    n: NumChoices | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: TokenCount = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Priority = 0
    structured_outputs: StructuredOutputsParams | None = None
    # The request's own fields for scheduling policies (a deadline, an SLO class): vLLM's name.
    vllm_xargs: ExtraArgs | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them."""

    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool | None = None  # null: false, as the spec allows
    logprobs: NumLogprobs | None = None
    best_of: Annotated[int, Meta(ge=INT32_MIN, le=INT32_MAX)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(Struct, kw_only=True):
    """A function call an assistant made: its name and its arguments, a JSON object as text."""

    name: str
    arguments: str


class MessageToolCall(Struct, kw_only=True):
    """A tool call of an earlier assistant turn (in a request), or of this answer (in a response)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True):
    role: str
    # As OpenAI: a list of parts holds at least one.
    content: str | Annotated[list[ContentPart], Meta(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer to that call


class FunctionDefinition(Struct, kw_only=True):
    # OpenAI's rule for a function's name.
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # accepted: required and named choices always enforce the schema


class ChatTool(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``: a conversation rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions: the chat template's switches
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Struct, kw_only=True):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter folder ``lora_path`` as model ``lora_name``."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_path: Annotated[str, Meta(min_length=1)]


class UnloadLoRAAdapterRequest(Struct, kw_only=True):
    """``POST /v1/unload_lora_adapter`` (vLLM's); with ``lora_int_id``, only if the name still has that id."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_int_id: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = None


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class CompletionLogprobs(Struct):
    tokens: list[str]
    # null for an echoed prompt's first token, which has no logprob (as OpenAI's legacy API and vLLM)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    # Streamed chunks carry null until the choice ends (OpenAI's and vLLM's practice; the spec's
    # shared completion schema has no nullable here).
    finish_reason: str | None


class CompletionResponse(Struct):
    """A completion and, with ``stream``, each of its chunks (the spec gives both one shape)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    refusal: str | None = None
    tool_calls: list[MessageToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # vLLM's extension, with a reasoning parser


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of a tool call: the first of each call has its id, type and name, the others
    fragments of its arguments, as OpenAI streams them."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: DeltaFunctionCall | UnsetType = UNSET


class DeltaMessage(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    # With ``stream_options.include_usage``: null on every chunk but the last (as the spec says).
    usage: Usage | UnsetType | None = UNSET


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: Literal["model"] = "model"
    owned_by: str = "cadence"
    # vLLM's: a base model's path (parent null); a LoRA adapter's folder, and the base model's served name.
    root: str | None = None
    parent: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


class VersionResponse(Struct):
    version: str


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorInfo


_encoder = msgspec.json.Encoder()


def encode(body: Struct) -> bytes:
    return _encoder.encode(body)
