// A model's decoder layers as one call per step (cadence/models/decoder_stack.py): Llama's layer
// (pre-norms, the residual add fused into the next norm, SiLU) and Gemma's (four norms scaled by
// 1 + weight, GeLU-tanh).
//
// The Python layer loop spends about 100 us a layer dispatching a dozen small ops (module calls,
// views, empty tensors, torch.ops calls), 3-4 ms of a 10-15 ms decode step of one request on
// SmolLM2 here. This runs the same kernels, in the same order, with the same arguments, from C++:
// the outputs are the Python loop's, bit for bit, and each op costs a dispatcher call (well under
// a microsecond). Kernels are reached through the dispatcher, so their sources stay as they are.
//
// Linear: one linear layer's weight as pack_weights left it (a plain weight for F.linear, one in
// oneDNN's layout, the bf16 GEMM's panels, or quantized matrices stacked along the output rows).
// DecoderStack: the layers' weights and shapes, and forward() over a step's hidden states.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Over a weight packed into a bf16 GEMM's panels (cadence/backends/dense_gemm.py): 4-D for this
// library's AVX512-BF16 GEMM, 3-D for the AVX2 one (its library loaded with the panels).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t out_features) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
  if (packed.dim() == 4) {
    static const auto op = kernel<Signature>("cadence_cpu::bf16_linear");
    return op.call(x, packed, bias, out_features);
  }
  static const auto op = kernel<Signature>("cadence_avx2::bf16_linear");
  return op.call(x, packed, bias, out_features);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t rows,
                        int64_t bits, int64_t block, bool symmetric) {
  static const auto op = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, int64_t,
                                           int64_t, bool)>(
      // the AVX2 kernel's library where the VNNI one does not run (cpu_kernels.py loads it first)
      __builtin_cpu_supports("avx512vnni") ? "cadence_cpu::quant_linear" : "cadence_avx2::quant_linear");
  return op.call(x, packed, bias, rows, bits, block, symmetric);
}

// x @ W.T + bias over a float weight of `out_features` rows as cadence/backends/dense_gemm.py: linear
// reads it: plain (F.linear), in oneDNN's layout, or in a bf16 GEMM's panels.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, int64_t out_features) {
  if (!weight.is_mkldnn() && weight.dim() > 2) return bf16_linear(x, weight, bias, out_features);
  if (!weight.is_mkldnn()) return at::linear(x, weight, bias);
  static const auto op =
      kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                        c10::List<c10::optional<c10::Scalar>>, c10::optional<c10::string_view>)>(
          "mkldnn::_linear_pointwise");
  return op.call(x, weight, bias, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "cadence_cpu::rms_norm");
  op.call(out, x, weight, eps);
}

void scaled_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale, double eps) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "cadence_cpu::scaled_rms_norm");
  op.call(out, x, scale, eps);
}

void add_rms_norm(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                  double eps) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     double)>("cadence_cpu::add_rms_norm");
  op.call(out, residual, x, weight, eps);
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&)>("cadence_cpu::silu_and_mul");
  op.call(out, gate_up);
}

at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t out_features) {
  static const auto op = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
      "cadence_cpu::bf16_linear_silu");
  return op.call(x, packed, bias, out_features);
}

void rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t head_dim) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     int64_t, int64_t)>("cadence_cpu::rotary_embedding");
  op.call(x, positions, cos, sin, num_heads, head_dim);
}

void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&)>("cadence_cpu::store_kv");
  op.call(k_cache, v_cache, k, v, slot_mapping);
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& row_requests, const at::Tensor& seq_lens,
                     double scale, int64_t window, double soft_cap) {
  static const auto op =
      kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, const at::Tensor&, double, int64_t, double)>("cadence_cpu::paged_attention");
  op.call(out, q, k_cache, v_cache, block_table, row_requests, seq_lens, scale, window, soft_cap);
}

// The kinds of weight, as cadence/distributed/layers.py: linear() tells them apart.
constexpr int64_t kDense = 0;   // weights = {W [N, K]}, plain or oneDNN's: dense_linear
constexpr int64_t kPanels = 1;  // weights = {packed}, a bf16 GEMM's panels: dense_linear too
// weights = one packed matrix per part, then (a row limit) each part's dense weight; parts: kPartInts
// per part, then the most rows the kernel takes (-1: every batch; more go to the dense weights, as
// cadence/quantization/packed.py: quantized_linear sends them)
constexpr int64_t kQuant = 2;
constexpr int64_t kPartInts = 6;  // rows, cols, padded cols, bits, block, symmetric

struct Linear : torch::CustomClassHolder {
  int64_t kind;
  std::vector<at::Tensor> weights;
  OptTensor bias;
  std::vector<int64_t> parts;
  int64_t out_features;

  Linear(int64_t kind, std::vector<at::Tensor> weights, OptTensor bias, std::vector<int64_t> parts,
         int64_t out_features)
      : kind(kind), weights(std::move(weights)), bias(std::move(bias)), parts(std::move(parts)),
        out_features(out_features) {
    TORCH_CHECK(kind == kDense || kind == kPanels || kind == kQuant, "Linear: unknown kind ", kind);
    if (kind != kQuant) {
      TORCH_CHECK(this->weights.size() == 1, "Linear: one weight");
      return;
    }
    const size_t n = this->parts.size() / kPartInts;
    TORCH_CHECK(n >= 1 && this->parts.size() == kPartInts * n + 1, "Linear: ", kPartInts,
                " numbers per quantized part, then a row limit");
    TORCH_CHECK(this->weights.size() == (kernel_rows() < 0 ? n : 2 * n),
                "Linear: a weight per quantized part, and a dense one each with a row limit");
  }

  int64_t kernel_rows() const { return parts.back(); }

  // x [T, K] -> [T, out_features], as cadence/distributed/layers.py: linear() computes it.
  at::Tensor forward(const at::Tensor& x) const {
    if (kind != kQuant) return dense_linear(x, weights[0], bias, out_features);
    const size_t n = parts.size() / kPartInts;
    const bool dense = kernel_rows() >= 0 && x.size(0) > kernel_rows();
    std::vector<at::Tensor> outs;
    int64_t first_row = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t* part = parts.data() + kPartInts * i;
      const int64_t rows = part[0], cols = part[1], padded = part[2];
      const OptTensor part_bias = bias ? OptTensor(bias->narrow(0, first_row, rows)) : OptTensor();
      if (dense) {
        outs.push_back(dense_linear(x, weights[n + i], part_bias, rows));
      } else {
        const at::Tensor input = padded != cols ? at::constant_pad_nd(x, {0, padded - cols}, 0) : x;
        outs.push_back(quant_linear(input, weights[i], part_bias, rows, part[3], part[4], part[5] != 0));
      }
      first_row += rows;
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  }

  // LoRA adapters' slots (cadence/lora/layer_slots.py: LoRASlots.packed): A of every slot
  // [slots * width, K] and B [out_features, slots * width], and each slot's A [width, K] and B
  // [out_features, width], each a plain weight, oneDNN's or the bf16 GEMM's panels; ``lora_parts`` picks the
  // step's mask of this layer's part count.
  OptTensor lora_a, lora_b;
  std::vector<at::Tensor> slot_a, slot_b;
  int64_t lora_parts = 0, width = 0;

  void set_lora(at::Tensor a, at::Tensor b, std::vector<at::Tensor> a_by_slot, std::vector<at::Tensor> b_by_slot,
                int64_t parts, int64_t slot_width) {
    TORCH_CHECK(parts >= 1 && parts <= 3, "Linear.set_lora: 1 to 3 parts");
    TORCH_CHECK(a_by_slot.size() == b_by_slot.size(), "Linear.set_lora: an A and a B per slot");
    lora_a = std::move(a);
    lora_b = std::move(b);
    slot_a = std::move(a_by_slot);
    slot_b = std::move(b_by_slot);
    lora_parts = parts;
    width = slot_width;
  }

  // forward(x), plus the LoRA delta as LoRASlots.__call__ computes it: every row through slot
  // ``slot`` (>= 0: a step all on one adapter), or through every slot masked to its own (``masks``:
  // one per part count, 1 to 3), or none (no mask, no slot).
  at::Tensor apply(const at::Tensor& x, const std::vector<at::Tensor>& masks, int64_t slot) const {
    at::Tensor out = forward(x);
    if (!lora_a) return out;
    if (slot >= 0) {
      TORCH_CHECK(slot < static_cast<int64_t>(slot_a.size()), "Linear.apply: no LoRA slot ", slot);
      return out.add_(gemm(gemm(x, slot_a[slot], width), slot_b[slot], out_features));
    }
    if (masks.empty()) return out;
    const int64_t columns = width * static_cast<int64_t>(slot_a.size());
    const at::Tensor shrunk = gemm(x, *lora_a, columns).mul_(masks[lora_parts - 1]);
    return out.add_(gemm(shrunk, *lora_b, out_features));
  }

  static at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, int64_t rows) {
    return dense_linear(x, weight, OptTensor(), rows);
  }
};

struct Layer {
  c10::intrusive_ptr<Linear> qkv, o, gate_up, down;
  // Llama: input and post-attention RMSNorm weights; Gemma: the fp32 scales (1 + weight) of its
  // input, post-attention, pre- and post-feed-forward norms.
  std::vector<at::Tensor> norms;
  std::vector<at::Tensor> qk_norms;  // q's and k's per-head norm (Qwen3, Gemma 3), or none
  double eps, scale, soft_cap;
  int64_t window;
  bool gemma;
};

// out = norm(x), as the layer's RMSNorm module computes it (Gemma's scales by 1 + weight).
at::Tensor norm(const Layer& layer, const at::Tensor& x, const at::Tensor& weight) {
  at::Tensor out = at::empty_like(x);
  if (layer.gemma) {
    scaled_rms_norm(out, x, weight, layer.eps);
  } else {
    rms_norm(out, x, weight, layer.eps);
  }
  return out;
}

// The per-head q/k norm, as cadence/models/layers.py: norm_heads_ (through a dense copy of the heads).
void norm_heads(const Layer& layer, const at::Tensor& heads, const at::Tensor& weight) {
  heads.copy_(norm(layer, heads.reshape({-1, heads.size(-1)}), weight).view(heads.sizes()));
}

struct DecoderStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim;
  std::vector<Layer> layers;

  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim) {}

  void add_layer(c10::intrusive_ptr<Linear> qkv, c10::intrusive_ptr<Linear> o, c10::intrusive_ptr<Linear> gate_up,
                 c10::intrusive_ptr<Linear> down, std::vector<at::Tensor> norms, std::vector<at::Tensor> qk_norms,
                 double eps, double scale, int64_t window, double soft_cap, bool gemma) {
    TORCH_CHECK(norms.size() == (gemma ? 4u : 2u), "DecoderStack: ", gemma ? 4 : 2, " norms a layer");
    TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2, "DecoderStack: q and k are normed together or not at all");
    layers.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(norms),
                           std::move(qk_norms), eps, scale, soft_cap, window, gemma});
  }

  // The layers over a step's embedded tokens h [T, hidden]: (the last layer's output, the residual
  // stream), as the model's layer loop leaves them (Llama: the last MLP output and the residual,
  // whose sum the final norm takes; Gemma: the hidden states, twice). Per layer: its RoPE tables,
  // its KV cache and its attention metadata (cadence/backends/sdpa_backend.py: SDPAMetadata's tensors).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, at::Tensor positions, std::vector<at::Tensor> cos,
                                             std::vector<at::Tensor> sin, std::vector<at::Tensor> k_caches,
                                             std::vector<at::Tensor> v_caches, std::vector<at::Tensor> slot_mappings,
                                             std::vector<at::Tensor> block_tables,
                                             std::vector<at::Tensor> token_requests,
                                             std::vector<at::Tensor> token_seq_lens,
                                             std::vector<at::Tensor> lora_masks, int64_t lora_slot) const {
    const size_t n = layers.size();
    for (const auto* list : {&cos, &sin, &k_caches, &v_caches, &slot_mappings, &block_tables, &token_requests,
                             &token_seq_lens}) {
      TORCH_CHECK(list->size() == n, "DecoderStack.forward: one table, cache and metadata per layer (", n, ")");
    }
    at::Tensor residual;
    for (size_t i = 0; i < n; ++i) {
      const Layer& layer = layers[i];
      if (layer.gemma) {
        const at::Tensor attended = attention(layer, norm(layer, h, layer.norms[0]), positions, cos[i], sin[i],
                                              k_caches[i], v_caches[i], slot_mappings[i], block_tables[i],
                                              token_requests[i], token_seq_lens[i], lora_masks, lora_slot);
        h = h + norm(layer, attended, layer.norms[1]);
        h = h + norm(layer, mlp(layer, norm(layer, h, layer.norms[2]), lora_masks, lora_slot), layer.norms[3]);
        residual = h;
        continue;
      }
      at::Tensor x;
      if (i == 0) {
        residual = h;
        x = norm(layer, h, layer.norms[0]);
      } else {
        x = at::empty_like(h);
        add_rms_norm(x, residual, h, layer.norms[0], layer.eps);
      }
      const at::Tensor o = attention(layer, x, positions, cos[i], sin[i], k_caches[i], v_caches[i], slot_mappings[i],
                                     block_tables[i], token_requests[i], token_seq_lens[i], lora_masks, lora_slot);
      const at::Tensor y = at::empty_like(o);
      add_rms_norm(y, residual, o, layer.norms[1], layer.eps);
      h = mlp(layer, y, lora_masks, lora_slot);
    }
    return {h, residual};
  }

  // Attention (cadence/models/llama.py: Attention.forward over the SDPA backend's kernels): x [T, hidden]
  // -> o_proj's output [T, hidden].
  at::Tensor attention(const Layer& layer, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const at::Tensor& block_table,
                       const at::Tensor& token_requests, const at::Tensor& token_seq_lens,
                       const std::vector<at::Tensor>& lora_masks, int64_t lora_slot) const {
    const int64_t tokens = x.size(0), q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const at::Tensor qkv = layer.qkv->apply(x, lora_masks, lora_slot);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads, head_dim});
    if (!layer.qk_norms.empty()) {
      norm_heads(layer, q, layer.qk_norms[0]);
      norm_heads(layer, k, layer.qk_norms[1]);
    }
    rotary_embedding(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    store_kv(k_cache, v_cache, k, v, slot_mapping);
    const at::Tensor attended = at::empty(q.sizes(), q.options());
    paged_attention(attended, q, k_cache, v_cache, block_table, token_requests, token_seq_lens, layer.scale,
                    layer.window, layer.soft_cap);
    return layer.o->apply(attended.reshape({tokens, -1}), lora_masks, lora_slot);
  }

  // The MLP (cadence/models/llama.py: MLP.forward): SiLU and the multiply as one kernel, or in the
  // GEMM's epilogue where the gate/up weight is in panels and no adapter is set (Llama), or GeLU-tanh
  // of the gate times the up half in torch ops (Gemma).
  static at::Tensor mlp(const Layer& layer, const at::Tensor& x, const std::vector<at::Tensor>& lora_masks,
                        int64_t lora_slot) {
    const Linear& gate_up_proj = *layer.gate_up;
    // ColumnParallelLinear.silu_and_mul: the AVX512-BF16 GEMM's 4-D panels only
    if (!layer.gemma && gate_up_proj.kind == kPanels && gate_up_proj.weights[0].dim() == 4 && !gate_up_proj.lora_a) {
      return layer.down->apply(
          bf16_linear_silu(x, gate_up_proj.weights[0], gate_up_proj.bias, gate_up_proj.out_features), lora_masks,
          lora_slot);
    }
    const at::Tensor gate_up = gate_up_proj.apply(x, lora_masks, lora_slot);
    const int64_t half = gate_up.size(1) / 2;
    if (layer.gemma) {
      return layer.down->apply(at::gelu(gate_up.narrow(1, 0, half), "tanh") * gate_up.narrow(1, half, half),
                               lora_masks, lora_slot);
    }
    const at::Tensor act = at::empty({x.size(0), half}, gate_up.options());
    silu_and_mul(act, gate_up);
    return layer.down->apply(act, lora_masks, lora_slot);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.class_<Linear>("Linear")
      .def(torch::init<int64_t, std::vector<at::Tensor>, OptTensor, std::vector<int64_t>, int64_t>())
      .def("forward", &Linear::forward)
      .def("set_lora", &Linear::set_lora);
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward);
}
