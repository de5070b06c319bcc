// bf16 GEMM for linear layers on x86 CPUs with AVX2 and FMA but without AVX512-BF16: y = x @ W.T
// (+ bias), the bf16 weights widened to fp32 in registers and fp32 FMAs, x float32 or bfloat16.
//
// Without it bf16 F.linear on such a CPU ran 4-9x slower than float32 from 8 rows up (SmolLM2's
// layers, 2-core AMD Zen 3), so a bf16 model served at a sixth of float32's speed. Here the weights
// stay bf16 in memory (half of float32's bytes, which bound a decode step) and the arithmetic is
// float32's.
//
// The weight is packed once into panels of 16 output columns: for each input feature k, the 16
// columns' weights in 32 bytes, ordered so that interleaving them with zeros (VPUNPCKLWD and
// VPUNPCKHWD, per 128-bit lane) gives columns 0-7 and 8-15 as two float32 vectors. A thread owns
// whole panels. Rows go in blocks whose float32 copy stays in L2 while the thread's panels pass over
// them; a tile is up to 4 rows against one panel, or 1-2 rows against 4 / 2 panels (so that a small
// decode still has 8 independent sums in flight). Each output is one chain of FMAs over k in order,
// whatever the tile, so a row's result does not depend on the rows beside it. Built on first use by
// cadence/backends/cpu_kernels.py into the AVX2 library (torch.ops.cadence_avx2).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "avx2.h"
#include "dispatch.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

using namespace cadence::avx2;

constexpr int64_t kPanelCols = 16;
// A column's place in its panel's 32 bytes of one input feature: the words VPUNPCKLWD takes (slots 0-3
// and 8-11) are columns 0-7, those VPUNPCKHWD takes (4-7 and 12-15) columns 8-15.
constexpr int kSlotColumn[kPanelCols] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
constexpr int kTileRows = 4;  // 6 measured slower (its 12 sums beside the weights spill)
// Float32 rows of x per block: kept in L2 (512 KB-1 MB a core) beside the panel being read.
constexpr int64_t kRowBlockBytes = 256 * 1024;

constexpr int64_t kLine = 64;

// Lines of the next panel a tile fetches into L2 while it computes (none: lines 0).
struct Fetch {
  const char* at = nullptr;
  int64_t lines = 0;
};

bool bf16_linear_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// weight [N, K] bf16 -> [ceil(N / 16), K, 16] bf16, zeros past the last column.
at::Tensor pack_bf16_linear(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16,
              "pack_bf16_linear: the weight must be [out_features, in_features] bf16");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanelCols - 1) / kPanelCols;
  at::Tensor packed = at::zeros({panels, k, kPanelCols}, weight.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* p = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int slot = 0; slot < kPanelCols; ++slot) {
        const int64_t column = j * kPanelCols + kSlotColumn[slot];
        if (column >= n) continue;
        for (int64_t i = 0; i < k; ++i) p[(j * k + i) * kPanelCols + slot] = w[column * k + i];
      }
    }
  });
  return packed;
}

// The sums of rows [0, R) of x (float32, `stride` apart) against C panels from `panel`
// (`panel_words` apart) over k: sums[r][c][h] holds columns c * 16 + 8h .. +7. Apart from the stores
// (GCC kept the sums in registers only where this loop is not in a template over the output type:
// instantiated for bf16 outputs, it spilled all eight each k, 3x slower).
template <int R, int C>
__attribute__((noinline)) void accumulate(const float* x, int64_t stride, const uint16_t* panel, int64_t panel_words,
                                          int64_t k_count, float (&sums)[R][C][2][8]) {
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  }
  const __m256i zero = _mm256_setzero_si256();
  int64_t k = 0;
  do {  // k_count >= 1 (the op checks): a loop that may not run kept GCC from holding acc in registers
    __m256 w[C][2];
    for (int c = 0; c < C; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + c * panel_words + k * kPanelCols));
      w[c][0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
      w[c][1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * stride + k);
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm256_fmadd_ps(xv, w[c][0], acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(xv, w[c][1], acc[r][c][1]);
      }
    }
  } while (++k < k_count);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(sums[r][c][0], acc[r][c][0]);
      _mm256_store_ps(sums[r][c][1], acc[r][c][1]);
    }
  }
}

// out[r, c * 16 + col] = sum over k of x[r, k] * W[col, k], plus bias, for rows [0, R) and C panels
// (accumulate's arguments); `cols` columns are kept.
template <int R, int C, typename T>
void tile(const float* x, int64_t stride, const uint16_t* panel, int64_t panel_words, int64_t k_count, Fetch fetch,
          T* out, int64_t out_stride, int64_t cols, const T* bias) {
  alignas(32) float sums[R][C][2][8];
  // Issued at once: prefetches in the k loop made GCC split it and spill the sums again.
  for (int64_t line = 0; line < fetch.lines; ++line) _mm_prefetch(fetch.at + kLine * line, _MM_HINT_T1);
  accumulate<R, C>(x, stride, panel, panel_words, k_count, sums);
  for (int c = 0; c < C; ++c) {
    for (int h = 0; h < 2; ++h) {
      const int64_t column = kPanelCols * c + 8 * h, n = std::min<int64_t>(8, cols - column);
      if (n <= 0) return;
      const __m256 b = bias ? load_upto8(bias + column, n) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        store_upto8(out + r * out_stride + column, _mm256_add_ps(_mm256_load_ps(sums[r][c][h]), b), n);
      }
    }
  }
}

template <typename T>
using Tile = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, Fetch, T*, int64_t, int64_t, const T*);

// Rows of a block: whole tiles of kTileRows against one panel, the rest in one smaller tile.
template <typename T>
constexpr Tile<T> kOnePanel[kTileRows + 1] = {nullptr, tile<1, 1, T>, tile<2, 1, T>, tile<3, 1, T>, tile<4, 1, T>};

template <typename T>
void run(const float* x, int64_t rows, int64_t k_count, const uint16_t* w, int64_t panels, T* out,
         int64_t out_features, const T* bias) {
  const int64_t panel_words = k_count * kPanelCols;
  const int64_t row_block = std::max<int64_t>(kTileRows, kRowBlockBytes / (4 * k_count) / kTileRows * kTileRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += row_block) {
      const int64_t block_rows = std::min(row_block, rows - first);
      const float* xb = x + first * k_count;
      T* ob = out + first * out_features;
      // 1 or 2 rows: 4 or 2 panels a tile, for 8 sums in flight.
      const int64_t group = block_rows == 1 ? 4 : block_rows == 2 ? 2 : 1;
      int64_t j = begin;
      for (; group > 1 && j + group <= end; j += group) {
        const int64_t column = j * kPanelCols, cols = std::min(group * kPanelCols, out_features - column);
        const T* b = bias ? bias + column : nullptr;
        (group == 4 ? tile<1, 4, T> : tile<2, 2, T>)(xb, k_count, w + j * panel_words, panel_words, k_count, Fetch{},
                                                      ob + column, out_features, cols, b);
      }
      // From two tiles a panel up, the tiles fetch the thread's next panel between them, so that its
      // first tile does not wait on memory (SmolLM2's 30 layers at 32 rows: 43 ms against 91; one tile a
      // panel (3-4 rows) ran slower with it).
      const int64_t tiles = (block_rows + kTileRows - 1) / kTileRows;
      const int64_t panel_lines = panel_words * 2 / kLine, per_tile = (panel_lines + tiles - 1) / tiles;
      const auto next_lines = [&](int64_t j, int64_t t) {
        if (tiles < 2 || j + 1 >= end || t * per_tile >= panel_lines) return Fetch{};
        const char* next = reinterpret_cast<const char*>(w + (j + 1) * panel_words);
        return Fetch{next + t * per_tile * kLine, std::min(per_tile, panel_lines - t * per_tile)};
      };
      for (; j < end; ++j) {
        const int64_t column = j * kPanelCols, cols = std::min(kPanelCols, out_features - column);
        const T* b = bias ? bias + column : nullptr;
        for (int64_t r = 0; r < block_rows; r += kTileRows) {
          kOnePanel<T>[std::min<int64_t>(kTileRows, block_rows - r)](
              xb + r * k_count, k_count, w + j * panel_words, panel_words, k_count, next_lines(j, r / kTileRows),
              ob + r * out_features + column, out_features, cols, b);
        }
      }
    }
  });
}

// x [M, K] float32 or bf16, packed from pack_bf16_linear of a [out_features, K] weight, bias
// [out_features] of x's dtype or None -> [M, out_features] of x's dtype.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanelCols && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && (out_features + kPanelCols - 1) / kPanelCols == packed.size(0),
              "bf16_linear: the weight must come from pack_bf16_linear of ", out_features, " rows");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == packed.size(1) && packed.size(1) > 0 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "bf16_linear: x must be [M, ", packed.size(1), "] float32 or bfloat16");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == x_in.scalar_type()),
              "bf16_linear: bias must be dense [", out_features, "] of x's dtype");
  const int64_t rows = x_in.size(0);
  at::Tensor out = at::empty({rows, out_features}, x_in.options());
  if (rows == 0) return out;
  // One float32 copy of x: each panel reads every row, so widening bf16 once per call is the cheap place.
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  CADENCE_DISPATCH_FLOAT(x_in.scalar_type(), "bf16_linear", [&] {
    run<scalar_t>(x.data_ptr<float>(), rows, x.size(1), w, packed.size(0), out.data_ptr<scalar_t>(), out_features,
                  bias ? bias->data_ptr<scalar_t>() : nullptr);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_avx2, m) {
  m.def("bf16_linear_supported() -> bool", bf16_linear_supported);  // no tensors: callable on any dispatch key
  m.def("pack_bf16_linear(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(cadence_avx2, CPU, m) {
  m.impl("pack_bf16_linear", pack_bf16_linear);
  m.impl("bf16_linear", bf16_linear);
}
