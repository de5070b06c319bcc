// What the two quantized-linear kernels (quant_linear.cpp with AVX512-VNNI, quant_linear_avx2.cpp
// with AVX2) share: the packed weight layout of cadence/quantization/packed.py as they read it, the
// activations quantized into two int8 parts, the forms they have code for, and the op's argument
// checks. quant_linear.cpp describes the layout and the arithmetic; both kernels do the same float
// operations in the same order, so their outputs are equal bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include "dispatch.h"

#include <cstdint>
#include <memory>

namespace cadence::quant {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroupPanels = 4;
constexpr int64_t kRowBlock = 256;  // rows of x whose activations stay in L2 while a thread's panels pass

// The activations quantized: per row and block, x ~ scale * (hi + lo / 254) with int8 codes hi and
// lo (read 4 at a time as int32), and scale * (sum of hi + sum of lo / 254) for the minimums.
// Left uninitialised: a kernel's quantize_rows writes every element.
struct QuantizedRows {
  QuantizedRows(int64_t values, int64_t blocks)
      : hi(new int8_t[values]), lo(new int8_t[values]), scale(new float[blocks]), sum(new float[blocks]) {}
  std::unique_ptr<int8_t[]> hi, lo;
  std::unique_ptr<float[]> scale, sum;
};

constexpr float kLoSteps = 254.0f;  // |x - scale * hi| <= scale / 2 = 127 lo steps

// A packed format: Bits-bit codes in blocks of Block columns; Symmetric: no minimums stored, each is
// -2^(Bits-1) times its scale. Per (panel, block): 16 float16 scales, 16 minimums unless symmetric,
// the codes (cadence/quantization/packed.py).
template <int Bits, int Block, bool Symmetric>
struct Format {
  static constexpr int kBits = Bits, kBlock = Block, kSteps = Block / 4;
  static constexpr bool kSymmetric = Symmetric;
  static constexpr int64_t kHeader = (Symmetric ? 1 : 2) * 2 * kLanes;
  static constexpr int64_t kBytes = kHeader + kLanes * Block * Bits / 8;
  static constexpr int64_t kGroupBytes = kGroupPanels * kBytes;  // one block of a whole group
};

// The (bits, block) forms packed.py makes (blocks.FORMS), each with and without minimums: the one
// list both the argument check and the dispatch read.
#define CADENCE_QUANT_FORMS(X) X(4, 32) X(5, 32) X(8, 32) X(6, 16) X(8, 16)

inline bool has_format(int64_t bits, int64_t block) {
#define CADENCE_IS_FORM(B, K) if (bits == B && block == K) return true;
  CADENCE_QUANT_FORMS(CADENCE_IS_FORM)
#undef CADENCE_IS_FORM
  return false;
}

// Kernel::run<Format<bits, block, symmetric>, T>(args...) for a form has_format accepts.
template <typename Kernel, typename T, typename... Args>
void run_format(int64_t bits, int64_t block, bool symmetric, Args&&... args) {
#define CADENCE_RUN_FORM(B, K)                                                                           \
  if (bits == B && block == K) {                                                                         \
    symmetric ? Kernel::template run<Format<B, K, true>, T>(args...)                                     \
              : Kernel::template run<Format<B, K, false>, T>(args...);                                   \
    return;                                                                                              \
  }
  CADENCE_QUANT_FORMS(CADENCE_RUN_FORM)
#undef CADENCE_RUN_FORM
}

// The op: x [M, K] float32 or bfloat16, packed uint8 [ceil(N/64), K/block, 4, bytes] (bytes: 32 or
// 64 + 16 * block * bits / 8), bias [N] of x's dtype or None -> [M, N] of x's dtype. Kernel has static
// quantize_rows<T>(x, rows, stride, cols, block, q) and run<Format, T>(q, rows, cols, w, groups,
// blocks, out, out_features, bias).
template <typename Kernel>
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t bits, int64_t block, bool symmetric) {
  TORCH_CHECK(has_format(bits, block), "quant_linear: no kernel for ", bits, "-bit codes in blocks of ", block);
  const int64_t block_bytes = (symmetric ? 1 : 2) * 2 * kLanes + kLanes * block * bits / 8;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kGroupPanels && packed.size(3) == block_bytes &&
                  packed.size(0) == (out_features + kGroupPanels * kLanes - 1) / (kGroupPanels * kLanes),
              "quant_linear: the weight must be packed by cadence.quantization.packed.pack (", out_features, " rows)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == packed.size(1) * block &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "quant_linear: x must be [M, ", packed.size(1) * block, "] float32 or bfloat16");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == x_in.scalar_type()),
              "quant_linear: bias must be dense [", out_features, "] of x's dtype");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1), groups = packed.size(0), blocks = packed.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  QuantizedRows q(rows * cols, rows * (cols / block));
  CADENCE_DISPATCH_FLOAT(x.scalar_type(), "quant_linear", [&] {
    Kernel::quantize_rows(x.data_ptr<scalar_t>(), rows, x.stride(0), cols, block, q);
    const scalar_t* b = bias ? bias->data_ptr<scalar_t>() : nullptr;
    run_format<Kernel, scalar_t>(bits, block, symmetric, q, rows, cols, packed.data_ptr<uint8_t>(), groups, blocks,
                                 out.data_ptr<scalar_t>(), out_features, b);
  });
  return out;
}

}  // namespace cadence::quant

// Registers torch.ops.NS.quant_linear as linear<KERNEL>, and NS.quant_linear_supported() -> bool as
// SUPPORTED (no tensors: callable on any dispatch key).
#define CADENCE_QUANT_LINEAR_OPS(NS, KERNEL, SUPPORTED)                                                      \
  TORCH_LIBRARY_FRAGMENT(NS, m) {                                                                             \
    m.def("quant_linear_supported() -> bool", SUPPORTED);                                                     \
    m.def("quant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int bits, int block, "       \
          "bool symmetric) -> Tensor");                                                                       \
  }                                                                                                           \
  TORCH_LIBRARY_IMPL(NS, CPU, m) { m.impl("quant_linear", cadence::quant::linear<KERNEL>); }
