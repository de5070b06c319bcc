// Linear layers over quantized weights on x86 CPUs with AVX512-VNNI: y = x @ W.T (+ bias), where
// W is in the block form of cadence/quantization/blocks.py (value = scale * code + minimum per
// row and block of 16 or 32 input columns, unsigned 4-, 5-, 6- or 8-bit codes) packed by
// cadence/quantization/packed.py: panels of 16 rows, and per (panel, block) the 16 rows' float16
// scales, their 16 float16 minimums (none where symmetric), then the codes in steps of 4 columns,
// 64 bytes per step, bytes 4j..4j+3 row j's (narrower codes in a nibble plane and a plane of high
// bits: see step_codes). Panels go in groups of 4 whose (panel, block) runs interleave block by
// block, so that a group is one sequential stream.
//
// The activations are quantized per call, per row and block of the weight, into two int8 parts:
// x ~ s * (hi + lo / 254) with s = max|x| / 127, hi = round(x / s), lo = round((x - s * hi) * 254 / s)
// (round half to even), so |x - xq| <= s / 508, about 2^-16 of the block's largest value: llama.cpp's
// one int8 part (error s / 2) moves SmolLM2's logits by about 0.1 and its greedy tokens with them,
// two do not (docs/quantization.md). Per step, two VPDPBUSDs add 4 code x part products into each
// row's 32-bit lanes; per block y += scale * s * (isum_hi + isum_lo / 254) + minimum * x_sum, where
// x_sum is the block's sum of xq. So y = sum_k w_k * xq_k but for float32 rounding. Threads own
// whole groups; each weight byte is read once per call (per 256 rows of x), and kPrefetchBytes ahead
// of its use it is prefetched into L2: at one row a call is bound by how fast the weights arrive,
// and the hardware prefetchers alone brought them 25% slower (docs/quantization.md). Built on first
// use by cadence/backends/cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quant_pack.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace {

// Outside the target region below: called on every CPU (the kernels' AVX2 build loads this file on
// CPUs without AVX-512, where code of that region must never run).
bool quant_linear_supported() { return __builtin_cpu_supports("avx512vnni"); }

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512vnni")

namespace {

using namespace cadence::quant;

constexpr int64_t kTileRows = 4;
// Up to this many rows (a decode batch, or a few requests verifying drafts), each tile takes a
// whole group, three rows at a time (their 24 sums are what fits in registers beside the codes), and
// prefetches the weights it streams.
constexpr int64_t kWholeGroupRows = 9;
// How far ahead the weights are fetched. On 2026-12-01 12-20 KiB ahead measured alike at one row and 8
// KiB 10% slower; on 2026-12-07 (the same AMD EPYC, the kernel as it is now) 6 KiB took 4-10% less
// than 16 at one row, 13% less at 3 and 9% at 8 (4 KiB about as 6; 8 and 12 KiB between): the
// default model's linears 4.1-4.8 ms a token against 4.4-4.9, one stream 165 against 158 tok/s.
constexpr int64_t kPrefetchBytes = 6144;

// The kernel, as quant_pack.h's linear calls it.
struct Vnni {
  template <typename T>
  static void quantize_rows(const T* x, int64_t rows, int64_t stride, int64_t cols, int64_t block, QuantizedRows& q);
  template <typename F, typename T>
  static void run(const QuantizedRows& q, int64_t rows, int64_t cols, const uint8_t* w, int64_t groups, int64_t blocks,
                  T* out, int64_t out_features, const T* bias);
};

template <typename T>
void Vnni::quantize_rows(const T* x, int64_t rows, int64_t stride, int64_t cols, int64_t block, QuantizedRows& q) {
  const int64_t blocks = cols / block;
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / blocks, b = i % blocks;
      const T* src = x + r * stride + b * block;
      __m512 v[2];
      __m512 amax = _mm512_setzero_ps();
      for (int64_t h = 0; h < block / 16; ++h) {
        v[h] = cadence::load16(src + 16 * h);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[h]));
      }
      const float max = _mm512_reduce_max_ps(amax), d = max / 127.0f;
      const __m512 inv = _mm512_set1_ps(d > 0 ? 127.0f / max : 0.0f);
      const __m512 inv_lo = _mm512_set1_ps(d > 0 ? 127.0f * kLoSteps / max : 0.0f);
      __m512i hi_total = _mm512_setzero_si512(), lo_total = _mm512_setzero_si512();
      for (int64_t h = 0; h < block / 16; ++h) {
        const int64_t at = r * cols + b * block + 16 * h;
        const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));  // MXCSR: round to nearest even
        // rounded after the product, then after the difference: as torch computes it
        const __m512 rest = _mm512_sub_ps(v[h], _mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(d)));
        const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(rest, inv_lo));
        hi_total = _mm512_add_epi32(hi_total, hi);
        lo_total = _mm512_add_epi32(lo_total, lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.hi.get() + at), _mm512_cvtsepi32_epi8(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.lo.get() + at), _mm512_cvtsepi32_epi8(lo));
      }
      q.scale[i] = d;
      q.sum[i] = d * (static_cast<float>(_mm512_reduce_add_epi32(hi_total)) +
                      static_cast<float>(_mm512_reduce_add_epi32(lo_total)) / kLoSteps);
    }
  });
}

// How many blocks of a group ahead of its use a whole-group tile prefetches.
template <typename F>
constexpr int64_t kAhead = std::max<int64_t>(1, kPrefetchBytes / F::kGroupBytes);

// Step s of one (panel, block)'s codes, unpacked to 64 bytes: 8-bit codes as stored; narrower ones
// from the nibble plane (steps s and s + Block/8 share a vector), their fifth and sixth bits from the
// high plane after it (a vector per 8 steps of 5-bit codes, bit s % 8 of each byte; per 4 steps of
// 6-bit ones, bits 2(s % 4) and the next), moved to bits 4-5 with 16-bit shifts that keep each
// byte's bits in that byte.
template <typename F>
inline __m512i step_codes(const uint8_t* codes, int s) {
  if constexpr (F::kBits == 8) {
    return _mm512_loadu_si512(codes + 64 * s);
  } else {
    constexpr int kHalf = F::kBlock / 8;
    const __m512i both = _mm512_loadu_si512(codes + 64 * (s % kHalf));
    const __m512i low = _mm512_and_si512(s < kHalf ? both : _mm512_srli_epi16(both, 4), _mm512_set1_epi8(0x0F));
    if constexpr (F::kBits == 4) {
      return low;
    } else {
      constexpr int kHigh = F::kBits - 4, kPer = kHigh == 1 ? 8 : 4;
      const __m512i plane = _mm512_loadu_si512(codes + 64 * kHalf + 64 * (s / kPer));
      const int at = (s % kPer) * kHigh;  // where the step's high bits sit in each byte
      const __m512i moved = at <= 4 ? _mm512_slli_epi16(plane, 4 - at) : _mm512_srli_epi16(plane, at - 4);
      // low | (moved & mask)
      return _mm512_ternarylogic_epi32(low, moved, _mm512_set1_epi8(((1 << kHigh) - 1) << 4), 0xF8);
    }
  }
}

// U blocks from block b of P adjacent panels of one group (panel points at the first) against rows
// [r0, r0 + R) of the quantized activations, added into acc: R x P x U independent 32-bit sums per
// step keep the VPDPBUSD pipes busy (one sum's chain of Block/4 dependent VPDPBUSDs would leave
// them idle most of the time).
template <typename F, int R, int P, int U>
inline void add_blocks(__m512 (&acc)[R][P], const QuantizedRows& q, int64_t r0, int64_t cols, const uint8_t* panel,
                       int64_t b, const uint8_t* stream_end) {
  constexpr int kSteps = F::kSteps;
  constexpr int64_t block_bytes = F::kBytes, group_block_bytes = F::kGroupBytes;
  if constexpr (P == kGroupPanels) {  // whole groups: few rows, bound by how fast the weights arrive
    for (int u = 0; u < U; ++u) {
      const uint8_t* next = panel + (b + u + kAhead<F>) * group_block_bytes;
      if (next >= stream_end) break;
      for (int64_t line = 0; line < group_block_bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
      }
    }
  }
  const int32_t* xhi = reinterpret_cast<const int32_t*>(q.hi.get() + r0 * cols);
  const int32_t* xlo = reinterpret_cast<const int32_t*>(q.lo.get() + r0 * cols);
  const int64_t row_words = cols / 4, row_blocks = cols / F::kBlock;
  __m512i hi[U][R][P], lo[U][R][P];
  for (int u = 0; u < U; ++u) {
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) hi[u][r][p] = lo[u][r][p] = _mm512_setzero_si512();
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < kSteps; ++s) {
    for (int u = 0; u < U; ++u) {
      __m512i w[P];
      for (int p = 0; p < P; ++p) {
        w[p] = step_codes<F>(panel + p * block_bytes + (b + u) * group_block_bytes + F::kHeader, s);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * row_words + (b + u) * kSteps + s;
        const __m512i x_hi = _mm512_set1_epi32(xhi[at]), x_lo = _mm512_set1_epi32(xlo[at]);
        for (int p = 0; p < P; ++p) {
          hi[u][r][p] = _mm512_dpbusd_epi32(hi[u][r][p], w[p], x_hi);
          lo[u][r][p] = _mm512_dpbusd_epi32(lo[u][r][p], w[p], x_lo);
        }
      }
    }
  }
  const __m512 per_lo = _mm512_set1_ps(1.0f / kLoSteps);
  for (int u = 0; u < U; ++u) {
    for (int p = 0; p < P; ++p) {
      const uint8_t* scales = panel + p * block_bytes + (b + u) * group_block_bytes;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * row_blocks + b + u;
        // The sums are below 2^24 (8 steps x 4 x 255 x 127): exact as floats.
        const __m512 codes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[u][r][p]), per_lo, _mm512_cvtepi32_ps(hi[u][r][p]));
        if constexpr (F::kSymmetric) {  // scale * (codes . xq - 2^(Bits-1) * sum(xq))
          constexpr float kOffset = 1 << (F::kBits - 1);
          const __m512 dot = _mm512_fmadd_ps(codes, _mm512_set1_ps(q.scale[at]), _mm512_set1_ps(-kOffset * q.sum[at]));
          acc[r][p] = _mm512_fmadd_ps(dot, scale, acc[r][p]);
        } else {
          const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
          const __m512 dot = _mm512_mul_ps(codes, _mm512_set1_ps(q.scale[at]));
          acc[r][p] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(q.sum[at]), _mm512_fmadd_ps(dot, scale, acc[r][p]));
        }
      }
    }
  }
}

// Rows [r0, r0 + R) of the quantized activations against P adjacent panels of one group (16 P
// output columns, out_cols of them kept). A whole group's tile prefetches the thread's stream of
// groups ahead, across the group's end up to stream_end (groups of decode layers are a few KiB:
// stopping at each one's end left its first blocks unfetched, and 25% of the gain).
template <typename F, int R, int P, typename T>
void tile(const QuantizedRows& q, int64_t r0, int64_t cols, const uint8_t* panel, int64_t blocks,
          const uint8_t* stream_end, T* out, int64_t out_stride, int64_t out_cols, const T* bias) {
  constexpr int kUnroll = R * P <= 1 ? 4 : R * P <= 2 ? 2 : 1;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  int64_t b = 0;
  for (; b + kUnroll <= blocks; b += kUnroll) {
    add_blocks<F, R, P, kUnroll>(acc, q, r0, cols, panel, b, stream_end);
  }
  for (; b < blocks; ++b) add_blocks<F, R, P, 1>(acc, q, r0, cols, panel, b, stream_end);
  for (int p = 0; p < P && 16 * p < out_cols; ++p) {
    const __mmask16 m = cadence::tail_mask(out_cols - 16 * p);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = bias ? _mm512_add_ps(acc[r][p], cadence::load16(bias + 16 * p, m)) : acc[r][p];
      cadence::store16(out + r * out_stride + 16 * p, sum, m);
    }
  }
}

template <typename F, typename T>
void Vnni::run(const QuantizedRows& q, int64_t rows, int64_t cols, const uint8_t* w, int64_t groups, int64_t blocks,
               T* out, int64_t out_features, const T* bias) {
  using Tile = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, const uint8_t*, T*, int64_t,
                        int64_t, const T*);
  constexpr Tile kPairs[kTileRows + 1] = {nullptr, tile<F, 1, 2, T>, tile<F, 2, 2, T>, tile<F, 3, 2, T>,
                                          tile<F, 4, 2, T>};
  constexpr int64_t block_bytes = F::kBytes;
  const int64_t group_bytes = blocks * F::kGroupBytes;
  // A few rows: each row against a whole group at a time (one activation broadcast serves four
  // VPDPBUSDs; measured at one row, 8-40% faster than one panel at a time but for one shape).
  // More rows: up to 4 rows against two panels, twice the independent sums per step.
  const bool whole_groups = rows <= kWholeGroupRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    // Rows go in blocks whose activations stay in L2 while the thread's panels pass over them.
    for (int64_t first = 0; first < rows; first += kRowBlock) {
      const int64_t last = std::min(rows, first + kRowBlock);
      const uint8_t* stream_end = w + end * group_bytes;
      // The tiles prefetch kPrefetchBytes ahead of themselves: the first ones are fetched here.
      const uint8_t* start = w + begin * group_bytes;
      const uint8_t* head_end = std::min(stream_end, start + kPrefetchBytes);
      for (const uint8_t* line = start; whole_groups && line < head_end; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
      }
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = w + g * group_bytes;
        for (int64_t j = 0; j < kGroupPanels; j += whole_groups ? kGroupPanels : 2) {
          const int64_t column = (g * kGroupPanels + j) * kLanes;  // the tile's first output column
          const int64_t out_cols = std::min((whole_groups ? kGroupPanels : 2) * kLanes, out_features - column);
          if (out_cols <= 0) break;  // panels of zero rows that fill the last group
          const T* tile_bias = bias ? bias + column : nullptr;
          if (whole_groups) {
            int64_t r = first;
            for (; r + 3 <= last; r += 3) {  // three rows share each step's unpacked codes
              tile<F, 3, kGroupPanels, T>(q, r, cols, group, blocks, stream_end, out + r * out_features + column,
                                          out_features, out_cols, tile_bias);
            }
            for (; r + 2 <= last; r += 2) {
              tile<F, 2, kGroupPanels, T>(q, r, cols, group, blocks, stream_end, out + r * out_features + column,
                                          out_features, out_cols, tile_bias);
            }
            if (r < last) {
              tile<F, 1, kGroupPanels, T>(q, r, cols, group, blocks, stream_end, out + r * out_features + column,
                                          out_features, out_cols, tile_bias);
            }
          } else {
            for (int64_t r = first; r < last; r += kTileRows) {
              kPairs[std::min(kTileRows, last - r)](q, r, cols, group + j * block_bytes, blocks, stream_end,
                                                    out + r * out_features + column, out_features, out_cols,
                                                    tile_bias);
            }
          }
        }
      }
    }
  });
}

}  // namespace

#pragma GCC pop_options

CADENCE_QUANT_LINEAR_OPS(cadence_cpu, Vnni, quant_linear_supported)
