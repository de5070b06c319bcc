// AVX-512 helpers shared by cadence's CPU kernels: 16 floats at a time, from and to float32 or
// bfloat16 storage, with masked variants for row tails. bfloat16 values are rounded to nearest
// even, as torch's casts do, so a kernel that rounds where torch's op-by-op code rounds matches it.
//
// Built for AVX-512 the intrinsics are the CPU's own; built for AVX2 (the kernels' second build,
// cadence/backends/cpu_kernels.py) SIMDe (the simde-py package's headers) implements the same
// _mm512 intrinsics over pairs of 256-bit registers, so one source serves both.
#pragma once

#include <ATen/ATen.h>
#include "dispatch.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#else
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <climits>
#endif

namespace cadence {

// The sum of 8 floats in the order GCC's _mm512_reduce_add_ps sums the halves of 16 (so the AVX-512 and
// AVX2 paths of a kernel that halves its 16 lanes first sum alike).
inline float reduce_add8(__m256 half) {
  const __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
  const __m128 pairs = _mm_add_ps(quarter, _mm_shuffle_ps(quarter, quarter, 0x4E));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, 1));
}

}  // namespace cadence

#if !defined(__AVX512F__)
// The few intrinsics the kernels use that SIMDe 0.8.2 lacks, in GCC's own order of operations (so
// that a reduction rounds as it does on AVX-512), and its masked loads and stores, replaced.
inline float cadence_mm512_reduce_add_ps(simde__m512 a) {
  return cadence::reduce_add8(simde_mm256_add_ps(simde_mm512_extractf32x8_ps(a, 1), simde_mm512_castps512_ps256(a)));
}

inline int cadence_mm512_reduce_add_epi32(simde__m512i a) {
  const simde__m512i_private v = simde__m512i_to_private(a);
  int sum = 0;
  for (int i = 0; i < 16; ++i) sum += v.i32[i];
  return sum;
}

inline int cadence_mm512_mask_reduce_min_epi32(simde__mmask16 m, simde__m512i a) {
  return simde_mm512_reduce_min_epi32(simde_mm512_mask_mov_epi32(simde_mm512_set1_epi32(INT_MAX), m, a));
}

inline simde__m256i cadence_mm512_cvtepi32_epi16(simde__m512i a) {  // truncating, as VPMOVDW
  const simde__m512i_private v = simde__m512i_to_private(a);
  simde__m256i_private r;
  for (int i = 0; i < 16; ++i) r.i16[i] = static_cast<int16_t>(v.i32[i]);
  return simde__m256i_from_private(r);
}

// SIMDe's masked loads and stores read and write all 16 lanes (a store writes zeros past the mask:
// past a row's end); these touch only the lanes of the mask, as AVX-512's do (VMASKMOVPS for
// 32-bit lanes, which does not fault on the lanes left out; lane by lane for 16-bit ones).
inline simde__m256i cadence_lanes8(unsigned bits) {
  const simde__m256i bit = simde_mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return simde_mm256_cmpeq_epi32(simde_mm256_and_si256(simde_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), bit), bit);
}

inline simde__m512 cadence_mm512_maskz_loadu_ps(simde__mmask16 k, const void* p) {
  const float* f = static_cast<const float*>(p);
  if (k == 0xFFFF) return simde_mm512_loadu_ps(f);  // a row's full chunks, most of them
  const simde__m256 lo = simde_mm256_maskload_ps(f, cadence_lanes8(k)), hi = simde_mm256_maskload_ps(f + 8, cadence_lanes8(k >> 8));
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}

inline simde__m512 cadence_mm512_mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
  return simde_mm512_mask_mov_ps(src, k, cadence_mm512_maskz_loadu_ps(k, p));
}

inline void cadence_mm512_mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float* f = static_cast<float*>(p);
  if (k == 0xFFFF) return simde_mm512_storeu_ps(f, a);
  simde_mm256_maskstore_ps(f, cadence_lanes8(k), simde_mm512_castps512_ps256(a));
  simde_mm256_maskstore_ps(f + 8, cadence_lanes8(k >> 8), simde_mm512_extractf32x8_ps(a, 1));
}

inline simde__m256i cadence_mm256_maskz_loadu_epi16(simde__mmask16 k, const void* p) {
  uint16_t lanes[16] = {};
  for (int i = 0; i < 16; ++i) {
    if (k >> i & 1) lanes[i] = static_cast<const uint16_t*>(p)[i];
  }
  return simde_mm256_loadu_si256(lanes);
}

inline void cadence_mm256_mask_storeu_epi16(void* p, simde__mmask16 k, simde__m256i a) {
  uint16_t lanes[16];
  simde_mm256_storeu_si256(lanes, a);
  for (int i = 0; i < 16; ++i) {
    if (k >> i & 1) static_cast<uint16_t*>(p)[i] = lanes[i];
  }
}

#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_ps cadence_mm512_maskz_loadu_ps
#define _mm512_mask_loadu_ps cadence_mm512_mask_loadu_ps
#define _mm512_mask_storeu_ps cadence_mm512_mask_storeu_ps
#define _mm256_maskz_loadu_epi16 cadence_mm256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 cadence_mm256_mask_storeu_epi16
#define _mm512_reduce_add_ps cadence_mm512_reduce_add_ps
#define _mm512_reduce_add_epi32 cadence_mm512_reduce_add_epi32
#define _mm512_mask_reduce_min_epi32 cadence_mm512_mask_reduce_min_epi32
#define _mm512_cvtepi32_epi16 cadence_mm512_cvtepi32_epi16
#endif

#include <algorithm>
#include <cstdint>

namespace cadence {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u); }

// A row's argmax taken 16 values at a time, in order: each lane keeps its largest value and the
// first index it saw it at (a strict comparison keeps the earlier one on ties), and the smallest index
// among the lanes' maxima wins (0 for a row of -inf); NaN is never taken. greedy.cpp's, race.cpp's.
class LaneArgmax {
 public:
  // The row's next 16 values; only `lanes` of them compete.
  void take(__m512 v, __mmask16 lanes = 0xFFFF) {
    const __mmask16 better = _mm512_mask_cmp_ps_mask(lanes, v, best_, _CMP_GT_OQ);
    best_ = _mm512_mask_mov_ps(best_, better, v);
    where_ = _mm512_mask_mov_epi32(where_, better, index_);
    index_ = _mm512_add_epi32(index_, _mm512_set1_epi32(16));
  }

  // The row's indices of the 16 values `take` expects next.
  __m512i index() const { return index_; }

  int64_t first_max() const {
    const float top = _mm512_reduce_max_ps(best_);
    const __mmask16 at_top = _mm512_cmp_ps_mask(best_, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(at_top, where_);
  }

 private:
  __m512 best_ = _mm512_set1_ps(-INFINITY);
  __m512i where_ = _mm512_setzero_si512();
  __m512i index_ = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
};

#if !defined(__AVX512F__)
// The first n of 8 lanes (all of them from n = 8), as the mask of AVX2's masked loads and blends.
inline __m256i tail_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The next min(left, 8) floats from p, the lanes past them `fill` (read no further than the row's end).
inline __m256 load8(const float* p, int64_t left, float fill) {
  if (left >= 8) return _mm256_loadu_ps(p);
  const __m256i lanes = tail_mask8(left);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, lanes), _mm256_castsi256_ps(lanes));
}

// LaneArgmax in 8 native AVX2 lanes, the same choice (over SIMDe's 16 lanes its masked steps went lane
// by lane: greedy.cpp's row of 49,152 took 185 us against 13.5). Lanes that must not compete hold -inf.
class LaneArgmax8 {
 public:
  void take(__m256 v) {
    const __m256 better = _mm256_cmp_ps(v, best_, _CMP_GT_OQ);
    best_ = _mm256_blendv_ps(best_, v, better);
    where_ = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where_), _mm256_castsi256_ps(index_), better));
    index_ = _mm256_add_epi32(index_, _mm256_set1_epi32(8));
  }

  __m256i index() const { return index_; }

  int64_t first_max() const {
    alignas(32) float best[8];
    alignas(32) int32_t where[8];
    _mm256_store_ps(best, best_);
    _mm256_store_si256(reinterpret_cast<__m256i*>(where), where_);
    int lane = 0;
    for (int l = 1; l < 8; ++l) {
      if (best[l] > best[lane] || (best[l] == best[lane] && where[l] < where[lane])) lane = l;
    }
    return where[lane];
  }

 private:
  __m256 best_ = _mm256_set1_ps(-INFINITY);
  __m256i where_ = _mm256_setzero_si256();
  __m256i index_ = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
};
#endif

// `bytes` from p fetched into the cache level of Hint, a line at a time.
template <_mm_hint Hint = _MM_HINT_T0, typename T>
inline void prefetch_block(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, Hint);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

#if defined(__AVX512F__)
inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }
#else  // in native AVX2 halves: SIMDe's 512-bit conversions went lane by lane through memory
inline __m512 widen(__m256i bf16) {
  const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bf16)), 16));
  const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bf16, 1)), 16));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#endif

inline __m512 load16(const at::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

// The bfloat16 bit patterns of v, rounded to nearest even (inputs are finite).
#if defined(__AVX512F__)
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#else  // the same rounding in native AVX2 halves; the patterns (< 2^16) pack without saturating
inline __m256i to_bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}

inline __m256i to_bf16_bits(__m512 v) {
  const __m256i lo = to_bf16_bits8(_mm512_castps512_ps256(v)), hi = to_bf16_bits8(_mm512_extractf32x8_ps(v, 1));
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // packus interleaves the 128-bit lanes
}
#endif

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(at::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }

inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

// v rounded to the storage type T and widened back: where torch would store an intermediate.
template <typename T>
inline __m512 round_to(__m512 v) { return v; }

template <>
inline __m512 round_to<at::BFloat16>(__m512 v) {
  return widen(to_bf16_bits(v));
}

#if !defined(__AVX512F__)
// Native AVX2 halves (lanes 0-7, 8-15) of a 16-float vector, for the loops where SIMDe's 512-bit
// values, which live in memory, cost most: decode attention's dot products and weighted values (the
// compiler kept them on the stack, and a step of 32 decodes spent about half its time there). Lane
// for lane the same operations as the 512-bit code, so the results are the same bit for bit.
inline void load8x2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline __m256 widen8(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }

inline void load8x2(const at::BFloat16* p, __m256& lo, __m256& hi) {
  lo = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// _mm512_reduce_add_ps of the vector with halves lo and hi, in the order of the emulated one above.
inline float reduce_add8x2(__m256 lo, __m256 hi) {
  const __m256 half = _mm256_add_ps(hi, lo);
  const __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
  const __m128 pairs = _mm_add_ps(quarter, _mm_shuffle_ps(quarter, quarter, 0x4E));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, 1));
}
#endif

// r[i][j] -> r[j][i] in registers: pairs of rows interleaved by 32 bits, then by 64, then 128-bit
// lanes gathered (a few dozen shuffles where 256 scalar stores did it, which cost a short tile, such
// as a decode verifying speculative drafts, more than its arithmetic).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];  // u[4i + k]: in 128-bit lane L, rows 4i..4i+3 of column 4L + k
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 even_lo = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), odd_lo = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 even_hi = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD);
    r[k + 4] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    r[k + 12] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD);
  }
}

// e^x, Cephes' expf polynomial (relative error ~1e-7); x is clamped to [-87, 88].
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  return _mm512_scalef_ps(_mm512_add_ps(p, _mm512_set1_ps(1.0f)), n);
}

// silu(g) = g / (1 + e^-g) in fp32: silu_and_mul's, and the bf16 GEMM's fused gate/up epilogue's.
inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#else  // over SIMDe: the same operations lane for lane, in native AVX2 halves (SIMDe's 512-bit values
// went through memory between its emulated instructions); 2^n as a float's exponent, n being a whole
// number in [-126, 127] (SIMDe's scalef is slow)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  const __m256 power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(1.0f)), power);
}

inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// v rounded to the storage type T and widened back (round_to's 8 lanes).
template <typename T>
inline __m256 round_to8(__m256 v) { return v; }

template <>
inline __m256 round_to8<at::BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_bits8(v), 16));
}

inline __m512 exp16(__m512 x) {
  const __m256 lo = exp8(_mm512_castps512_ps256(x)), hi = exp8(_mm512_extractf32x8_ps(x, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

inline __m512 silu16(__m512 g) {
  const __m256 lo = silu8(_mm512_castps512_ps256(g)), hi = silu8(_mm512_extractf32x8_ps(g, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#endif

}  // namespace cadence
