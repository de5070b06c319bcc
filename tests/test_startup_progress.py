"""Start-up progress: a first start converts the GGUF and compiles the CPU kernels, about 75 s here,
and says what it is doing on the ``cadence.startup`` logger, which shows at the default WARNING
level; a start with both cached says only what it loads and when it is ready.

The conversion runs transformers' GGUF reader in production; here transformers' loaders are
replaced by ones returning a tiny model, and the compiler by a fake that writes the build's files.
"""

from __future__ import annotations

import io
import logging
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGUFWriter

from cadence.backends import cpu_kernels
from cadence.config import CacheConfig, EngineConfig, ModelConfig
from cadence.executor.worker import Worker
from cadence.models import loader
from cadence.startup_log import startup


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """``lines()``: the start-up lines so far, with the root logger at WARNING, as under ``cadence serve``."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield lambda: [r.getMessage() for r in caplog.records if r.name == startup.name and r.levelno == logging.INFO]
    finally:
        root.setLevel(level)


def test_gguf_conversion_says_each_stage_once(make_tiny_model: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              lines: Callable[[], list[str]]) -> None:
    tiny = make_tiny_model("llama")
    gguf = tmp_path / "Tiny.Q4_1.gguf"
    # A llama GGUF's metadata header (read before converting, to refuse what cadence cannot run),
    # then 2 MiB that only the fakes below stand for.
    writer = GGUFWriter(gguf, "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with gguf.open("ab") as file:
        file.write(bytes(2 << 20))
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "cache"))
    asked: list[Any] = []
    load_model = transformers.AutoModelForCausalLM.from_pretrained
    load_tokenizer = transformers.AutoTokenizer.from_pretrained

    def fake_model(folder: Path, **kwargs: Any) -> Any:
        asked.append(kwargs["gguf_file"])
        return load_model(tiny, dtype=kwargs["dtype"])

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    tokenizers = types.SimpleNamespace(from_pretrained=lambda *args, **kwargs: load_tokenizer(tiny))
    monkeypatch.setattr(loader, "AutoTokenizer", tokenizers)

    folder = Path(loader.resolve_model(str(gguf)))
    assert asked == [gguf.name] and (folder / "config.json").is_file()
    said = lines()
    assert [re.sub(r"[\d.]+ s\b", "N s", line) for line in said] == [
        f"converting {gguf.name} (2 MiB) to a Hugging Face folder, once; cached at {folder}",
        "GGUF: reading the metadata and dequantizing the weights to fp32 ...",
        "GGUF: weights done at N s; converting the tokenizer ...",
        f"converted {gguf.name} in N s",
    ]

    assert loader.resolve_model(str(gguf)) == str(folder)  # cached: no conversion, nothing said
    assert lines() == said


def _fake_compiler(calls: list[str]) -> Callable[..., None]:
    """``torch.utils.cpp_extension.load`` writing what a build writes: an object file per source, then
    the library."""

    def load(name: str, sources: list[str], build_directory: str, **kwargs: Any) -> None:
        calls.append(name)
        out = Path(build_directory)
        library = out / f"{name}.so"
        if library.is_file():
            return  # cached: ninja has nothing to do
        for source in sources:
            (out / Path(source).with_suffix(".o").name).write_bytes(b"")
        library.write_bytes(b"")

    return load


@pytest.fixture
def compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fake compiler on an AVX-512 CPU with an empty kernel cache; the builds it was asked for."""
    from torch.utils import cpp_extension

    calls: list[str] = []
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpp_extension, "load", _fake_compiler(calls))
    return calls


def test_a_kernel_build_is_announced_with_an_estimate_and_timed(compiler: list[str],
                                                                 lines: Callable[[], list[str]]) -> None:
    cpu_kernels.cpu_ops.__wrapped__()  # uncached: a build
    said = lines()
    name = f"cadence_cpu_kernels_{cpu_kernels.build_key()}"
    assert compiler == [name] and len(said) == 2
    estimate = cpu_kernels.build_estimate_s()
    assert said[0] == f"compiling the CPU kernels, once for these sources (about {estimate} s) ..."
    assert re.fullmatch(r"compiled the CPU kernels in [\d.]+ s \(cached in .*/cache/kernels/[0-9a-f]{16}\)", said[1])

    cpu_kernels.cpu_ops.__wrapped__()  # the library is there: loaded silently
    assert compiler == [name] * 2 and lines() == said


def test_a_kernel_build_draws_a_bar_on_a_terminal(compiler: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = io.StringIO()
    assert cpu_kernels._terminal() is None  # pytest captures stderr: no bar
    monkeypatch.setattr(cpu_kernels, "_terminal", lambda: terminal)
    cpu_kernels.cpu_ops.__wrapped__()
    # an object file per source and the library, counted once the build is done
    files = len(cpu_kernels._SOURCES) + 1
    assert re.search(rf"compiling CPU kernels \|.*\| {files}/{files} files \[00:\d\d of about \d\d:\d\d\]",
                     terminal.getvalue())


def test_build_estimate_shrinks_with_cores_down_to_the_slowest_file(monkeypatch: pytest.MonkeyPatch) -> None:
    estimates = []
    for cores in (1, 2, 16, 64):
        monkeypatch.setattr("os.sched_getaffinity", lambda _, cores=cores: set(range(cores)))
        estimates.append(cpu_kernels.build_estimate_s())
    assert estimates == sorted(estimates, reverse=True) and estimates[0] > estimates[1]
    assert estimates[-1] == estimates[-2] >= cpu_kernels._SLOWEST_SOURCE_S


def test_worker_says_what_it_loads_and_when_it_is_ready(make_tiny_model: Callable[..., Path],
                                                        lines: Callable[[], list[str]]) -> None:
    folder = str(make_tiny_model("llama"))
    config = EngineConfig(model=ModelConfig(path=folder, dtype="float32", max_model_len=512),
                          cache=CacheConfig(num_blocks=8))
    Worker(config, loader.load_hf_config(folder))
    said = [line for line in lines() if "CPU kernels" not in line]  # a build, if the cache was cold
    assert said[0] == f"loading weights: {folder} (float32, sdpa backend)"
    assert re.fullmatch(r"KV cache: 8 blocks of 16 tokens \(0\.00 GiB\); ready in [\d.]+ s", said[1])
    assert len(said) == 2
