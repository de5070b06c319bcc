// A Llama-family model's decoder layers as one call per step (cadence/models/decoder_stack.py).
//
// The Python layer loop spends about 100 us a layer dispatching a dozen small ops (module calls,
// views, empty tensors, torch.ops calls), 3-4 ms of a 10-15 ms decode step of one request on
// SmolLM2 here. This runs the same kernels, in the same order, with the same arguments, from C++:
// the outputs are the Python loop's, bit for bit, and each op costs a dispatcher call (well under
// a microsecond). Kernels are reached through the dispatcher, so their sources stay as they are.
//
// Linear: one linear layer's weight as pack_weights left it (a plain weight for F.linear, the
// bf16 GEMM's panels, or quantized matrices stacked along the output rows). DecoderStack: the
// layers' weights and shapes, and forward() over a step's hidden states.

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

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t out_features) {
  static const auto op = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
      "cadence_cpu::bf16_linear");
  return op.call(x, packed, bias, out_features);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias, int64_t rows,
                        int64_t bits, int64_t block, bool symmetric) {
  static const auto op = kernel<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t, int64_t,
                                           int64_t, bool)>("cadence_cpu::quant_linear");
  return op.call(x, packed, bias, rows, bits, block, symmetric);
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op = kernel<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "cadence_cpu::rms_norm");
  op.call(out, x, weight, eps);
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
constexpr int64_t kDense = 0;   // weights = {W [N, K]}: F.linear
constexpr int64_t kPanels = 1;  // weights = {packed}: bf16_linear
constexpr int64_t kQuant = 2;   // weights = one packed matrix per part; parts: kPartInts per part
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
    TORCH_CHECK(!this->weights.empty() && (kind == kQuant || this->weights.size() == 1),
                "Linear: one weight, or one per quantized part");
    TORCH_CHECK(kind != kQuant || this->parts.size() == kPartInts * this->weights.size(),
                "Linear: ", kPartInts, " numbers per quantized part");
  }

  // x [T, K] -> [T, out_features], as cadence/distributed/layers.py: linear() computes it.
  at::Tensor forward(const at::Tensor& x) const {
    if (kind == kDense) return at::linear(x, weights[0], bias);
    if (kind == kPanels) return bf16_linear(x, weights[0], bias, out_features);
    std::vector<at::Tensor> outs;
    int64_t first_row = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t* part = parts.data() + kPartInts * i;
      const int64_t rows = part[0], cols = part[1], padded = part[2];
      const at::Tensor input = padded != cols ? at::constant_pad_nd(x, {0, padded - cols}, 0) : x;
      const OptTensor part_bias = bias ? OptTensor(bias->narrow(0, first_row, rows)) : OptTensor();
      outs.push_back(quant_linear(input, weights[i], part_bias, rows, part[3], part[4], part[5] != 0));
      first_row += rows;
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  }
};

struct Layer {
  c10::intrusive_ptr<Linear> qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;
  OptTensor q_norm, k_norm;  // Qwen3: RMSNorm over each q and k head before RoPE
  double eps, scale, soft_cap;
  int64_t window;
};

// Qwen3's per-head norm, as cadence/models/layers.py: norm_heads_ (through a dense copy of the heads).
void norm_heads(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const at::Tensor rows = heads.reshape({-1, heads.size(-1)});
  const at::Tensor out = at::empty_like(rows);
  rms_norm(out, rows, weight, eps);
  heads.copy_(out.view(heads.sizes()));
}

struct DecoderStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim;
  std::vector<Layer> layers;

  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim) {}

  void add_layer(c10::intrusive_ptr<Linear> qkv, c10::intrusive_ptr<Linear> o, c10::intrusive_ptr<Linear> gate_up,
                 c10::intrusive_ptr<Linear> down, at::Tensor input_norm, at::Tensor post_norm, OptTensor q_norm,
                 OptTensor k_norm, double eps, double scale, int64_t window, double soft_cap) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderStack: q and k are normed together or not at all");
    layers.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(input_norm),
                           std::move(post_norm), std::move(q_norm), std::move(k_norm), eps, scale, soft_cap, window});
  }

  // The layers over a step's embedded tokens h [T, hidden]: (the last layer's MLP output, the
  // residual stream), as LlamaForCausalLM's layer loop leaves them. Per layer: its KV cache and its
  // attention metadata (cadence/backends/sdpa_backend.py: SDPAMetadata's tensors).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                             std::vector<at::Tensor> slot_mappings, std::vector<at::Tensor> block_tables,
                                             std::vector<at::Tensor> token_requests,
                                             std::vector<at::Tensor> token_seq_lens) const {
    const size_t n = layers.size();
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n && slot_mappings.size() == n && block_tables.size() == n &&
                    token_requests.size() == n && token_seq_lens.size() == n,
                "DecoderStack.forward: one cache and one metadata per layer (", n, ")");
    const int64_t tokens = h.size(0), q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    at::Tensor residual;
    for (size_t i = 0; i < n; ++i) {
      const Layer& layer = layers[i];
      at::Tensor x = at::empty_like(h);
      if (i == 0) {
        residual = h;
        rms_norm(x, h, layer.input_norm, layer.eps);
      } else {
        add_rms_norm(x, residual, h, layer.input_norm, layer.eps);
      }
      const at::Tensor qkv = layer.qkv->forward(x);
      const at::Tensor q = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
      const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads, head_dim});
      if (layer.q_norm) {
        norm_heads(q, *layer.q_norm, layer.eps);
        norm_heads(k, *layer.k_norm, layer.eps);
      }
      rotary_embedding(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
      store_kv(k_caches[i], v_caches[i], k, v, slot_mappings[i]);
      const at::Tensor attended = at::empty(q.sizes(), q.options());
      paged_attention(attended, q, k_caches[i], v_caches[i], block_tables[i], token_requests[i], token_seq_lens[i],
                      layer.scale, layer.window, layer.soft_cap);
      const at::Tensor o = layer.o->forward(attended.reshape({tokens, -1}));
      at::Tensor y = at::empty_like(o);
      add_rms_norm(y, residual, o, layer.post_norm, layer.eps);
      const at::Tensor gate_up = layer.gate_up->forward(y);
      const at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
      silu_and_mul(act, gate_up);
      h = layer.down->forward(act);
    }
    return {h, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.class_<Linear>("Linear")
      .def(torch::init<int64_t, std::vector<at::Tensor>, OptTensor, std::vector<int64_t>, int64_t>())
      .def("forward", &Linear::forward);
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward);
}
