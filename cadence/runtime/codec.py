"""msgpack encoding of the message union, one encoder/decoder pair per channel, built once.

Tensors and numpy arrays travel as raw buffers in a msgpack extension (dtype, shape, bytes), never
as pickles: a frame can only ever decode into the declared message types.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
import torch

T = TypeVar("T")

_EXT_ARRAY = 1
# numpy has no bfloat16: such tensors travel as their raw 16-bit patterns.
_TORCH_ONLY = {"bfloat16": torch.bfloat16}


class _ArrayHeader(msgspec.Struct, array_like=True):
    kind: str  # "numpy" or "torch"
    dtype: str
    shape: tuple[int, ...]


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.view(torch.int16) if name in _TORCH_ONLY else tensor
        return _ext(_ArrayHeader("torch", name, tuple(tensor.shape)), raw.numpy())
    if isinstance(obj, np.ndarray):
        return _ext(_ArrayHeader("numpy", obj.dtype.str, obj.shape), np.ascontiguousarray(obj))
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext(header: _ArrayHeader, array: np.ndarray) -> msgspec.msgpack.Ext:
    head = _header_encoder.encode(header)
    return msgspec.msgpack.Ext(_EXT_ARRAY, len(head).to_bytes(4, "little") + head + array.tobytes())


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_ARRAY:
        raise ValueError(f"unknown msgpack extension type {code}")
    try:
        return _decode_array(data)
    except Exception as exc:  # a dtype numpy or torch does not know (TypeError), a bad header...: a bad frame
        raise ValueError(f"malformed array in msgpack extension: {type(exc).__name__}: {exc}") from None


def _decode_array(data: memoryview) -> Any:
    size = int.from_bytes(data[:4], "little")
    header = _header_decoder.decode(data[4:4 + size])
    payload = data[4 + size:]
    if header.kind == "numpy":
        return np.frombuffer(payload, dtype=np.dtype(header.dtype)).reshape(header.shape).copy()
    if header.dtype in _TORCH_ONLY:
        raw = torch.from_numpy(np.frombuffer(payload, dtype=np.int16).copy())  # also when empty
        return raw.view(_TORCH_ONLY[header.dtype]).reshape(header.shape)
    array = np.frombuffer(payload, dtype=np.dtype(header.dtype)).reshape(header.shape)
    return torch.from_numpy(array.copy())


class Codec(Generic[T]):
    """Encodes and decodes one channel's message type (usually a union of tagged Structs)."""

    def __init__(self, message_type: type[T] | Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type, ext_hook=_ext_hook)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        """:raises msgspec.DecodeError, ValueError: for a frame that is not a valid message of this channel."""
        return self._decoder.decode(frame)
