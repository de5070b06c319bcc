"""A GGUF file's architecture, read from its metadata header before anything is converted
(``loader.gguf_architecture``), against docs/models.md's GGUF table and transformers' own
``load_gguf_checkpoint``; and the refusal of one cadence cannot run, with nothing written to the cache.

The files are written here with ``gguf.GGUFWriter``: metadata and one 2x4 tensor, a few hundred bytes.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from cadence.config import ConfigError
from cadence.models import loader
from cadence.models.loader import gguf_architecture, resolve_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ENDIANS = pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["le", "be"])
# A row of the GGUF table: | `architecture` | general.name | `Class` or (refused: ...) |
_GGUF_ROW = re.compile(r"^\| `([\w-]+)` \| ([^|]+) \| ([^|]+) \|$", re.MULTILINE)
# Keys transformers needs of a metadata-only file of these architectures before it names a model_type.
_REQUIRED = {"lfm2": {"lfm2.attention.head_count_kv": [0, 2]}}


def write_gguf(path: Path, architecture: str, name: str | None = None,
               endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, keys_last: bool = True) -> Path:
    """A GGUF file of ``architecture`` with a small vocabulary (string, float and int arrays), a
    few scalars and one tensor. ``keys_last`` puts general.architecture and general.name after all
    of those, so that reading them means skipping every kind of value; otherwise they come first."""
    writer = gguf.GGUFWriter(path, architecture, endianess=endian)
    if name is not None:
        writer.add_name(name)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "a", "b", "ab"])
    writer.add_token_scores([0.0, -1.0, -2.0, -3.5])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_uint32(f"{architecture}.context_length", 512)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_uint64("general.file_type_wide", 7)
    for key, value in _REQUIRED.get(architecture, {}).items():
        writer.add_array(key, value)
    if keys_last:
        # GGUFWriter writes general.architecture first (its constructor adds it): move both to the end.
        kv = writer.kv_data[0]
        for key in ("general.architecture", "general.name"):
            if key in kv:
                kv[key] = kv.pop(key)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_class(path: Path) -> str | None:
    """The causal-LM class transformers builds of ``path`` (None: it cannot read the file, or makes
    no causal LM of it): its ``load_gguf_checkpoint``'s model_type, as ``AutoModelForCausalLM`` maps it."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except ValueError:  # "GGUF model with architecture ... is not supported yet"
        return None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])


def cadence_class(path: Path) -> str | None:
    try:
        return gguf_architecture(path)[1]
    except ConfigError:
        return None


def documented_rows() -> list[tuple[str, str | None, str | None]]:
    """docs/models.md's GGUF table as ``(architecture, a general.name to write, class or None)``,
    a row per name its second column allows (``None``: no general.name at all)."""
    section = DOC.read_text().split("### GGUF files", 1)[1].split("\n## ", 1)[0]
    rows: list[tuple[str, str | None, str | None]] = []
    for architecture, names, converted in _GGUF_ROW.findall(section):
        expected = None if converted.startswith("(refused") else converted.strip("` ")
        if names == "`mistral`":
            spellings: list[str | None] = ["mistral"]
        elif names == "anything but `mistral`":
            spellings = [None, "SmolLM2 135M Instruct", "Mistral", "mistral-7b"]
        else:
            assert names == "any", f"docs/models.md GGUF table: unexpected general.name column {names!r}"
            spellings = [None, "Some Model 7B"]
        rows += [(architecture, name, expected) for name in spellings]
    assert len(rows) > 10, "docs/models.md has no GGUF table under '### GGUF files'"
    return rows


@ENDIANS
@pytest.mark.parametrize(("architecture", "name", "expected"), documented_rows())
def test_each_documented_row(tmp_path: Path, architecture: str, name: str | None, expected: str | None,
                             endian: gguf.GGUFEndian) -> None:
    path = write_gguf(tmp_path / "model.gguf", architecture, name, endian)
    assert transformers_class(path) == expected, "docs/models.md disagrees with transformers"
    if expected is None:
        with pytest.raises(ConfigError, match=re.escape(repr(architecture))):
            gguf_architecture(path)
    else:
        assert gguf_architecture(path) == (architecture, expected)


def _every_architecture() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = [name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer")]
    # llama.cpp's own spellings of the renamed ones, and some transformers cannot read.
    return [*readable, "qwen2moe", "qwen3moe", "gpt-oss", "minimax-m2", "t5encoder", "rwkv6", "llama4", "mamba2"]


@pytest.mark.parametrize("architecture", _every_architecture())
@pytest.mark.parametrize("name", [None, "mistral", "UMT5 small"])
def test_every_architecture_agrees_with_transformers(tmp_path: Path, architecture: str, name: str | None) -> None:
    path = write_gguf(tmp_path / "model.gguf", architecture, name, keys_last=False)
    assert cadence_class(path) == transformers_class(path)


def test_reads_no_further_than_the_two_keys(tmp_path: Path) -> None:
    """With both keys first, the rest of the file (vocabulary, tensors) is never read: cut off
    right after them, the file still gives its architecture."""
    path = write_gguf(tmp_path / "model.gguf", "llama", "mistral", keys_last=False)
    header = 4 + 4 + 8 + 8  # magic, version, tensor count, key count
    pairs = [("general.architecture", "llama"), ("general.name", "mistral")]
    end = header + sum(8 + len(key) + 4 + 8 + len(value) for key, value in pairs)
    path.write_bytes(path.read_bytes()[:end])
    assert gguf_architecture(path) == ("llama", "MistralForCausalLM")


@pytest.mark.parametrize("keep", [0, 3, 10, 24, 60, 200], ids=lambda n: f"{n}-bytes")
def test_a_truncated_file_is_refused(tmp_path: Path, keep: int) -> None:
    path = write_gguf(tmp_path / "model.gguf", "llama", "SmolLM2")
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ConfigError, match="GGUF"):
        gguf_architecture(path)


def _header(version: int = 3, tensors: int = 0, keys: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("content", [
    b"",
    b"not a model at all, just some text that happens to end in .gguf\n",
    b'{"__metadata__": {}}',  # a safetensors-like header
    b"GGUF" + struct.pack("<I", 1) + bytes(16),  # version 1
    _header() + struct.pack("<Q", 1 << 62),  # a key 4 EiB long
    _header() + struct.pack("<Q", (1 << 64) - 1),
    _header() + _string(b"general.architecture") + struct.pack("<IQ", 8, 1 << 40),  # a 1 TiB string
    _header(keys=2) + _string(b"t") + struct.pack("<IIQ", 9, 4, 1 << 60),  # an array of 2^60 uint32s
    _header(keys=2) + _string(b"t") + struct.pack("<IIQ", 9, 8, 1) + struct.pack("<Q", (1 << 64) - 1),
    _header(keys=2) + _string(b"t") + struct.pack("<I", 77),  # no such value type
    _header(keys=0),  # no keys at all
    # arrays of arrays 5,000 deep: 60 KB that once made the reader recurse until Python gave up
    _header(keys=2) + _string(b"t") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0),
], ids=["empty", "text", "json", "v1", "huge-key", "max-key", "huge-string", "huge-array", "huge-array-string",
        "bad-type", "no-keys", "deep-arrays"])
def test_a_file_that_is_not_a_readable_gguf_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        gguf_architecture(path)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cadence's cache in a fresh folder, where a conversion would write."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """``loader.convert_gguf`` replaced: it records the file and writes a bare config.json."""
    converted: list[Path] = []

    def fake_convert(gguf_path: Path, dest: Path) -> None:
        converted.append(gguf_path)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    return converted


# Guaranteed not to run: no cadence family (rwkv6: transformers cannot read it; t5: no causal LM),
# and gpt-oss, which transformers converts to a class cadence does not register.
@pytest.mark.parametrize(("architecture", "says"), [
    ("gpt-oss", "GptOssForCausalLM, which cadence does not run"),
    ("rwkv6", "which transformers cannot convert"),
    ("t5", "not to a causal language model"),
])
def test_resolve_model_refuses_before_converting_or_writing(tmp_path: Path, cache: Path, conversions: list[Path],
                                                           architecture: str, says: str) -> None:
    path = write_gguf(tmp_path / f"{architecture}.gguf", architecture, "Some Model")
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        resolve_model(str(path))
    assert path.name in str(caught.value)
    assert conversions == []
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))


def test_unregistered_class_refusal_names_what_is_installed(tmp_path: Path, cache: Path,
                                                             conversions: list[Path]) -> None:
    from cadence.models.registry import installed_architectures

    path = write_gguf(tmp_path / "oss.gguf", "gpt-oss")
    with pytest.raises(ConfigError) as caught:
        resolve_model(str(path))
    assert "'gpt-oss'" in str(caught.value) and "docs/models.md" in str(caught.value)
    assert all(name in str(caught.value) for name in installed_architectures())


@ENDIANS
def test_resolve_model_converts_a_supported_file_once(tmp_path: Path, cache: Path, conversions: list[Path],
                                                       endian: gguf.GGUFEndian) -> None:
    path = write_gguf(tmp_path / "smol.gguf", "llama", "SmolLM2", endian)
    folder = Path(resolve_model(str(path)))
    assert folder.parent == cache / "gguf" and (folder / "config.json").is_file()
    assert resolve_model(str(path)) == str(folder)
    assert conversions == [path]
