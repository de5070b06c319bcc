// The sampler's random choice on x86 CPUs (AVX-512; AVX2 in 8 native lanes, the same bits): per row,
// the index of the largest p_i / E_i with E_i ~ Exponential(1) drawn independently for every token (an
// exponential race, which picks token i with probability p_i / sum(p); cadence/executor/token_choice.py),
// in one pass over the row. torch made the E_i as four passes over a [B, V] buffer: uniform_
// (single-threaded, 4.6 ms for 32 rows of 49,152 on 2 AMD EPYC cores), log_ (2.7 ms), neg_ and the
// division, then the argmax: 7.5 ms of a 45-ms step of 32 streams sampling at temperature 1, the OpenAI
// API's default. Here each E_i is -ln(u_i), u_i in (0, 1) from a counter-based hash of the row's 64-bit
// key and i (no state: the rows run on any thread, and a row's draw depends on its key alone), the
// logarithm Cephes' logf polynomial.
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

using namespace cadence;

// The hash's rounds' multipliers (Wellons' lowbias32 shifts with odd m1, m2): the counter's round,
// then the round after the key's high half is folded in.
constexpr uint32_t kRound1[2] = {0x7feb352d, 0x846ca68b}, kRound2[2] = {0x9e485565, 0xef1d6b47};
// u's 24 bits centred in their step of 2^-24, so u is never 0 or 1 and E = -ln u is finite and positive.
constexpr float kHalfStep = 0.5f, kStep = 1.0f / 16777216.0f;
// Cephes' logf: ln m for m in [sqrt(1/2), sqrt(2)) is f + f^3 P(f) - f^2 / 2 with f = m - 1 (P's
// coefficients from the highest power), and e ln 2 is added in two parts (kLn2Lo + kLn2Hi).
constexpr float kLogPoly[9] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                               -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f};
constexpr float kSqrt2 = 1.41421356f, kLn2Lo = -2.12194440e-4f, kLn2Hi = 0.693359375f;

#if defined(__AVX512F__)
// One round of the 32-bit hash, lane by lane.
inline __m512i mix32(__m512i x, const uint32_t (&m)[2]) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(m[0])));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(m[1])));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// u in (0, 1) for tokens `index` of the row keyed `key`: the low half of the key offsets the counter,
// the high half is folded in between the two rounds, and the top 24 bits of the hash make u.
inline __m512 uniform16(__m512i index, uint64_t key) {
  const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(key)), hi = _mm512_set1_epi32(static_cast<int32_t>(key >> 32));
  const __m512i h = mix32(_mm512_xor_si512(mix32(_mm512_add_epi32(index, lo), kRound1), hi), kRound2);
  const __m512 top = _mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8));
  return _mm512_mul_ps(_mm512_add_ps(top, _mm512_set1_ps(kHalfStep)), _mm512_set1_ps(kStep));
}

// ln x for normal x > 0, Cephes' logf (relative error ~1e-7): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// the exponent and mantissa by integer operations.
inline __m512 log16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)),
                                                 _mm512_set1_epi32(0x3f800000)));  // [1, 2)
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kSqrt2), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_epi32(e, high, e, _mm512_set1_epi32(1));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(f, f), n = _mm512_cvtepi32_ps(e);
  __m512 p = _mm512_set1_ps(kLogPoly[0]);
  for (int c = 1; c < 9; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kLogPoly[c]));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Hi), _mm512_add_ps(f, y));
}

// The winner of the row's race: the index of the largest p_i / E_i (the first, on ties), where the
// tokens with p_i <= floor race with p_i = 0 (dropped by earlier rounds of top-p).
int64_t row_race(const float* p, int64_t n, uint64_t key, float floor) {
  LaneArgmax argmax;
  const __m512 fl = _mm512_set1_ps(floor);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = tail_mask(n - i);
    const __m512 e = _mm512_sub_ps(_mm512_setzero_ps(), log16(uniform16(argmax.index(), key)));
    const __m512 v = _mm512_maskz_loadu_ps(valid, p + i);
    argmax.take(_mm512_div_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, fl, _CMP_GT_OQ), v), e), valid);
  }
  return argmax.first_max();
}

// The sum of the row's p_i above `chosen`, in 16 lanes, summed as the AVX2 path sums them.
float mass_above(const float* p, int64_t n, float chosen) {
  const __m512 c = _mm512_set1_ps(chosen);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), p + i);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, c, _CMP_GT_OQ), acc, v);
  }
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  return reduce_add8(_mm256_add_ps(high, _mm512_castps512_ps256(acc)));
}

// The row's most likely token (the first, on ties).
int64_t most_likely(const float* p, int64_t n) {
  LaneArgmax argmax;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = tail_mask(n - i);
    argmax.take(_mm512_maskz_loadu_ps(valid, p + i), valid);
  }
  return argmax.first_max();
}
#else  // the same operations in 8 native AVX2 lanes, so the same bits (SIMDe's 16-lane masked steps go
// lane by lane)
inline __m256i mix32(__m256i x, const uint32_t (&m)[2]) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(m[0])));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(m[1])));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline __m256 uniform8(__m256i index, uint64_t key) {
  const __m256i lo = _mm256_set1_epi32(static_cast<int32_t>(key)), hi = _mm256_set1_epi32(static_cast<int32_t>(key >> 32));
  const __m256i h = mix32(_mm256_xor_si256(mix32(_mm256_add_epi32(index, lo), kRound1), hi), kRound2);
  const __m256 top = _mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8));
  return _mm256_mul_ps(_mm256_add_ps(top, _mm256_set1_ps(kHalfStep)), _mm256_set1_ps(kStep));
}

inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                 _mm256_set1_epi32(0x3f800000)));  // [1, 2)
  const __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(kSqrt2), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), high);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(high));  // a high lane is all ones: -1
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f)), z = _mm256_mul_ps(f, f), n = _mm256_cvtepi32_ps(e);
  __m256 p = _mm256_set1_ps(kLogPoly[0]);
  for (int c = 1; c < 9; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kLogPoly[c]));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
  y = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Hi), _mm256_add_ps(f, y));
}

// The lanes past the row's end take part as -inf, which never wins.
int64_t row_race(const float* p, int64_t n, uint64_t key, float floor) {
  LaneArgmax8 argmax;
  const __m256 fl = _mm256_set1_ps(floor);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = _mm256_sub_ps(_mm256_setzero_ps(), log8(uniform8(argmax.index(), key)));
    const __m256 v = load8(p + i, n - i, 0.0f);
    const __m256 q = _mm256_div_ps(_mm256_and_ps(v, _mm256_cmp_ps(v, fl, _CMP_GT_OQ)), e);
    argmax.take(n - i >= 8 ? q : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), q, _mm256_castsi256_ps(tail_mask8(n - i))));
  }
  return argmax.first_max();
}

// In 16 lanes as two halves (a lane not above adds +0, as AVX-512's masked add leaves it): the same sum.
float mass_above(const float* p, int64_t n, float chosen) {
  const __m256 c = _mm256_set1_ps(chosen);
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 a = load8(p + i, n - i, 0.0f), b = load8(p + i + 8, n - i - 8, 0.0f);
    low = _mm256_add_ps(low, _mm256_and_ps(a, _mm256_cmp_ps(a, c, _CMP_GT_OQ)));
    high = _mm256_add_ps(high, _mm256_and_ps(b, _mm256_cmp_ps(b, c, _CMP_GT_OQ)));
  }
  return reduce_add8(_mm256_add_ps(high, low));
}

int64_t most_likely(const float* p, int64_t n) {
  LaneArgmax8 argmax;
  for (int64_t i = 0; i < n; i += 8) argmax.take(load8(p + i, n - i, -INFINITY));
  return argmax.first_max();
}
#endif

// Round r > 0 of a row's top-p draws races with this key (splitmix64 of the row's key and r).
uint64_t round_key(uint64_t key, int64_t round) {
  uint64_t z = key + static_cast<uint64_t>(round) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A row's token: its race's winner, or with top_p < 1 a draw from its nucleus by rejection, as
// token_choice._resample_outside_top_p does it op by op: a token is in the nucleus iff the mass of the
// tokens more likely than it is < top_p; a draw outside drops it and every less likely token, and the
// row races again (with its next round's key). A row left with nothing to draw, or still rejected after
// max_rounds draws (0: at once), takes its most likely token (in every nucleus).
int64_t row_choice(const float* p, int64_t n, uint64_t key, float top_p, int64_t max_rounds) {
  float floor = -1.0f;  // p >= 0: nothing dropped
  if (!(top_p < 1.0f)) return row_race(p, n, key, floor);
  for (int64_t round = 0; round < max_rounds; ++round) {
    const int64_t token = row_race(p, n, round == 0 ? key : round_key(key, round), floor);
    const float chosen = p[token];
    if (!(chosen > floor && chosen > 0.0f)) break;
    if (mass_above(p, n, chosen) < top_p) return token;
    floor = chosen;
  }
  return most_likely(p, n);
}

// probs [B, V] fp32 with dense rows (any scale: a row need not sum to 1, but top-p reads it as
// probabilities), keys [B] int64, top_p None or [B] float32 (1 where a row has none) -> [B] int64.
at::Tensor race_rows(const at::Tensor& probs, const at::Tensor& keys, const std::optional<at::Tensor>& top_p,
                     int64_t max_rounds) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1 && probs.size(1) > 0 &&
                  probs.size(1) <= INT32_MAX,
              "race_rows: probs must be [B, V] float32 with dense rows");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.size(0) == probs.size(0),
              "race_rows: keys must be [B] int64, one per row");
  TORCH_CHECK(!top_p || (top_p->dim() == 1 && top_p->scalar_type() == at::kFloat && top_p->is_contiguous() &&
                         top_p->size(0) == probs.size(0)),
              "race_rows: top_p must be [B] float32, one per row");
  TORCH_CHECK(max_rounds >= 0, "race_rows: max_rounds must be at least 0");
  const int64_t rows = probs.size(0), n = probs.size(1), stride = probs.stride(0);
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const float* tp = top_p ? top_p->data_ptr<float>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      o[r] = row_choice(p + r * stride, n, static_cast<uint64_t>(k[r]), tp ? tp[r] : 1.0f, max_rounds);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("race_rows(Tensor probs, Tensor keys, Tensor? top_p=None, int max_rounds=64) -> Tensor");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("race_rows", race_rows); }
