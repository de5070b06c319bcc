// The k largest values of each row with their indices (torch.topk(x, k, dim=-1), sorted, a lower index
// first among equal values), for the logprobs' top tokens (cadence/executor/token_choice.py:
// gather_logprobs). torch's topk took 3.1 ms for 64 rows of 49,152 even at k = 1 on 2 AMD EPYC cores,
// and prompt logprobs ask it for every prompt position; here one pass per row selects them
// (top_values.h). Past a row's values above -inf, the rest are its first -inf (or NaN) entries.
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "top_values.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using namespace cadence;

// x [B, V] fp32 with dense rows, 0 < k <= V -> (values [B, k] fp32, indices [B, k] int64).
std::tuple<at::Tensor, at::Tensor> top_k_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0 &&
                  x.size(1) <= INT32_MAX,
              "top_k_rows: x must be [B, V] float32 with dense rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(k > 0 && k <= n, "top_k_rows: k must be in [1, ", n, "]");
  at::Tensor values = at::empty({rows, k}, x.options()), indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  float* vals = values.data_ptr<float>();
  int64_t* ids = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Scored> buffer, top(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * stride;
      int64_t found = TopValues(row, n, k, buffer).sorted(top.data());
      for (int64_t i = 0; i < n && found < k; ++i) {  // a row with fewer than k values above -inf
        if (!(row[i] > -INFINITY)) top[found++] = Scored{row[i], static_cast<int32_t>(i)};
      }
      for (int64_t j = 0; j < k; ++j) {
        vals[r * k + j] = top[j].value;
        ids[r * k + j] = top[j].index;
      }
    }
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) { m.def("top_k_rows(Tensor x, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("top_k_rows", top_k_rows); }
