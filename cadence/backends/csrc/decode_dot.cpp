// A bf16 decode's scores and weighted values by VDPBF16PS, where the CPU has AVX512-BF16 but no tile
// unit (AMD Zen 4 and later), for the shapes whose query heads fit the registers beside a key: 1-4
// query heads per KV head at head_dim 64, 1-2 at 128 (paged_attention.cpp's attend_decode<G, C>).
//
// The fp32 path converts every key and value to fp32 and sums each score horizontally, key by key:
// decodes there are bound by those instructions, not by reading the cache. Here the keys and values
// are read as bf16 pairs, as the products take them:
// - a key's score for a query head is two bf16 products summed into each of 16 lanes per 32 dims, and
//   the 16 lanes of up to 16 keys are summed together (sum_lanes: 15 shuffles and adds of vectors
//   instead of 16 horizontal sums);
// - the probabilities, rounded to bf16 (as flash attention on tiles and the tile unit's path do),
//   weigh two value rows at a time, interleaved into pairs by a permutation.
// On 2 AMD EPYC cores (2026-12-07; 30 layers, SmolLM2's 3 query heads per KV head at head_dim 64): 8
// decodes over 200 keys, a cache that stays in L2, 0.91 ms against 1.22 on the fp32 path; 64 over 200
// keys 13.8 ms against 15.2 and 16 over 1,000 16.8 against 18.4, where both wait on the cache's bytes
// (half of the scores' time sits on the prefetches of the next task's blocks).
// Built with the other kernels by cadence/backends/cpu_kernels.py; not at all in their AVX2 build.

#include "paged_attention.h"

#if defined(__AVX512F__)

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace cadence {

namespace {

// Lane i: the sum of v[i]'s 16 lanes. Pairs of vectors are folded into one at each of four levels
// (within 128-bit lanes twice, then across them twice), so that the lanes end in the vectors' order.
__attribute__((always_inline)) inline __m512 sum_lanes(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {
    halves[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(halves[2 * i]), b = _mm512_castps_pd(halves[2 * i + 1]);
    quarters[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of G query heads (q: G bf16 rows of 16 C dims) against keys [begin, len), scaled, to out
// [G][len]; the next task's blocks fetched meanwhile, as paged_attention.cpp's score() does.
template <int G, int C>
void scores(const Shape s, const at::BFloat16* q, int64_t begin, int64_t len, const at::BFloat16* keys,
            const int64_t* blocks, const Upcoming<at::BFloat16>& next, float* out) {
  constexpr int H = C / 2, dim = 16 * C;  // H: vectors of 32 dims a row
  const int64_t block_elems = s.block_size * dim, first_block = begin / s.block_size;
  const int64_t num_blocks = (len + s.block_size - 1) / s.block_size - first_block;
  __m512bh qv[G][H];
  for (int g = 0; g < G; ++g) {
    for (int h = 0; h < H; ++h) qv[g][h] = load_pairs(reinterpret_cast<const uint16_t*>(q) + g * dim + 32 * h);
  }
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t b = first_block, first = first_block * s.block_size; first < len; ++b, first += s.block_size) {
    prefetch_share(next, b - first_block, num_blocks, block_elems);
    if (first + s.block_size < len) prefetch_block(keys + blocks[b + 1] * block_elems, block_elems * 2);
    const uint16_t* block = reinterpret_cast<const uint16_t*>(keys + blocks[b] * block_elems);
    const int64_t n = std::min(s.block_size, len - first);
    for (int64_t t = std::max(int64_t{0}, begin - first); t < n; t += 16) {
      const int64_t m = std::min(int64_t{16}, n - t);
      for (int g = 0; g < G; ++g) {
        __m512 sums[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          sums[i] = _mm512_setzero_ps();
          if (i < m) {
            for (int h = 0; h < H; ++h) sums[i] = _mm512_dpbf16_ps(sums[i], load_pairs(block + (t + i) * dim + 32 * h), qv[g][h]);
          }
        }
        _mm512_mask_storeu_ps(out + g * len + first + t, tail_mask(m), _mm512_mul_ps(sum_lanes(sums), scale));
      }
    }
  }
}

// Lanes 2j and 2j + 1: lane j of a and of b (two value rows' 16-bit dims interleaved into pairs), for
// dims [0, 16) of 32 (kLow) and [16, 32) (kHigh).
__m512i interleave(int from) {
  alignas(64) int16_t index[32];
  for (int j = 0; j < 16; ++j) {
    index[2 * j] = static_cast<int16_t>(from + j);
    index[2 * j + 1] = static_cast<int16_t>(32 + from + j);
  }
  return _mm512_load_si512(index);
}

// out [G][dim] = the G heads' probabilities (bf16, probs [G][stride] from key `begin`) times the values
// [begin, len), two keys at a time, each row's pairs in the keys' order.
template <int G, int C>
void weigh(const Shape s, const uint16_t* probs, int64_t stride, int64_t begin, int64_t len,
           const at::BFloat16* values, const int64_t* blocks, float* out) {
  constexpr int H = C / 2, dim = 16 * C;
  static const __m512i kLow = interleave(0), kHigh = interleave(16);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  const int64_t block_elems = s.block_size * dim, last_block = (len - 1) / s.block_size;
  for (int64_t k = begin, fetched = begin / s.block_size; k < len; k += 2) {
    if (k / s.block_size == fetched && fetched < last_block) {  // entering a block: fetch the next one
      prefetch_block(values + blocks[++fetched] * block_elems, block_elems * 2);
    }
    const uint16_t* a = key_row(values, blocks, k, s);
    const uint16_t* b = k + 1 < len ? key_row(values, blocks, k + 1, s) : nullptr;  // its probability is 0
    __m512bh v[C];
    for (int h = 0; h < H; ++h) {
      const __m512i x = _mm512_loadu_si512(a + 32 * h), y = b ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
      v[2 * h] = reinterpret_cast<__m512bh>(_mm512_permutex2var_epi16(x, kLow, y));
      v[2 * h + 1] = reinterpret_cast<__m512bh>(_mm512_permutex2var_epi16(x, kHigh, y));
    }
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, probs + g * stride + (k - begin), sizeof(pair));
      const __m512bh p = broadcast_pair(pair);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p, v[c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * dim + 16 * c, acc[g][c]);
  }
}

using Scores = void (*)(const Shape, const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, const int64_t*,
                        const Upcoming<at::BFloat16>&, float*);
using Weigh = void (*)(const Shape, const uint16_t*, int64_t, int64_t, int64_t, const at::BFloat16*, const int64_t*,
                       float*);

struct Instance {
  Scores scores;
  Weigh weigh;
};

// By fixed_decode_shape (paged_attention.h).
constexpr std::array<Instance, kFixedDecodeShapes> kInstances = {{{&scores<1, 4>, &weigh<1, 4>}, {&scores<2, 4>, &weigh<2, 4>},
                                                 {&scores<3, 4>, &weigh<3, 4>}, {&scores<4, 4>, &weigh<4, 4>},
                                                 {&scores<1, 8>, &weigh<1, 8>}, {&scores<2, 8>, &weigh<2, 8>}}};

const Instance* instance(const Shape& s) {
  const int shape = fixed_decode_shape(s);
  return shape < 0 ? nullptr : &kInstances[shape];
}

}  // namespace

bool dot_decodes(const Shape& s) { return use_bf16_dot() && !use_amx() && instance(s) != nullptr; }

void dot_decode_scores(const Shape& s, const at::BFloat16* q, int64_t begin, int64_t len, const at::BFloat16* keys,
                       const int64_t* blocks, const Upcoming<at::BFloat16>& next, float* out) {
  instance(s)->scores(s, q, begin, len, keys, blocks, next, out);
}

void dot_decode_weigh(const Shape& s, const uint16_t* probs, int64_t stride, int64_t begin, int64_t len,
                      const at::BFloat16* values, const int64_t* blocks, float* out) {
  instance(s)->weigh(s, probs, stride, begin, len, values, blocks, out);
}

}  // namespace cadence

#pragma GCC pop_options

#endif
