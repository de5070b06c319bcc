"""LoRA adapters over HTTP (docs/lora.md): ``--lora-modules``, model selection by adapter name,
``/v1/models`` cards, vLLM's load and unload endpoints, and unloading under load; through real
``cadence serve`` processes of the tiny Llama with PEFT adapters made for it, plus the parts
(module parsing, the registry, settings checks) without a server.

The tests that generate with an adapter need the engine side of LoRA (workers applying adapters):
``test_a_completion_on_an_adapter_equals_peft``, ``test_every_endpoint_reports_the_adapter_s_name``,
``test_load_use_and_unload`` and ``test_unloading_under_load_loses_no_request``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.lora_adapters import make_adapter, peft_greedy
from support.openai_spec import OpenAISpec
from transformers import AutoConfig, AutoTokenizer

from cadence.api import server
from cadence.api.lora_adapters import RUNTIME_UPDATING_ENV, LoRAAdapters, LoRAModule, parse_lora_module
from cadence.api.serving import ServerSettings
from cadence.api.testing import ServerProcess
from cadence.cli import build_parser
from cadence.engine.admission import ModelLimits
from cadence.errors import InvalidRequestError
from cadence.lora.adapter import AdapterLimits

MODEL = "tiny"
LORA_FLAGS = ("--served-model-name", MODEL, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """Adapters of the tiny model (a, b, c, d: servable; big: rank 16, above --max-lora-rank 8),
    one of a model with other MLP shapes (alien), and a folder with a config but no weights (broken)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {name: make_adapter(tiny_model, root / name, rank=rank, seed=seed)
            for name, rank, seed in (("a", 8, 1), ("b", 4, 2), ("c", 8, 3), ("d", 2, 4), ("big", 16, 5))}
    made["alien"] = make_adapter(make_tiny_model("llama", intermediate_size=96), root / "alien", rank=4)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text((made["a"] / "adapter_config.json").read_text())
    made["broken"] = root / "broken"
    return made


@pytest.fixture(scope="module")
def static_server(serve_tiny: Callable[..., ContextManager[ServerProcess]], adapters: dict[str, Path]
                  ) -> Iterator[ServerProcess]:
    """Adapters a and b from the start (b in vLLM's JSON form); no runtime updating."""
    b = json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": MODEL})
    with serve_tiny(*LORA_FLAGS, "--lora-modules", f"a={adapters['a']}", b) as process:
        yield process


@pytest.fixture(scope="module")
def runtime_server(serve_tiny: Callable[..., ContextManager[ServerProcess]], adapters: dict[str, Path]
                   ) -> Iterator[ServerProcess]:
    with serve_tiny(*LORA_FLAGS, "--lora-modules", f"a={adapters['a']}", "--allow-runtime-lora-updating") as process:
        yield process


@pytest.fixture
def static(static_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=static_server.url, timeout=60) as client:
        yield client


@pytest.fixture
def runtime(runtime_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=runtime_server.url, timeout=60) as client:
        yield client


def check_error(spec: OpenAISpec, response: httpx.Response, status: int, param: str | None = None,
                code: str | None = None) -> str:
    """The response is an error in OpenAI's shape with this status (and param and code, if given); its message."""
    assert response.status_code == status, response.text
    body = response.json()
    spec.validate(body, "ErrorResponse")
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return str(body["error"]["message"])


def complete(client: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True, "skip_special_tokens": False})


# ---- /v1/models and model selection (no generation) -------------------------------------------


def test_models_lists_the_adapters_with_parent_and_root(static: httpx.Client, spec: OpenAISpec, tiny_model: Path,
                                                        adapters: dict[str, Path]) -> None:
    models = static.get("/v1/models").json()
    spec.validate(models, "ListModelsResponse")
    base, a, b = models["data"]
    assert [base["id"], a["id"], b["id"]] == [MODEL, "a", "b"]
    assert base["parent"] is None and Path(base["root"]).resolve() == tiny_model.resolve()
    assert (a["parent"], a["root"]) == (MODEL, str(adapters["a"]))
    assert (b["parent"], b["root"]) == (MODEL, str(adapters["b"]))
    assert a["max_model_len"] == base["max_model_len"] == 512
    for card in (base, a):
        one = static.get(f"/v1/models/{card['id']}")
        assert one.status_code == 200 and one.json() == card
        spec.validate(one.json(), "Model")


def test_an_unknown_model_is_404_everywhere(static: httpx.Client, spec: OpenAISpec) -> None:
    for path, body in (("/v1/completions", {"model": "c", "prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "c", "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/responses", {"model": "c", "input": "Hi"}),
                       ("/tokenize", {"model": "c", "prompt": "Hi"})):
        message = check_error(spec, static.post(path, json=body), 404, "model", "model_not_found")
        assert "`c` does not exist" in message and "GET /v1/models lists them" in message
    check_error(spec, static.get("/v1/models/c"), 404, "model", "model_not_found")


def test_tokenize_and_detokenize_take_an_adapter_s_name(static: httpx.Client) -> None:
    base = static.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert static.post("/tokenize", json={"model": "a", "prompt": "Hello world"}).json() == base
    assert static.post("/detokenize", json={"model": "b", "tokens": base["tokens"]}).json() == {
        "prompt": "Hello world"}


def test_the_runtime_routes_are_unknown_unless_allowed(static: httpx.Client, spec: OpenAISpec,
                                                       adapters: dict[str, Path]) -> None:
    check_error(spec, static.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}),
                404)
    check_error(spec, static.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 404)
    assert [m["id"] for m in static.get("/v1/models").json()["data"]] == [MODEL, "a", "b"]


# ---- load and unload (no generation) ----------------------------------------------------------


def test_loading_refuses_taken_names_and_bad_adapters(runtime: httpx.Client, spec: OpenAISpec,
                                                      adapters: dict[str, Path], tmp_path: Path) -> None:
    def load(name: str, path: Path | str) -> httpx.Response:
        return runtime.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    assert "already been loaded" in check_error(spec, load("a", adapters["c"]), 400, "lora_name")
    assert "served base model" in check_error(spec, load(MODEL, adapters["c"]), 400, "lora_name")
    assert "no LoRA adapter at" in check_error(spec, load("x", tmp_path / "nowhere"), 400, "lora_path")
    assert "no LoRA adapter at" in check_error(spec, load("x", adapters["broken"]), 400, "lora_path")
    assert "above --max-lora-rank 8" in check_error(spec, load("x", adapters["big"]), 400, "lora_path")
    assert "do not fit" in check_error(spec, load("x", adapters["alien"]), 400, "lora_path")
    check_error(spec, runtime.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    check_error(spec, runtime.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "p"}), 400,
                "lora_name")
    assert "x" not in [m["id"] for m in runtime.get("/v1/models").json()["data"]]


def test_load_then_unload_without_generating(runtime: httpx.Client, spec: OpenAISpec,
                                             adapters: dict[str, Path]) -> None:
    loaded = runtime.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    card = runtime.get("/v1/models/c").json()
    assert (card["parent"], card["root"]) == (MODEL, str(adapters["c"]))
    tokens = runtime.post("/tokenize", json={"model": "c", "prompt": "Hi"})
    assert tokens.status_code == 200
    check_error(spec, runtime.post("/v1/unload_lora_adapter", json={"lora_name": "c", "lora_int_id": 999}), 404,
                "lora_name", "model_not_found")
    unloaded = runtime.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    assert [m["id"] for m in runtime.get("/v1/models").json()["data"]] == [MODEL, "a"]
    check_error(spec, runtime.post("/tokenize", json={"model": "c", "prompt": "Hi"}), 404, "model", "model_not_found")
    check_error(spec, complete(runtime, "c"), 404, "model", "model_not_found")
    check_error(spec, runtime.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404, "lora_name",
                "model_not_found")
    # Loaded again under the same name (with a new id inside).
    assert runtime.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}
                        ).status_code == 200
    assert runtime.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200


def test_a_bad_adapter_stops_the_server_at_startup_with_the_reason(
        serve_tiny: Callable[..., ContextManager[ServerProcess]], adapters: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError) as failed, serve_tiny(*LORA_FLAGS, "--lora-modules", f"big={adapters['big']}"):
        pass
    message = str(failed.value)
    assert "server exited with 1 while starting" in message
    assert "cadence: --lora-modules: LoRA adapter 'big': " in message and "above --max-lora-rank 8" in message
    assert "Traceback" not in message


# ---- generation with an adapter (needs the engine side of LoRA) --------------------------------


def test_a_completion_on_an_adapter_equals_peft(static: httpx.Client, tiny_model: Path,
                                                adapters: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    [with_a] = peft_greedy(tiny_model, adapters["a"], [PROMPT], 8)
    [base] = peft_greedy(tiny_model, None, [PROMPT], 8)
    assert with_a != base  # else the test could not tell whether the adapter ran
    for model, expected in (("a", with_a), (MODEL, base)):
        body = complete(static, model).json()
        assert body["model"] == model
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=False)


def test_every_endpoint_reports_the_adapter_s_name(static: httpx.Client, spec: OpenAISpec) -> None:
    chat = static.post("/v1/chat/completions", json={"model": "b", "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4, "ignore_eos": True}).json()
    spec.validate(chat, "CreateChatCompletionResponse")
    assert chat["model"] == "b"
    response = static.post("/v1/responses", json={"model": "a", "input": "Hi", "max_output_tokens": 4}).json()
    assert response["model"] == "a"
    with static.stream("POST", "/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 4,
                                                         "ignore_eos": True, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and {chunk["model"] for chunk in chunks} == {"a"}


def test_load_use_and_unload(runtime: httpx.Client, spec: OpenAISpec, adapters: dict[str, Path]) -> None:
    assert runtime.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(adapters["d"])}
                        ).status_code == 200
    first = complete(runtime, "d")
    assert first.status_code == 200 and first.json()["model"] == "d"
    assert first.json()["choices"][0]["text"] != complete(runtime, MODEL).json()["choices"][0]["text"]
    assert runtime.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
    check_error(spec, complete(runtime, "d"), 404, "model", "model_not_found")
    # The same name with other weights: a new id, so nothing of d's (worker slot, cached blocks) serves it.
    assert runtime.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(adapters["a"])}
                        ).status_code == 200
    assert complete(runtime, "d").json()["choices"][0]["text"] == complete(runtime, "a").json()["choices"][0]["text"]
    assert runtime.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200


def test_unloading_under_load_loses_no_request(runtime_server: ServerProcess, spec: OpenAISpec,
                                               adapters: dict[str, Path]) -> None:
    """Streams on adapter x run on to their length after x is unloaded; a new request naming x gets 404."""
    num_streams, max_tokens = 4, 400

    async def run() -> tuple[list[dict[str, Any]], httpx.Response, httpx.Response, int, str]:
        async with httpx.AsyncClient(base_url=runtime_server.url, timeout=120) as client:
            loaded = await client.post("/v1/load_lora_adapter",
                                       json={"lora_name": "x", "lora_path": str(adapters["c"])})
            assert loaded.status_code == 200
            started = asyncio.Event()
            num_started = 0
            finished = 0

            async def stream() -> dict[str, Any]:
                nonlocal num_started, finished
                body = {"model": "x", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                reasons: list[str | None] = []
                usage = None
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            if not reasons:
                                num_started += 1
                                if num_started == num_streams:
                                    started.set()
                            reasons.append(chunk["choices"][0]["finish_reason"])
                        usage = chunk.get("usage") or usage
                finished += 1
                return {"finish_reason": reasons[-1], "usage": usage}

            tasks = [asyncio.create_task(stream()) for _ in range(num_streams)]
            await asyncio.wait_for(started.wait(), 60)
            metrics = (await client.get("/metrics")).text
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
            finished_at_unload = finished
            refused = await client.post("/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 2})
            return list(await asyncio.gather(*tasks)), unloaded, refused, finished_at_unload, metrics

    results, unloaded, refused, finished_at_unload, metrics = asyncio.run(run())
    # vLLM's lora_requests_info, while the four streams ran
    assert ('cadence:lora_requests_info{engine="0",max_lora="2",model_name="tiny",running_lora_adapters="x",'
            'waiting_lora_adapters=""} 1.0') in metrics
    assert unloaded.status_code == 200
    assert finished_at_unload == 0, "the streams ended before the unload: make them longer"
    check_error(spec, refused, 404, "model", "model_not_found")
    assert [r["finish_reason"] for r in results] == ["length"] * num_streams
    assert all(r["usage"]["completion_tokens"] == max_tokens for r in results)


# ---- the parts, without a server ---------------------------------------------------------------


def test_lora_modules_take_vllm_s_two_forms() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    assert parse_lora_module("eq=/a=b") == LoRAModule("eq", "/a=b")  # the first '=' splits
    assert parse_lora_module('{"name": "s", "path": "/p", "base_model_name": "m"}') == LoRAModule("s", "/p", "m")
    for bad in ("sql", "=/p", "sql=", '{"name": "s"}', '{"name": "s", "path": "/p", "rank": 8}', "{not json"):
        with pytest.raises(ValueError, match="name"):
            parse_lora_module(bad)
    ns = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert ns.lora_modules == [LoRAModule("a", "/x"), LoRAModule("b", "/y")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "nameless"])


def test_lora_flags_need_enable_lora_and_the_env_var_allows_updating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNTIME_UPDATING_ENV, raising=False)

    def allowed(*flags: str) -> bool:
        return server.runtime_lora_updating(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(ValueError, match=r"^--lora-modules needs --enable-lora"):
        allowed("--lora-modules", "a=/x")
    with pytest.raises(ValueError, match=r"^--allow-runtime-lora-updating needs --enable-lora"):
        allowed("--allow-runtime-lora-updating")
    assert not allowed() and not allowed("--enable-lora")
    assert allowed("--enable-lora", "--allow-runtime-lora-updating")
    for value, expected in (("1", True), ("true", True), ("True", True), ("0", False), ("no", False)):
        monkeypatch.setenv(RUNTIME_UPDATING_ENV, value)
        assert allowed() is expected  # vLLM's variable needs no --enable-lora: loads then say LoRA is off


def test_settings_refuse_clashing_adapter_names() -> None:
    def settings(*modules: LoRAModule) -> ServerSettings:
        return ServerSettings(served_model_names=("m", "alias"), lora_modules=modules)

    assert settings(LoRAModule("a", "/x"), LoRAModule("b", "/x", "alias")).lora_modules[1].base_model_name == "alias"
    with pytest.raises(ValueError, match="'alias' is a served model name"):
        settings(LoRAModule("alias", "/x"))
    with pytest.raises(ValueError, match="'a' is given more than once"):
        settings(LoRAModule("a", "/x"), LoRAModule("a", "/y"))
    with pytest.raises(ValueError, match="base_model_name 'other', which is not a served model name"):
        settings(LoRAModule("a", "/x", "other"))


def test_the_registry_numbers_adapters_and_never_reuses_an_id(tiny_model: Path, adapters: dict[str, Path]) -> None:
    limits = ModelLimits(max_model_len=512, vocab_size=320, kv_capacity_tokens=512, eos_token_id=0,
                         lora=AdapterLimits.of(AutoConfig.from_pretrained(tiny_model), max_rank=8))
    registry = LoRAAdapters(limits, ["m", "alias"])
    a = registry.add("a", str(adapters["a"]))
    b = registry.add("b", str(adapters["b"]), "alias")
    assert (a.lora_int_id, b.lora_int_id) == (1, 2)
    assert [(s.lora_request.lora_name, s.parent) for s in registry] == [("a", "m"), ("b", "alias")]
    with pytest.raises(InvalidRequestError, match="above --max-lora-rank 8") as refused:
        registry.add("big", str(adapters["big"]))
    assert refused.value.param == "lora_path"
    assert registry.remove("a", lora_int_id=2) is None and registry.get("a") is not None  # another id: kept
    assert registry.remove("a") == a and registry.get("a") is None and registry.remove("a") is None
    again = registry.add("a", str(adapters["c"]))
    assert again.lora_int_id == 3 and again.lora_path == str(adapters["c"])
    off = LoRAAdapters(ModelLimits(max_model_len=512, vocab_size=320, kv_capacity_tokens=512, eos_token_id=0), ["m"])
    with pytest.raises(InvalidRequestError, match="start it with --enable-lora"):
        off.add("a", str(adapters["a"]))
