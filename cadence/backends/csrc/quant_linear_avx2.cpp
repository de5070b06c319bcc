// Linear layers over quantized weights on x86 CPUs with AVX2 (and FMA, F16C), for those without
// AVX512-VNNI: the op of quant_linear.cpp over the same packed weights and the same activations
// quantized into two int8 parts, equal to it bit for bit (quant_pack.h; the float operations per
// block are the same, in the same order). Where one VPDPBUSD adds 4 code x activation products into
// each 32-bit lane, here VPMADDUBSW adds them in pairs into 16-bit lanes, which add up over as many
// steps as cannot overflow (all 8 of a 4-bit block: 8 x 2 x 15 x 127 < 2^15) before VPMADDWD widens
// them; 8-bit codes go as two nibbles (a pair of 255 x 127 would saturate). A panel's 64-byte step is
// two 256-bit halves, its rows 0-7 and 8-15. Each tile takes a whole group (4 panels, one sequential
// stream of bytes) against up to 2 rows of x. Built on first use by cadence/backends/cpu_kernels.py,
// as its own library (torch.ops.cadence_avx2), which loads on any x86-64 CPU with AVX2.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2.h"
#include "quant_pack.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

using namespace cadence::avx2;
using namespace cadence::quant;

// Rows of x per tile: 2 measured 10-25% faster than 3 (whose 12 sums spill beside the codes) and 4
// from 128 rows up; at one row a tile is bound by how fast the weights arrive.
constexpr int kTileRows = 2;

bool quant_linear_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// 8 int32 in [-127, 127] stored as 8 int8.
inline void store_int8(int8_t* p, __m256i v) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}

// The kernel, as quant_pack.h's linear calls it.
struct Avx2 {
  template <typename T>
  static void quantize_rows(const T* x, int64_t rows, int64_t stride, int64_t cols, int64_t block, QuantizedRows& q);
  template <typename F, typename T>
  static void run(const QuantizedRows& q, int64_t rows, int64_t cols, const uint8_t* w, int64_t groups, int64_t blocks,
                  T* out, int64_t out_features, const T* bias);
};

// quant_linear.cpp's quantize_rows, 8 values at a time: the same products, differences and
// roundings (MXCSR's nearest even), so the same codes and sums.
template <typename T>
void Avx2::quantize_rows(const T* x, int64_t rows, int64_t stride, int64_t cols, int64_t block, QuantizedRows& q) {
  const int64_t blocks = cols / block;
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / blocks, b = i % blocks;
      const T* src = x + r * stride + b * block;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int64_t h = 0; h < block / 8; ++h) {
        v[h] = load8(src + 8 * h);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[h]));
      }
      const float max = reduce_max(amax), d = max / 127.0f;
      const __m256 inv = _mm256_set1_ps(d > 0 ? 127.0f / max : 0.0f);
      const __m256 inv_lo = _mm256_set1_ps(d > 0 ? 127.0f * kLoSteps / max : 0.0f);
      __m256i hi_total = _mm256_setzero_si256(), lo_total = _mm256_setzero_si256();
      for (int64_t h = 0; h < block / 8; ++h) {
        const int64_t at = r * cols + b * block + 8 * h;
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], inv));
        const __m256 rest = _mm256_sub_ps(v[h], _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d)));
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(rest, inv_lo));
        hi_total = _mm256_add_epi32(hi_total, hi);
        lo_total = _mm256_add_epi32(lo_total, lo);
        store_int8(q.hi.get() + at, hi);
        store_int8(q.lo.get() + at, lo);
      }
      q.scale[i] = d;
      q.sum[i] = d * (static_cast<float>(reduce_add(hi_total)) + static_cast<float>(reduce_add(lo_total)) / kLoSteps);
    }
  });
}

// What a form's codes take per step: 8-bit codes go as two nibbles, each one's pair products in 16
// bits; narrower codes whole.
template <typename F>
struct Lanes16 {
  static constexpr int kNibbles = F::kBits == 8 ? 2 : 1;
  static constexpr int kLargest = F::kBits == 8 ? 15 : (1 << F::kBits) - 1;
  // Steps whose VPMADDUBSW pairs add up in 16 bits without overflow (x's parts are within +-127).
  static constexpr int kChunk = std::min(F::kSteps, 32767 / (2 * 127 * kLargest));
};

// Step s of one (panel, block)'s codes (quant_linear.cpp's step_codes), in the two halves of the
// panel's rows; 8-bit codes split into their low and high nibbles (w[h][0], w[h][1]).
template <typename F>
inline void step_codes(const uint8_t* codes, int s, __m256i (&w)[2][Lanes16<F>::kNibbles]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    if constexpr (F::kBits == 8) {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * s + 32 * h));
      w[h][0] = _mm256_and_si256(both, nibble);
      w[h][1] = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
    } else {
      constexpr int kHalf = F::kBlock / 8;
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (s % kHalf) + 32 * h));
      const __m256i low = _mm256_and_si256(s < kHalf ? both : _mm256_srli_epi16(both, 4), nibble);
      if constexpr (F::kBits == 4) {
        w[h][0] = low;
      } else {
        constexpr int kHigh = F::kBits - 4, kPer = kHigh == 1 ? 8 : 4;
        const __m256i plane =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * kHalf + 64 * (s / kPer) + 32 * h));
        const int at = (s % kPer) * kHigh;  // where the step's high bits sit in each byte
        const __m256i moved = at <= 4 ? _mm256_slli_epi16(plane, 4 - at) : _mm256_srli_epi16(plane, at - 4);
        w[h][0] = _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(((1 << kHigh) - 1) << 4)));
      }
    }
  }
}

// The integer sums of one (panel, block): its codes against R rows of x's parts (xhi, xlo at the
// block's first word of the first row), per row, half and part (hi, lo), 8 int32 lanes, one per
// weight row.
template <typename F, int R>
inline void block_sums(const uint8_t* codes, const int32_t* xhi, const int32_t* xlo, int64_t row_words,
                       __m256i (&sum)[R][2][2]) {
  using L = Lanes16<F>;
  const __m256i widen[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(16)};  // a nibble's weight
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) sum[r][h][0] = sum[r][h][1] = _mm256_setzero_si256();
  }
  for (int first = 0; first < F::kSteps; first += L::kChunk) {
    __m256i pairs[R][2][2][L::kNibbles];
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        for (int n = 0; n < L::kNibbles; ++n) pairs[r][h][0][n] = pairs[r][h][1][n] = _mm256_setzero_si256();
      }
    }
#pragma GCC unroll 8
    for (int s = first; s < first + L::kChunk; ++s) {
      __m256i w[2][L::kNibbles];
      step_codes<F>(codes, s, w);
      for (int r = 0; r < R; ++r) {
        const __m256i x[2] = {_mm256_set1_epi32(xhi[r * row_words + s]), _mm256_set1_epi32(xlo[r * row_words + s])};
        for (int h = 0; h < 2; ++h) {
          for (int k = 0; k < 2; ++k) {
            for (int n = 0; n < L::kNibbles; ++n) {
              pairs[r][h][k][n] = _mm256_add_epi16(pairs[r][h][k][n], _mm256_maddubs_epi16(w[h][n], x[k]));
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 2; ++k) {
          for (int n = 0; n < L::kNibbles; ++n) {
            sum[r][h][k] = _mm256_add_epi32(sum[r][h][k], _mm256_madd_epi16(pairs[r][h][k][n], widen[n]));
          }
        }
      }
    }
  }
}

// Rows [r0, r0 + R) of the quantized activations against a whole group (64 output columns,
// out_cols of them kept): per block and panel, the integer sums, then quant_linear.cpp's float
// steps in its order.
template <typename F, int R, typename T>
void tile(const QuantizedRows& q, int64_t r0, int64_t cols, const uint8_t* group, int64_t blocks, T* out,
          int64_t out_stride, int64_t out_cols, const T* bias) {
  const int32_t* xhi = reinterpret_cast<const int32_t*>(q.hi.get() + r0 * cols);
  const int32_t* xlo = reinterpret_cast<const int32_t*>(q.lo.get() + r0 * cols);
  const int64_t row_words = cols / 4, row_blocks = cols / F::kBlock;
  const int panels = static_cast<int>(std::min<int64_t>(kGroupPanels, (out_cols + kLanes - 1) / kLanes));
  const __m256 per_lo = _mm256_set1_ps(1.0f / kLoSteps);
  __m256 acc[R][kGroupPanels][2];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < kGroupPanels; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int p = 0; p < panels; ++p) {
      const uint8_t* run = group + b * F::kGroupBytes + p * F::kBytes;
      __m256i sum[R][2][2];
      block_sums<F, R>(run + F::kHeader, xhi + b * F::kSteps, xlo + b * F::kSteps, row_words, sum);
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h)));
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * row_blocks + b;
          const __m256 codes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h][1]), per_lo, _mm256_cvtepi32_ps(sum[r][h][0]));
          if constexpr (F::kSymmetric) {
            constexpr float kOffset = 1 << (F::kBits - 1);
            const __m256 dot = _mm256_fmadd_ps(codes, _mm256_set1_ps(q.scale[at]), _mm256_set1_ps(-kOffset * q.sum[at]));
            acc[r][p][h] = _mm256_fmadd_ps(dot, scale, acc[r][p][h]);
          } else {
            const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 32 + 16 * h)));
            const __m256 dot = _mm256_mul_ps(codes, _mm256_set1_ps(q.scale[at]));
            acc[r][p][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(q.sum[at]), _mm256_fmadd_ps(dot, scale, acc[r][p][h]));
          }
        }
      }
    }
  }
  for (int p = 0; p < panels; ++p) {
    for (int h = 0; h < 2; ++h) {
      const int64_t column = kLanes * p + 8 * h, n = std::min<int64_t>(8, out_cols - column);
      if (n <= 0) break;
      for (int r = 0; r < R; ++r) {
        __m256 v = acc[r][p][h];
        if (bias) v = _mm256_add_ps(v, load_upto8(bias + column, n));
        store_upto8(out + r * out_stride + column, v, n);
      }
    }
  }
}

// Threads own whole groups; rows go in blocks whose activations stay in L2 while a thread's
// groups pass over them, two at a time against each group.
template <typename F, typename T>
void Avx2::run(const QuantizedRows& q, int64_t rows, int64_t cols, const uint8_t* w, int64_t groups, int64_t blocks,
               T* out, int64_t out_features, const T* bias) {
  using Tile = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, T*, int64_t, int64_t,
                        const T*);
  constexpr Tile kTiles[kTileRows + 1] = {nullptr, tile<F, 1, T>, tile<F, 2, T>};
  const int64_t group_bytes = blocks * F::kGroupBytes;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += kRowBlock) {
      const int64_t last = std::min(rows, first + kRowBlock);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t column = g * kGroupPanels * kLanes;
        const int64_t out_cols = std::min(kGroupPanels * kLanes, out_features - column);
        const T* tile_bias = bias ? bias + column : nullptr;
        for (int64_t r = first; r < last; r += kTileRows) {
          kTiles[std::min<int64_t>(kTileRows, last - r)](q, r, cols, w + g * group_bytes, blocks,
                                                         out + r * out_features + column, out_features, out_cols,
                                                         tile_bias);
        }
      }
    }
  });
}

}  // namespace

CADENCE_QUANT_LINEAR_OPS(cadence_avx2, Avx2, quant_linear_supported)
