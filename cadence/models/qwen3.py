"""Qwen3 (dense): the Llama layer stack plus an RMSNorm over each query and key head before RoPE.

transformers' ``Qwen3Attention`` computes ``q_norm(q_proj(x).view(..., -1, head_dim))`` (and the
same for k with ``k_norm``), then applies RoPE; v is not normalised. Both norms are
``Qwen3RMSNorm(head_dim, eps=rms_norm_eps)``, op for op ``LlamaRMSNorm``. Here they run between the
split of the fused q/k/v projection and the rotation (:meth:`RotaryEmbedding.rotate
<cadence.models.layers.RotaryEmbedding.rotate>` with ``qk_norm``), written back into the
projections so that the fused RoPE kernel rotates the normalised heads in place.

The rest is Llama's: ``head_dim`` from the config (Qwen3's default 128 need not equal
``hidden_size / num_attention_heads``), biases on q/k/v and o from ``attention_bias``, no MLP bias,
optional tied embeddings, any RoPE type :func:`~cadence.models.layers.rope_inv_freq` accepts
(Qwen3 ships YaRN for long contexts). A GGUF Qwen3 loads through transformers' reader, which maps
``blk.N.attn_q_norm`` / ``attn_k_norm`` to ``q_norm`` / ``k_norm`` (:mod:`cadence.models.loader`).
Under tensor parallelism each rank holds both norms whole: they act within a head, never across the
sharded heads.
"""

from __future__ import annotations

from cadence.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Checkpoint names are Hugging Face's: ``model.layers.N.self_attn.q_norm.weight`` and
    ``k_norm.weight`` load as they are, the projections as Llama's."""

    qk_norm = True
