// A row's k largest logits, with their token ids, selected in one pass (logit_filters.cpp: top-k's
// threshold; top_k_rows.cpp: the logprobs' top tokens). Values above a floor are collected as
// candidates, and whenever `kCompactAt` (or 2k) have gathered, std::nth_element keeps the k first and
// the floor rises to the k-th: past the first few hundred logits few values pass, and the pass is a
// compare per vector. Order: larger value first, then lower index (so a value equal to the floor,
// coming later in the row, ranks after it and need not enter). NaN and -inf never enter.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace cadence {

struct Scored {
  float value;
  int32_t index;
};

inline bool ranks_before(const Scored& a, const Scored& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

class TopValues {
 public:
  static constexpr int64_t kCompactAt = 512;

  // x [0, n) read once; `buffer` is working memory kept between rows.
  TopValues(const float* x, int64_t n, int64_t k, std::vector<Scored>& buffer)
      : k_(k), limit_(std::max(kCompactAt, 2 * k)), buffer_(buffer) {
    buffer_.resize(limit_ + 16);  // room for one more vector's candidates past the limit
    scan(x, n);
  }

  // The k-th largest value (with multiplicity), or -inf if fewer than k values are above -inf.
  float kth() {
    if (size_ < k_) return -INFINITY;
    compact();
    return floor_;
  }

  // The first min(k, found) of them, in order; how many.
  int64_t sorted(Scored* out) {
    if (size_ > k_) compact();
    std::sort(buffer_.begin(), buffer_.begin() + size_, ranks_before);
    std::copy(buffer_.begin(), buffer_.begin() + size_, out);
    return size_;
  }

 private:
  void add(float value, int64_t index) { buffer_[size_++] = Scored{value, static_cast<int32_t>(index)}; }

  void settle() {
    if (size_ >= limit_) compact();
  }

  void compact() {
    std::nth_element(buffer_.begin(), buffer_.begin() + (k_ - 1), buffer_.begin() + size_, ranks_before);
    floor_ = buffer_[k_ - 1].value;
    size_ = k_;
  }

#if defined(__AVX512F__)
  void scan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 valid = tail_mask(n - i);
      const __m512 v = _mm512_maskz_loadu_ps(valid, x + i);
      unsigned above = _mm512_mask_cmp_ps_mask(valid, v, _mm512_set1_ps(floor_), _CMP_GT_OQ);
      if (!above) continue;
      for (; above; above &= above - 1) add(x[i + __builtin_ctz(above)], i + __builtin_ctz(above));
      settle();
    }
  }
#else  // 8 native AVX2 lanes (SIMDe's 16-lane masked compare goes lane by lane)
  void scan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = load8(x + i, n - i, -INFINITY);
      int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor_), _CMP_GT_OQ));
      if (!above) continue;
      for (; above; above &= above - 1) add(x[i + __builtin_ctz(above)], i + __builtin_ctz(above));
      settle();
    }
  }
#endif

  const int64_t k_, limit_;
  std::vector<Scored>& buffer_;
  int64_t size_ = 0;
  float floor_ = -INFINITY;
};

}  // namespace cadence
