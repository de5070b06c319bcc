"""Reading a GGUF file's header without parsing all of it: a few metadata strings, and the index
of its tensors (name, shape, GGML type, where its bytes lie).

``gguf.GGUFReader`` parses the whole metadata first, the vocabulary included: 3 s for SmolLM2's,
10 s for Gemma 3's. Here every value not asked for is stepped over by its length, checked against
what the file has left (a corrupt length would otherwise allocate or seek up to 2^64 bytes).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from cadence.config import ConfigError

# GGUF metadata value types (gguf.GGUFValueType): fixed sizes in bytes; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# Arrays of arrays: real files nest one or two deep; a corrupt one could nest until Python's stack ends.
_GGUF_MAX_NESTING = 32


def gguf_strings(gguf: Path, keys: set[str]) -> dict[str, str]:
    """The string values of those ``keys`` that ``gguf``'s metadata has, reading no further than the
    last of them (GGUF v2/v3, either byte order).

    :raises ConfigError: not a GGUF file, or one that ends inside its metadata (a length or count
        that runs past the end of the file included).
    """
    with gguf.open("rb") as file:
        meta = _GGUFMetadata(file, gguf)
        found: dict[str, str] = {}
        for _ in range(meta.open()):
            if len(found) == len(keys):
                break
            key = meta.string()
            kind = meta.number("I")
            if kind == _GGUF_STRING and key in keys:
                found[key] = meta.string()
            else:
                meta.skip(kind)
        return found


class _GGUFMetadata:
    """A cursor over a GGUF file's header and metadata. Every length is checked against what the
    file has left before it is read or skipped: a corrupt one would otherwise allocate (or seek)
    up to 2^64 bytes."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file, self._path = file, path
        self._size = os.fstat(file.fileno()).st_size
        self._order = "<"
        self.tensor_count = 0

    def open(self) -> int:
        """Read the header (magic, version, tensor count, and the byte order they tell); the number of
        metadata keys that follow."""
        if self._file.read(4) != b"GGUF":
            raise ConfigError(f"{self._path} is not a GGUF file")
        version = self._take(4)
        # Read in the wrong order, a version is a multiple of 65536 (as gguf.GGUFReader tells).
        self._order = "<" if struct.unpack("<I", version)[0] & 0xFFFF else ">"
        if struct.unpack(self._order + "I", version)[0] < 2:
            raise ConfigError(f"{self._path} is GGUF version 1, which nothing reads any more")
        self.tensor_count = self.number("Q")
        return self.number("Q")

    def number(self, fmt: str) -> int:
        value: int = struct.unpack(self._order + fmt, self._take(struct.calcsize(fmt)))[0]
        return value

    @property
    def big_endian(self) -> bool:
        return self._order == ">"

    def tell(self) -> int:
        return self._file.tell()

    def string(self) -> str:
        return self._take(self.number("Q")).decode("utf-8", "replace")

    def skip(self, kind: int, count: int = 1, depth: int = 0) -> None:
        """Step over ``count`` values of GGUF type ``kind`` (inside ``depth`` arrays)."""
        if depth > _GGUF_MAX_NESTING:
            raise ConfigError(f"{self._path} nests metadata arrays over {_GGUF_MAX_NESTING} deep")
        if kind in _GGUF_SIZES:
            self._skip_bytes(_GGUF_SIZES[kind] * count)
        elif kind == _GGUF_STRING:
            for _ in range(count):  # each pass reads 8 bytes: a huge count soon hits the end
                self._skip_bytes(self.number("Q"))
        elif kind == _GGUF_ARRAY:
            for _ in range(count):
                item = self.number("I")
                self.skip(item, self.number("Q"), depth + 1)
        else:
            raise ConfigError(f"{self._path} has a metadata value of unknown type {kind}")

    def _check(self, n: int) -> None:
        if n > self._size - self._file.tell():
            raise ConfigError(f"{self._path} ends inside its GGUF metadata")

    def _take(self, n: int) -> bytes:
        self._check(n)
        return self._file.read(n)

    def _skip_bytes(self, n: int) -> None:
        self._check(n)
        self._file.seek(n, 1)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ``shape`` in torch's order (ggml lists dimensions innermost first),
    and its bytes ``[offset, offset + nbytes)`` of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's architecture, byte order and tensors by name."""

    architecture: str
    big_endian: bool
    tensors: dict[str, GGUFTensorInfo]


_ALIGNMENT_KEY, _DEFAULT_ALIGNMENT = "general.alignment", 32
_UINT32 = 4


def gguf_index(gguf: Path) -> GGUFIndex:
    """The index of ``gguf``'s tensors, read past its metadata (in about a millisecond per MiB of
    vocabulary).

    :raises ConfigError: not a GGUF file, a truncated one, or a tensor of a type ``gguf`` does not know.
    """
    with gguf.open("rb") as file:
        meta = _GGUFMetadata(file, gguf)
        architecture, alignment = "", _DEFAULT_ALIGNMENT
        for _ in range(meta.open()):
            key, kind = meta.string(), meta.number("I")
            if key == "general.architecture" and kind == _GGUF_STRING:
                architecture = meta.string()
            elif key == _ALIGNMENT_KEY and kind == _UINT32:
                alignment = meta.number("I")
            else:
                meta.skip(kind)
        infos = [_tensor_info(meta, gguf) for _ in range(meta.tensor_count)]
        start = -(-meta.tell() // alignment) * alignment
        tensors = {name: GGUFTensorInfo(name, shape, kind, start + offset, _nbytes(shape, kind))
                   for name, shape, kind, offset in infos}
    return GGUFIndex(architecture, meta.big_endian, tensors)


def _tensor_info(meta: _GGUFMetadata, gguf: Path) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = meta.string()
    dims = [meta.number("Q") for _ in range(meta.number("I"))]
    try:
        kind = GGMLQuantizationType(meta.number("I"))
    except ValueError as exc:
        raise ConfigError(f"{gguf}: tensor {name} is of a GGML type this gguf package does not know ({exc})") from None
    return name, tuple(reversed(dims)), kind, meta.number("Q")


def _nbytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    count = 1
    for dim in shape:
        count *= dim
    return count // block * size
