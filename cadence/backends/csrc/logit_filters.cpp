// The sampler's min-p and top-k filters on x86 CPUs (AVX-512; AVX2 in 8 native lanes), in place: each
// row keeps its logits at or above max + log(min_p) and at or above its k-th largest logit (ties with it
// kept, as vLLM keeps them), and the rest become -inf: the same tokens, bit for bit, as
// cadence/executor/token_choice.py's torch ops, which took 5.7 ms for 64 rows of 49,152 at top-k 50
// (topk 3.7, then a comparison and masked_fill over every logit, 2.0) on 2 AMD EPYC cores.
//
// Here a row is read once for its maximum (min-p only), once for its k-th largest (top_values.h), and
// once to mask it. NaN is never a candidate here, where torch's topk ranks it first: a row holding NaN
// may keep other tokens than the torch ops keep.
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "top_values.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using namespace cadence;

#if defined(__AVX512F__)
float row_max(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) best = _mm512_max_ps(best, _mm512_mask_loadu_ps(best, tail_mask(n - i), x + i));
  return _mm512_reduce_max_ps(best);
}

void mask_below(float* x, int64_t n, float threshold) {
  const __m512 t = _mm512_set1_ps(threshold), off = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(valid, x + i);
    _mm512_mask_storeu_ps(x + i, _mm512_mask_cmp_ps_mask(valid, v, t, _CMP_LT_OQ), off);
  }
}
#else  // the same choices in 8 native AVX2 lanes (SIMDe's 16-lane masked steps go lane by lane)
float row_max(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 8) best = _mm256_max_ps(best, load8(x + i, n - i, -INFINITY));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  return *std::max_element(lanes, lanes + 8);
}

void mask_below(float* x, int64_t n, float threshold) {
  const __m256 t = _mm256_set1_ps(threshold), off = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i lanes = _mm256_and_si256(tail_mask8(n - i), _mm256_castps_si256(_mm256_cmp_ps(
                                                                   load8(x + i, n - i, 0.0f), t, _CMP_LT_OQ)));
    _mm256_maskstore_ps(x + i, lanes, off);
  }
}
#endif

// One row: min-p's threshold (max + log_min_p, in float as torch adds them; -inf: off), then top-k's
// (k <= 0: off), the larger of the two kept from.
void filter_row(float* x, int64_t n, int64_t k, float log_min_p, std::vector<Scored>& buffer) {
  float threshold = -INFINITY;
  if (log_min_p != -INFINITY) threshold = row_max(x, n) + log_min_p;
  if (k > 0 && k < n) threshold = std::max(threshold, TopValues(x, n, k, buffer).kth());
  if (threshold != -INFINITY) mask_below(x, n, threshold);
}

// logits [B, V] fp32 with dense rows, filtered in place; top_k None or [B] int64 (0: none), log_min_p
// None or [B] fp32 (-inf: none).
void filter_rows(const at::Tensor& logits, const std::optional<at::Tensor>& top_k,
                 const std::optional<at::Tensor>& log_min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "filter_rows: logits must be [B, V] float32 with dense rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(!top_k || (top_k->dim() == 1 && top_k->scalar_type() == at::kLong && top_k->is_contiguous() &&
                         top_k->size(0) == rows),
              "filter_rows: top_k must be [B] int64, one per row");
  TORCH_CHECK(!log_min_p || (log_min_p->dim() == 1 && log_min_p->scalar_type() == at::kFloat &&
                             log_min_p->is_contiguous() && log_min_p->size(0) == rows),
              "filter_rows: log_min_p must be [B] float32, one per row");
  float* x = logits.data_ptr<float>();
  const int64_t* ks = top_k ? top_k->data_ptr<int64_t>() : nullptr;
  const float* lmp = log_min_p ? log_min_p->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Scored> buffer;
    for (int64_t r = begin; r < end; ++r) {
      filter_row(x + r * stride, n, ks ? ks[r] : 0, lmp ? lmp[r] : -INFINITY, buffer);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("filter_rows(Tensor(a!) logits, Tensor? top_k, Tensor? log_min_p) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("filter_rows", filter_rows); }
