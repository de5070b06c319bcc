"""Random tensors of a GGML block type, as raw bytes: every bit pattern is a valid block once its
float16 scale fields hold finite values, so random bytes with small scales are a random tensor; and
a tiny random llama written as a GGUF file of those tensors, with a tokenizer, that transformers
converts (:func:`write_tiny_gguf`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Where each block keeps its float16 fields (scale, minimum or super-block scales), in bytes.
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# Float16 fields drawn in ±this make weights of about 0.05-0.1 (the K-quants multiply sub-block scales of
# up to 63, or 127 for Q6_K, into them).
WEIGHT_SCALES = {Q.Q8_0: 1e-3, Q.Q4_0: 0.02, Q.Q4_1: 0.01, Q.Q5_0: 0.01, Q.Q5_1: 0.005, Q.Q4_K: 3e-4,
                 Q.Q5_K: 1.5e-4, Q.Q6_K: 5e-5}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """``[rows, bytes per row]`` uint8 of a ``[rows, cols]`` tensor of ``kind``, its float16 fields in ``±scale``."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[kind]:
        values = rng.uniform(-scale, scale, size=(rows, cols // block)).astype(np.float16)
        raw[..., at:at + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, kinds: Sequence[GGMLQuantizationType], seed: int = 0) -> Path:
    """A 2-layer llama (hidden 256, 4 heads of 64 over 2 KV heads, MLP 512, untied head) whose linear
    weights take the types ``kinds`` (quantized, or F32) in turn (q, k, v, o, gate, up, down, layer by layer, then the
    head); the embedding is Q8_0, norms F32; tokenizer: the tiny BPE of ``support/tiny_models.py``."""
    from gguf import GGUFWriter, TokenType

    from support.tiny_models import TINY_VOCAB, build_tiny_tokenizer

    hidden, ffn, heads, kv_heads, head_dim, layers = 256, 512, 4, 2, 64, 2
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokenizer = build_tiny_tokenizer()
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = sorted(state["model"]["vocab"], key=state["model"]["vocab"].get)
    assert len(tokens) == TINY_VOCAB
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    writer.add_token_types([TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(seed)
    turn = iter(range(1 << 30))

    def linear(name: str, rows: int, cols: int) -> None:
        kind = kinds[next(turn) % len(kinds)]
        if kind == Q.F32:
            writer.add_tensor(name, rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32))
            return
        raw = random_blocks(kind, rows, cols, seed=int(rng.integers(1 << 30)), scale=WEIGHT_SCALES[kind])
        writer.add_tensor(name, raw, raw_dtype=kind)

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.5, 1.5, size=hidden).astype(np.float32))

    embedding = random_blocks(Q.Q8_0, TINY_VOCAB, hidden, seed=seed, scale=WEIGHT_SCALES[Q.Q8_0])
    writer.add_tensor("token_embd.weight", embedding, raw_dtype=Q.Q8_0)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for part, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            linear(f"blk.{i}.{part}.weight", rows, cols)
    norm("output_norm.weight")
    linear("output.weight", TINY_VOCAB, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
