// Loads and stores of 8 float32 lanes from and to float32 or bfloat16 memory, for the kernels built
// for AVX2 (quant_linear_avx2.cpp, bf16_linear_avx2.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace cadence::avx2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The first n < 8 values of p, zeros after them.
template <typename T>
inline __m256 load_head(const T* p, int64_t n) {
  T buf[8] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load8(buf);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// Rounded to nearest even, as torch's casts and vec.h's to_bf16_bits round (inputs are finite).
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename T>
inline void store_head(T* p, __m256 v, int64_t n) {
  T buf[8];
  store8(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}

// The first n of 8 lanes (1 <= n <= 8; zeros after them), and their store.
template <typename T>
inline __m256 load_upto8(const T* p, int64_t n) {
  return n == 8 ? load8(p) : load_head(p, n);
}

template <typename T>
inline void store_upto8(T* p, __m256 v, int64_t n) {
  if (n == 8) {
    store8(p, v);
  } else {
    store_head(p, v, n);
  }
}

}  // namespace cadence::avx2
