"""The transport codec: every message of the union round-trips, tensors and arrays travel bit-exact
as a msgpack extension (bfloat16 included), and a bad frame raises instead of decoding into anything."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from cadence import messages as m
from cadence.runtime.codec import Codec
from cadence.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
PARAMS = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={4: 1.5, 300: -100.0},
                        max_tokens=None, min_tokens=2, stop=["\n", "END"], stop_token_ids=[7, 9], ignore_eos=True,
                        include_stop_str_in_output=True, skip_special_tokens=False, logprobs=2,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
LOGPROBS = m.TokenLogprobs([5, 5, 9], [-0.125, -0.125, -2.5], sampled_rank=1)
STATS = m.SchedulerStats(2, 1, 0.25, 30, 40, 512, 128, 3, num_steps=9, step_time_s=0.5, forward_time_s=0.25,
                         spec_decode=m.SpecDecodeStats(4, 10, 6, 10, [3, 2, 1, 0]), lora=m.LoRAStats(2, ["a"], []))
BITMASK = torch.tensor([[-1, 0, 5], [2**31 - 1, -(2**31), 1]], dtype=torch.int32)

STEP = m.SchedulerOutput(
    step_id=7,
    new_requests=[m.NewRequestData("r1", [1, 2, 3, 4], 3, PARAMS, 2, [[5, 6], [1]], 0),
                  m.NewRequestData("r4", [8], 1, SamplingParams(), None, [[7], [2]], 0)],
    cached_requests=[m.CachedRequestData("r2", [[9], []], 17)],
    num_scheduled_tokens={"r1": 4, "r2": 1, "r4": 1},
    finished_request_ids=["r0"],
    preempted_request_ids=["r3"],
    grammar_bitmask=m.GrammarBitmask(["r1", "r2"], BITMASK),
)

REQUEST = m.EngineCoreRequest("r1", [1, 2, 3], PARAMS, eos_token_id=2, arrival_time=1.5, priority=-1, user="ann")
OUTPUTS = m.EngineCoreOutputs([m.EngineCoreOutput("r1", [11], [LOGPROBS], "stop", 16, queue_time_s=0.5),
                               m.EngineCoreOutput("r2", [], finish_reason="error", error="grammar did not compile",
                                                  prompt_logprobs=[LOGPROBS])],
                              timestamp=3.0, stats=STATS)

EXAMPLES: list[Any] = [
    REQUEST,
    m.EngineCoreRequest("é#/\u0000" * 3, [0], SamplingParams(), eos_token_id=None, arrival_time=0.0),
    m.EngineCoreRequest("rx", [1], SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "array"}')),
                        eos_token_id=0, arrival_time=2.0),
    m.EngineCoreRequest("ry", [1], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                        eos_token_id=0, arrival_time=2.0),
    m.EngineCoreRequest("rz", [1], SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
                        eos_token_id=0, arrival_time=2.0),
    m.AbortRequests(["r1", "r2"]),
    m.AbortRequests([]),
    STEP,
    m.SchedulerOutput(8, [], [], {}, [], []),
    m.ModelRunnerOutput(7, ["r1", "r2"], [11, 12], [LOGPROBS, LOGPROBS], forward_time_s=0.01,
                        prompt_logprobs=[m.PromptLogprobs("r2", 1, [LOGPROBS, LOGPROBS])]),
    m.ModelRunnerOutput(8, ["r1"], [13]),
    m.ExecutorFailed(7, "boom"),
    m.WorkerReady(rank=1, num_blocks=40, kernel_row_limit=16),
    m.WorkerFailed(rank=1, error="RuntimeError: boom"),
    OUTPUTS,
    m.EngineCoreOutputs([], timestamp=3.5,
                        kv_delta=m.KVCacheDelta(stored=[2**64 - 1, 0, 7], removed=[9], cleared=True)),
    m.EngineCoreReady(num_blocks=40, block_size=16, policy="fcfs (chunked=true)"),
    m.EngineDead("engine core exited"),
    m.TrackRequest("r1", [1, 2, 3], PARAMS),
    m.DetokenizedOutputs([m.SequenceDelta("r1", "hi ✓", [11], [LOGPROBS], "stop", "\n", 16, 0.25),
                          m.SequenceDelta("r2", "", [], finish_reason="stop", stop_reason=7),
                          m.SequenceDelta("r3", "", [], error="engine died")]),
    m.CompletionOutput(index=1, text="ab", token_ids=[1, 2], cumulative_logprob=-0.25, logprobs=[LOGPROBS],
                       finish_reason="length", stop_reason=None),
    m.RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], finished=True, num_cached_tokens=16,
                    queue_time_s=0.5, error="x",
                    outputs=[m.CompletionOutput(index=0, text="a", token_ids=[3], finish_reason="stop",
                                                stop_reason="\n")]),
]

TAGGED = tuple(cls for cls in vars(m).values()
               if isinstance(cls, type) and issubclass(cls, m._Message) and cls is not m._Message)
UNION = m.EngineCoreInput | m.EngineCoreEvent | m.SchedulerOutput | m.WorkerReply | m.ExecutorFailed \
    | m.TrackRequest | m.DetokenizedOutputs


def assert_same(actual: Any, expected: Any) -> None:
    """Deep equality that also holds for tensors and arrays: same type, dtype, shape and bits."""
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(_bits(actual), _bits(expected))
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert actual.tobytes() == expected.tobytes()
    elif isinstance(expected, msgspec.Struct):
        for name in expected.__struct_fields__:
            assert_same(getattr(actual, name), getattr(expected, name))
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    else:
        assert actual == expected


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so NaN == NaN, and -0.0 != 0.0)."""
    if tensor.dtype.is_floating_point and tensor.element_size() in (2, 4, 8):
        return tensor.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    return tensor


def round_trip(value: Any, type_: Any = None) -> Any:
    codec: Codec[Any] = Codec(type(value) if type_ is None else type_)
    return codec.decode(codec.encode(value))


# ---- messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_through_its_own_codec(message: Any) -> None:
    assert_same(round_trip(message), message)


@pytest.mark.parametrize("message", [e for e in EXAMPLES if isinstance(e, m._Message)],
                         ids=lambda msg: type(msg).__name__)
def test_tagged_messages_round_trip_through_one_union_codec(message: Any) -> None:
    assert_same(round_trip(message, UNION), message)


def test_the_examples_cover_every_message_type() -> None:
    seen: set[type] = set()

    def walk(value: Any) -> None:
        if isinstance(value, msgspec.Struct):
            seen.add(type(value))
            for name in value.__struct_fields__:
                walk(getattr(value, name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(EXAMPLES)
    assert set(TAGGED) <= seen
    assert {m.CompletionOutput, m.RequestOutput} <= seen


def test_the_channel_unions_decode_each_of_their_members() -> None:
    inputs: Codec[Any] = Codec(m.EngineCoreInput)
    events: Codec[Any] = Codec(m.EngineCoreEvent)
    for message in (REQUEST, m.AbortRequests(["a"])):
        assert_same(inputs.decode(inputs.encode(message)), message)
    for message in (OUTPUTS, m.EngineCoreReady(3, 16, "fcfs (chunked=true)"), m.EngineDead("x")):
        assert_same(events.decode(events.encode(message)), message)


def test_a_step_carries_its_grammar_bitmask_bit_exact() -> None:
    decoded = round_trip(STEP)
    assert decoded.grammar_bitmask.request_ids == ["r1", "r2"]
    assert decoded.grammar_bitmask.bitmask.dtype == torch.int32
    assert decoded.grammar_bitmask.bitmask.tolist() == [[-1, 0, 5], [2**31 - 1, -(2**31), 1]]
    assert decoded.total_num_scheduled_tokens == 6


def test_structured_outputs_keep_their_constraint() -> None:
    decoded = round_trip(REQUEST)
    constraint = decoded.sampling_params.structured_outputs
    assert constraint.json == SCHEMA and constraint.key == PARAMS.structured_outputs.key
    assert decoded.sampling_params.logit_bias == {4: 1.5, 300: -100.0}
    assert decoded.sampling_params.max_tokens is None


# ---- tensors and arrays --------------------------------------------------------------------

TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                torch.int8, torch.uint8, torch.bool, torch.complex64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensors_round_trip_bit_exact(dtype: torch.dtype) -> None:
    tensor = _sample(dtype)
    decoded = round_trip(tensor, torch.Tensor)
    assert_same(decoded, tensor)


def test_bfloat16_special_values_keep_their_bits() -> None:
    patterns = torch.tensor([0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7FC1, 0x0001, -0x7FFF, 0x3F80, 0x7F7F],
                            dtype=torch.int16)  # 0, -0, inf, -inf, NaN, NaN payload, subnormals, 1, max
    tensor = patterns.view(torch.bfloat16).reshape(2, 5)
    decoded = round_trip(tensor, torch.Tensor)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (2, 5)
    assert decoded.view(torch.int16).flatten().tolist() == patterns.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (1, 1, 1, 7)], ids=repr)
def test_tensors_of_any_shape_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _sample(dtype, shape)
    assert_same(round_trip(tensor, torch.Tensor), tensor)


def test_views_and_autograd_tensors_travel_as_plain_contiguous_values() -> None:
    base = _sample(torch.float32, (4, 6))
    for tensor in (base.t(), base[::2, 1::3], base.expand(2, 4, 6), base.requires_grad_(True) * 2):
        decoded = round_trip(tensor, torch.Tensor)
        assert torch.equal(decoded, tensor.detach())
        assert decoded.is_contiguous() and not decoded.requires_grad


def test_a_decoded_tensor_owns_its_memory() -> None:
    codec: Codec[torch.Tensor] = Codec(torch.Tensor)
    for tensor in (torch.arange(6, dtype=torch.int32), torch.ones(4, dtype=torch.bfloat16)):
        frame = bytearray(codec.encode(tensor))
        decoded = codec.decode(frame)
        frame[-4:] = b"\xff\xff\xff\xff"
        assert torch.equal(decoded, tensor)
        decoded += 1  # writeable, without a warning about a read-only buffer


NUMPY_ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.array([[1.5, -0.0], [np.nan, np.inf]], dtype=np.float64),
    np.arange(-5, 5, dtype=np.int64),
    np.array([0, 1, 65535], dtype=np.uint16),
    np.array([True, False, True]),
    np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian: the byte order travels with the dtype
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    np.array(3.25, dtype=np.float16),
    np.zeros((0, 4), dtype=np.float32),
]


@pytest.mark.parametrize("array", NUMPY_ARRAYS, ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_numpy_arrays_round_trip_bit_exact(array: np.ndarray) -> None:
    decoded = round_trip(array, np.ndarray)
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    assert np.array_equal(decoded, array, equal_nan=True)
    assert decoded.tobytes() == np.ascontiguousarray(array).tobytes()
    assert decoded.flags.writeable


def test_numpy_and_torch_stay_apart() -> None:
    array, tensor = np.arange(3, dtype=np.int32), torch.arange(3, dtype=torch.int32)
    assert type(round_trip(array, Any)) is np.ndarray
    assert type(round_trip(tensor, Any)) is torch.Tensor
    with pytest.raises(msgspec.ValidationError, match="Expected `Tensor`"):
        Codec(torch.Tensor).decode(Codec(np.ndarray).encode(array))
    with pytest.raises(msgspec.ValidationError, match=r"Expected `numpy\.ndarray`"):
        Codec(np.ndarray).decode(Codec(torch.Tensor).encode(tensor))


def test_a_value_the_codec_does_not_know_is_not_encoded() -> None:
    with pytest.raises(NotImplementedError, match="cannot encode object"):
        Codec(Any).encode({"x": object()})


# ---- bad frames ----------------------------------------------------------------------------


def test_a_frame_of_another_channel_is_refused() -> None:
    frame = Codec(m.EngineCoreInput).encode(m.AbortRequests(["r1"]))
    with pytest.raises(msgspec.DecodeError):  # a ValidationError is a DecodeError
        Codec(m.EngineCoreEvent).decode(frame)


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x00\xff garbage", b"\x92\xa3abc\x01",
                                   msgspec.msgpack.encode({"request_ids": ["r"]}),
                                   msgspec.msgpack.encode(["AbortRequests", [1, 2]]),
                                   msgspec.msgpack.encode(["Nonexistent", "x"])], ids=repr)
def test_garbage_is_refused(frame: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        Codec(m.EngineCoreInput).decode(frame)


@pytest.mark.parametrize("message", [REQUEST, STEP, OUTPUTS], ids=lambda msg: type(msg).__name__)
def test_every_truncation_of_a_frame_is_refused(message: Any) -> None:
    codec: Codec[Any] = Codec(UNION)
    frame = codec.encode(message)
    for end in range(len(frame)):
        with pytest.raises(msgspec.DecodeError):
            codec.decode(frame[:end])


def test_an_unknown_extension_code_is_refused() -> None:
    frame = msgspec.msgpack.encode(["GrammarBitmask", ["r"], msgspec.msgpack.Ext(7, b"\x00" * 8)])
    with pytest.raises(ValueError, match="unknown msgpack extension type 7"):
        Codec(m.GrammarBitmask).decode(frame)


def test_an_extension_where_no_array_belongs_is_refused() -> None:
    frame = msgspec.msgpack.encode(["AbortRequests", [msgspec.msgpack.Ext(1, b"\x00" * 8)]])
    with pytest.raises(msgspec.DecodeError):
        Codec(m.EngineCoreInput).decode(frame)


def _array_ext(kind: str, dtype: str, shape: tuple[int, ...], payload: bytes) -> msgspec.msgpack.Ext:
    """An array extension written by hand, as a stray sender could."""
    header = msgspec.msgpack.encode([kind, dtype, list(shape)])
    return msgspec.msgpack.Ext(1, len(header).to_bytes(4, "little") + header + payload)


BAD_ARRAYS = {
    "payload-not-the-shape": _array_ext("numpy", "<i4", (2, 3), b"\x00" * 20),
    "payload-not-whole-elements": _array_ext("torch", "<i4", (1,), b"\x00" * 5),
    "odd-bfloat16-payload": _array_ext("torch", "bfloat16", (1,), b"\x00" * 3),
    "object-dtype": _array_ext("numpy", "|O", (1,), b"\x00" * 8),
    "unknown-dtype": _array_ext("numpy", "nonsense", (1,), b"\x00"),
    "dtype-torch-lacks": _array_ext("torch", "<U1", (1,), b"\x00" * 4),
    "header-not-a-header": msgspec.msgpack.Ext(1, (3).to_bytes(4, "little") + b"\x93\xc1\xc1"),
    "header-too-short": msgspec.msgpack.Ext(1, b"\x01"),
}


@pytest.mark.parametrize("ext", BAD_ARRAYS.values(), ids=BAD_ARRAYS.keys())
def test_a_malformed_array_is_refused_as_documented(ext: msgspec.msgpack.Ext) -> None:
    """Where a tensor belongs, and where any value may go (a JSON schema inside a request)."""
    bitmask = msgspec.msgpack.encode(["GrammarBitmask", ["r"], ext])
    with pytest.raises((msgspec.DecodeError, ValueError)):
        Codec(m.GrammarBitmask).decode(bitmask)
    request = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], {"structured_outputs": {"json": {"a": ext}}},
                                      None, 0.0])
    with pytest.raises((msgspec.DecodeError, ValueError)):
        Codec(m.EngineCoreInput).decode(request)


def test_a_well_formed_array_where_a_json_schema_belongs_is_refused() -> None:
    """It decodes as an array; the params refuse it (the engine core could not make its grammar key)."""
    request = Codec[Any](m.EngineCoreInput).encode(
        ["EngineCoreRequest", "r", [1], {"structured_outputs": {"json": {"a": np.arange(3)}}}, None, 0.0])
    with pytest.raises(msgspec.ValidationError, match=r"structured_outputs\.json is not a JSON value"):
        Codec(m.EngineCoreInput).decode(request)


def test_whatever_fails_inside_an_array_extension_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(data: memoryview) -> Any:
        raise RuntimeError("unforeseen")

    monkeypatch.setattr("cadence.runtime.codec._decode_array", explode)
    frame = Codec(m.GrammarBitmask).encode(m.GrammarBitmask(["r"], BITMASK))
    with pytest.raises(ValueError, match=r"^malformed array in msgpack extension: RuntimeError: unforeseen$"):
        Codec(m.GrammarBitmask).decode(frame)
