"""The command line and the config tree: flags reach the engine, bad values fail clearly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cadence import config
from cadence.cli import main
from cadence.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_memory,
    resolve_dtype,
    resolve_quantization,
)
from cadence.engine_args import EngineArgs


def test_generate_prints_the_greedy_text(make_tiny_model: Callable[..., Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(make_tiny_model("llama"))
    assert main(["generate", "--model", folder, "--dtype", "float32", "--prompt", "Hello world",
                 "--max-tokens", "6", "--ignore-eos"]) == 0
    from cadence import LLM, SamplingParams

    expected = LLM(model=folder, dtype="float32").generate(
        "Hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"


def test_cli_reports_bad_values_without_a_traceback(make_tiny_model: Callable[..., Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(make_tiny_model("llama"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", folder, "--prompt", "x", "--temperature", "-1"])
    assert exit_info.value.code == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", folder, "--prompt", "x", "--policy", "nope"])
    assert "installed policies: chunked-prefill, fair, fcfs, priority, sjf" in capsys.readouterr().err


def test_engine_args_build_the_config_tree(make_tiny_model: Callable[..., Path]) -> None:
    config = EngineArgs(model=str(make_tiny_model("llama")), dtype="float32", kv_cache_memory="64MiB",
                        max_num_seqs=8, enable_chunked_prefill=False).create_config()
    assert config.model.max_model_len == 512
    assert config.cache.kv_cache_memory == 64 * 2**20
    assert config.scheduler.max_num_batched_tokens == 2048  # at least max_model_len without chunking
    assert config.scheduler.max_num_seqs == 8


@pytest.mark.parametrize(("field", "default", "chosen"), [
    ("max_num_batched_tokens", 2048, 512),
    ("target_itl_ms", 0.0, 100.0),  # vLLM's schedule: whole budgets, no latency target
])
def test_scheduler_defaults_are_vllms_schedule_and_yield_to_the_user(
        make_tiny_model: Callable[..., Path], field: str, default: float, chosen: float) -> None:
    folder = str(make_tiny_model("llama"))
    assert getattr(EngineArgs(model=folder).create_config().scheduler, field) == default
    assert getattr(EngineArgs(model=folder, **{field: chosen}).create_config().scheduler, field) == chosen


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ModelConfig(path="m", dtype="float8", max_model_len=10), "dtype must be one of"),
    (lambda: CacheConfig(block_size=12), "block_size must be a power of two"),
    (lambda: CacheConfig(num_blocks=1), "num_blocks must be at least 2"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be at least 1"),
    (lambda: DeviceConfig(device="nonsense"), "is not a torch device"),
    (lambda: EngineConfig(model=ModelConfig(path="m", dtype="float32", max_model_len=4096),
                          scheduler=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)),
     "without chunked prefill, max_num_batched_tokens"),
    (lambda: parse_memory("lots"), "cannot read memory size"),
    (lambda: ModelConfig(path="m", dtype="float32", max_model_len=10, quantization="fp8"),
     "quantization must be one of"),
    (lambda: ModelConfig(path="m", dtype="float32", max_model_len=10, quantization="gguf"),
     r"give a \.gguf model file"),
])
def test_bad_config_values_raise_config_errors(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_auto_quantization_keeps_a_gguf_files_types_on_the_cpu_only(make_tiny_model: Callable[..., Path]) -> None:
    assert resolve_quantization("auto", "m.gguf") == "gguf"
    assert resolve_quantization("auto", "m.gguf", "cuda:0") == "none"  # no kernel there
    assert resolve_quantization("auto", None) == "none"
    assert resolve_quantization("int8", None, "cuda") == "int8"
    folder = str(make_tiny_model("llama"))
    assert EngineArgs(model=folder).create_config().model.quantization == "none"
    assert EngineArgs(model=folder, quantization="int8").create_config().model.quantization == "int8"
    with pytest.raises(ConfigError, match=r"give a \.gguf model file"):
        EngineArgs(model=folder, quantization="gguf").create_config()


@pytest.mark.parametrize(("flags", "dtype"), [
    ("fpu sse2 avx2 fma f16c", "bfloat16"),  # the AVX2 bf16 GEMM's CPUs
    ("fpu avx512f avx512_bf16", "bfloat16"),
    ("fpu amx_bf16 amx_tile", "bfloat16"),
    ("fpu sse2 avx fma f16c", "float32"),  # no AVX2
    ("fpu sse2 avx2 f16c", "float32"),  # no FMA
    ("fp asimd", "float32"),  # an Arm CPU
])
def test_auto_dtype_is_bf16_where_cadence_has_a_bf16_gemm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          flags: str, dtype: str) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(config, "_CPUINFO", str(cpuinfo))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == dtype
    assert resolve_dtype("float32") == "float32"  # what the user names is kept


def test_memory_sizes() -> None:
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory("1e9") == 10**9
    assert parse_memory(4096) == 4096


def test_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        EngineArgs(model=str(tmp_path)).create_config()


def _parse(verb: str, *flags: str) -> EngineArgs:
    from cadence.cli import build_parser
    from cadence.engine_args import engine_args_from

    return engine_args_from(build_parser().parse_args([verb, *flags]))


@pytest.mark.parametrize("verb", ["generate", "serve", "simulate", "bench throughput"])
def test_every_engine_option_is_a_flag_of_every_verb_with_the_same_default(verb: str) -> None:
    from dataclasses import fields

    # Each verb takes the same flags, made from EngineArgs' fields: parsed with none, they give EngineArgs().
    assert _parse(*verb.split()) == EngineArgs()
    flags = {f.name: f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in fields(EngineArgs)}
    assert flags["policy_options"] == "--policy-option"


def test_engine_flags_parse_into_engine_args() -> None:
    args = _parse("serve", "--model", "m", "--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "2GiB",
                  "--no-enable-prefix-caching", "--max-num-batched-tokens", "256", "-tp", "2", "-dp", "3",
                  "--policy", "priority", "--policy-option", "chunked=true", "--policy-option", "x=a=b",
                  "--distributed-executor-backend", "mp")
    assert args == EngineArgs(model="m", dtype="float32", max_model_len=64, kv_cache_memory="2GiB",
                              enable_prefix_caching=False, max_num_batched_tokens=256, tensor_parallel_size=2,
                              data_parallel_size=3, policy="priority", policy_options={"chunked": "true", "x": "a=b"},
                              distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="--policy-option takes KEY=VALUE, got 'chunked'"):
        _parse("generate", "--policy-option", "chunked")
