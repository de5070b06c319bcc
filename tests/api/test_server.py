"""``cadence serve``'s front (``cadence/api/server.py``) without starting an engine: the verb's flags,
the served model's default name, ``ServeOptions``, and what ``run_server`` hands to ``serve`` (which
is replaced here; the real lifecycle is tested end to end in ``tests/api/test_lifecycle.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import fields
from typing import Any

import pytest

from cadence.api import server
from cadence.api.serving import ServerSettings
from cadence.cli import build_parser
from cadence.engine_args import EngineArgs, engine_args_from


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    server.register(parser.add_subparsers(dest="verb", required=True))
    return parser


@pytest.fixture(autouse=True)
def _no_api_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CADENCE_API_KEY", raising=False)


def test_serve_takes_the_server_flags_with_their_defaults() -> None:
    ns = serve_parser().parse_args(["serve"])
    assert ns.verb == "serve" and ns.run is server.run_server
    assert (ns.host, ns.port, ns.served_model_name, ns.api_key, ns.max_waiting_requests, ns.shutdown_timeout,
            ns.stay_up_on_engine_death) == ("127.0.0.1", 8000, None, None, 1024, 10.0, False)
    # The parser's defaults and ServeOptions' agree.
    options = server.ServeOptions()
    assert (options.host, options.port, options.shutdown_timeout_s, options.stay_up_on_engine_death) == (
        ns.host, ns.port, ns.shutdown_timeout, ns.stay_up_on_engine_death)


def test_serve_takes_every_engine_flag() -> None:
    ns = serve_parser().parse_args(["serve"])
    flags = {f.name for f in fields(EngineArgs)}
    assert flags <= set(vars(ns))
    assert engine_args_from(ns) == EngineArgs()  # every engine default as LLM(...) has it


def test_serve_parses_given_flags() -> None:
    ns = serve_parser().parse_args([
        "serve", "--model", "/models/tiny", "--dtype", "float32", "-tp", "2", "--no-enable-prefix-caching",
        "--policy", "sjf", "--policy-option", "aging=2", "--max-num-seqs", "8",
        "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "a", "b", "--api-key", "k",
        "--max-waiting-requests", "0", "--shutdown-timeout", "2.5", "--stay-up-on-engine-death"])
    assert (ns.host, ns.port, ns.served_model_name, ns.api_key, ns.max_waiting_requests, ns.shutdown_timeout,
            ns.stay_up_on_engine_death) == ("0.0.0.0", 9000, ["a", "b"], "k", 0, 2.5, True)
    assert engine_args_from(ns) == EngineArgs(model="/models/tiny", dtype="float32", tensor_parallel_size=2,
                                              enable_prefix_caching=False, policy="sjf",
                                              policy_options={"aging": "2"}, max_num_seqs=8)


def test_the_api_key_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    assert serve_parser().parse_args(["serve"]).api_key == "from-env"
    assert serve_parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"


@pytest.mark.parametrize(("model", "name"), [
    (None, "SmolLM2-135M-Instruct"),
    ("/models/Qwen2-0.5B-Instruct", "Qwen2-0.5B-Instruct"),
    ("/models/Qwen2-0.5B-Instruct/", "Qwen2-0.5B-Instruct"),  # a trailing slash is not an empty name
    ("models/v1.5", "v1.5"),  # a dot in a folder's name is not a suffix to drop
    ("HuggingFaceTB/SmolLM2-360M", "SmolLM2-360M"),
    ("/gguf/tiny.Q4_K_M.gguf", "tiny.Q4_K_M"),  # a .gguf file: its name without the suffix
    ("~/weights/Model.GGUF", "Model"),
])
def test_default_model_name(model: str | None, name: str) -> None:
    assert server.default_model_name(model) == name


def test_serve_options_defaults_and_immutability() -> None:
    options = server.ServeOptions()
    assert dataclasses.asdict(options) == {"host": "127.0.0.1", "port": 8000, "shutdown_timeout_s": 10.0,
                                           "stay_up_on_engine_death": False, "log_level": "WARNING",
                                           "engine_stall_timeout_s": 120.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.port = 1  # type: ignore[misc]


class Recorded:
    """What ``run_server`` did instead of starting an engine."""

    def __init__(self) -> None:
        self.engine_args: list[EngineArgs] = []
        self.served: list[tuple[Any, ServerSettings, server.ServeOptions]] = []


CONFIG = object()  # stands in for the EngineConfig


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    import prometheus_client

    record = Recorded()

    def create_config(self: EngineArgs) -> Any:
        record.engine_args.append(self)
        return CONFIG

    async def serve(config: Any, settings: ServerSettings, options: server.ServeOptions) -> int:
        record.served.append((config, settings, options))
        return 0

    monkeypatch.setattr(EngineArgs, "create_config", create_config)
    monkeypatch.setattr(server, "serve", serve)
    # A process-wide switch of prometheus_client: leave it as the other tests found it.
    monkeypatch.setattr(prometheus_client, "disable_created_metrics", lambda: None)
    return record


def test_run_server_refuses_a_negative_max_waiting_requests(recorded: Recorded) -> None:
    ns = build_parser().parse_args(["serve", "--model", "/models/tiny", "--max-waiting-requests", "-1"])
    with pytest.raises(ValueError, match=r"^--max-waiting-requests must be >= 0, got -1$"):
        server.run_server(ns)
    assert recorded.served == []


def test_run_server_hands_serve_the_config_settings_and_options(recorded: Recorded) -> None:
    ns = build_parser().parse_args([
        "--log-level", "info", "serve", "--model", "/models/tiny.gguf", "--max-num-seqs", "4", "--api-key", "",
        "--max-waiting-requests", "0", "--host", "0.0.0.0", "--port", "9001", "--shutdown-timeout", "1.5",
        "--stay-up-on-engine-death"])
    assert server.run_server(ns) == 0
    [args] = recorded.engine_args
    assert args == EngineArgs(model="/models/tiny.gguf", max_num_seqs=4)
    [(config, settings, options)] = recorded.served
    assert config is CONFIG
    # An empty key is no key; a limit of 0 is no limit; the name comes from the model's file.
    assert settings == ServerSettings(served_model_names=("tiny",), api_key=None, max_waiting_requests=None)
    assert options == server.ServeOptions(host="0.0.0.0", port=9001, shutdown_timeout_s=1.5,
                                          stay_up_on_engine_death=True, log_level="INFO")


def test_run_server_keeps_given_names_key_and_limit(recorded: Recorded) -> None:
    ns = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--api-key", "k"])
    assert server.run_server(ns) == 0
    [(_, settings, options)] = recorded.served
    assert settings == ServerSettings(served_model_names=("a", "b"), api_key="k", max_waiting_requests=1024)
    assert settings.model_name == "a"
    assert options == server.ServeOptions()
    assert recorded.engine_args == [EngineArgs()]  # serve runs the engine as LLM(...) does


def test_the_request_limits_are_flags_with_their_defaults(recorded: Recorded) -> None:
    ns = serve_parser().parse_args(["serve"])
    assert (ns.max_request_body_bytes, ns.request_read_timeout, ns.preprocess_timeout, ns.grammar_compile_timeout) == (
        4 * 2**20, 10.0, 10.0, 5.0)
    defaults = ServerSettings(served_model_names=("m",))  # the parser's defaults and ServerSettings' agree
    assert (defaults.max_request_body_bytes, defaults.request_read_timeout_s, defaults.preprocess_timeout_s,
            defaults.grammar_compile_timeout_s) == (4 * 2**20, 10.0, 10.0, 5.0)
    ns = build_parser().parse_args(["serve", "--max-request-body-bytes", "1000", "--request-read-timeout", "2.5",
                                    "--preprocess-timeout", "3", "--grammar-compile-timeout", "0.5"])
    assert server.run_server(ns) == 0
    [(_, settings, _)] = recorded.served
    assert (settings.max_request_body_bytes, settings.request_read_timeout_s, settings.preprocess_timeout_s,
            settings.grammar_compile_timeout_s) == (1000, 2.5, 3.0, 0.5)


@pytest.mark.parametrize(("flag", "value"), [("--max-request-body-bytes", "0"), ("--request-read-timeout", "-1"),
                                             ("--preprocess-timeout", "0"), ("--grammar-compile-timeout", "nan")])
def test_a_limit_must_be_positive(recorded: Recorded, flag: str, value: str) -> None:
    ns = build_parser().parse_args(["serve", flag, value])
    with pytest.raises(ValueError, match=f"^{flag} must be > 0, got "):
        server.run_server(ns)
    assert recorded.served == []


def test_the_engine_stall_timeout_reaches_the_engine_and_0_turns_the_watchdog_off(recorded: Recorded) -> None:
    assert server.run_server(build_parser().parse_args(["serve", "--engine-stall-timeout", "30"])) == 0
    assert server.run_server(build_parser().parse_args(["serve", "--engine-stall-timeout", "0"])) == 0
    assert [options.engine_stall_timeout_s for _, _, options in recorded.served] == [30.0, None]
    for bad in ("-1.0", "nan", "inf"):
        with pytest.raises(ValueError, match=f"^--engine-stall-timeout must be >= 0 \\(0: never\\), got {bad}$"):
            server.run_server(build_parser().parse_args(["serve", "--engine-stall-timeout", bad]))
