// The per-token ops of a Llama decoder layer on x86 CPUs (AVX-512): RMSNorm (with the residual add
// before it), RoPE and SiLU-and-multiply, each one pass over its rows instead of torch's op-by-op
// chain (RMSNorm alone is seven ops with four full-size temporaries). Intermediates are rounded to
// the storage type wherever Hugging Face's code stores one, so bfloat16 results match it op for op,
// up to the summation order of RMSNorm's mean of squares. Built on first use by
// cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"
#if !defined(__AVX512F__)
#include "avx2.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using namespace cadence;

// Rows per task: enough elements that a thread's share outweighs waking it.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

#if defined(__AVX512F__)
// rsqrt(mean(x^2) + eps) of a row of n, in fp32.
template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, tail_mask(n - i));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), all in fp32 until the casts (LlamaRMSNorm).
template <typename T>
void norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  const __m512 inv = _mm512_set1_ps(inverse_rms(x, n, eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 normed = round_to<T>(_mm512_mul_ps(load16(x + i, m), inv));
    store16(out + i, _mm512_mul_ps(load16(weight + i, m), normed), m);
  }
}

// out = T(x * rsqrt(mean(x^2) + eps) * scale), an fp32 scale, one cast at the end (Gemma3RMSNorm).
template <typename T>
void scaled_norm_row(T* out, const T* x, const float* scale, int64_t n, float eps) {
  const __m512 inv = _mm512_set1_ps(inverse_rms(x, n, eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i, m), inv), load16(scale + i, m)), m);
  }
}

// residual = T(x + residual) over one row.
template <typename T>
void add_row(T* residual, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16(residual + i, _mm512_add_ps(load16(x + i, m), load16(residual + i, m)), m);
  }
}
#else  // the same rows in 8 native AVX2 lanes (lane for lane the same operations, the squares summed
// in the two halves of the 16-lane sums and reduced in its order: the same bits); over SIMDe's 16
// lanes silu_and_mul, alike, ran 2.4-3.5x slower than torch's ops
template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 a = avx2::load_upto8(x + i, std::min<int64_t>(8, n - i));
    lo = _mm256_fmadd_ps(a, a, lo);
    const __m256 b = n - i > 8 ? avx2::load_upto8(x + i + 8, std::min<int64_t>(8, n - i - 8)) : _mm256_setzero_ps();
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  return 1.0f / std::sqrt(reduce_add8x2(lo, hi) / static_cast<float>(n) + eps);
}

template <typename T>
void norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  const __m256 inv = _mm256_set1_ps(inverse_rms(x, n, eps));
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    const __m256 normed = round_to8<T>(_mm256_mul_ps(avx2::load_upto8(x + i, m), inv));
    avx2::store_upto8(out + i, _mm256_mul_ps(avx2::load_upto8(weight + i, m), normed), m);
  }
}

template <typename T>
void scaled_norm_row(T* out, const T* x, const float* scale, int64_t n, float eps) {
  const __m256 inv = _mm256_set1_ps(inverse_rms(x, n, eps));
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    const __m256 normed = _mm256_mul_ps(avx2::load_upto8(x + i, m), inv);
    avx2::store_upto8(out + i, _mm256_mul_ps(normed, avx2::load_upto8(scale + i, m)), m);
  }
}

template <typename T>
void add_row(T* residual, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    avx2::store_upto8(residual + i, _mm256_add_ps(avx2::load_upto8(x + i, m), avx2::load_upto8(residual + i, m)), m);
  }
}
#endif

void check_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, what, ": expected rows of ", width,
              " dense elements");
}

// out = RMSNorm(x) with `weight`; x and out are [tokens, hidden].
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, n, "rms_norm x");
  check_rows(out, n, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be dense, of x's width and dtype");
  CADENCE_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(o + r * out.stride(0), in + r * x.stride(0), w, n, static_cast<float>(eps));
    });
  });
}

// out = T(x * rsqrt(mean(x^2) + eps) * scale) with an fp32 scale, cast once at the end: Gemma's RMSNorm
// (Gemma3RMSNorm, whose scale is 1 + weight). x and out are [tokens, n].
void scaled_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, n, "scaled_rms_norm x");
  check_rows(out, n, "scaled_rms_norm out");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == n && scale.scalar_type() == at::kFloat &&
              out.scalar_type() == x.scalar_type(), "scaled_rms_norm: scale must be dense float32 of x's width");
  CADENCE_DISPATCH_FLOAT(x.scalar_type(), "scaled_rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const float* w = scale.data_ptr<float>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scaled_norm_row(o + r * out.stride(0), in + r * x.stride(0), w, n, static_cast<float>(eps));
      }
    });
  });
}

// residual = T(x + residual); out = RMSNorm(residual): the add that closes one sub-layer fused with
// the norm that opens the next.
void add_rms_norm(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                  double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, n, "add_rms_norm x");
  check_rows(out, n, "add_rms_norm out");
  check_rows(residual, n, "add_rms_norm residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && residual.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight and residual must match x");
  CADENCE_DISPATCH_FLOAT(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res_row = res + r * residual.stride(0);
        add_row(res_row, in + r * x.stride(0), n);
        norm_row(o + r * out.stride(0), res_row, w, n, static_cast<float>(eps));
      }
    });
  });
}

// out[i] = T(silu(gate[i])) * gate[n + i] over one row.
#if defined(__AVX512F__)
template <typename T>
void silu_and_mul_row(const T* gate, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 silu = round_to<T>(silu16(load16(gate + i, m)));
    store16(out + i, _mm512_mul_ps(silu, load16(gate + n + i, m)), m);
  }
}
#else  // 8 lanes of native AVX2 (the same operations lane for lane, so the same bits): SIMDe's 16-lane
// loop ran 2.4-3.5x slower than torch's F.silu(gate) * up (benchmarks/cpu_kernels.py)
template <typename T>
void silu_and_mul_row(const T* gate, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    const __m256 silu = round_to8<T>(silu8(avx2::load_upto8(gate + i, m)));
    avx2::store_upto8(out + i, _mm256_mul_ps(silu, avx2::load_upto8(gate + n + i, m)), m);
  }
}
#endif

// out = T(silu(gate)) * up, where gate_up holds [gate | up] per row (the fused gate/up projection).
void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  check_rows(gate_up, 2 * n, "silu_and_mul gate_up");
  check_rows(out, n, "silu_and_mul out");
  CADENCE_DISPATCH_FLOAT(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(in + r * gate_up.stride(0), o + r * out.stride(0), n);
    });
  });
}

// One head of `2 * half` values rotated in place by the cos and sin rows c and s: x * c + rotate_half(x) * s,
// each product rounded to T as Hugging Face's op-by-op code stores it.
#if defined(__AVX512F__)
template <typename T>
void rotate_head(T* head, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 x1 = load16(head + i, m), x2 = load16(head + half + i, m);
    const __m512 first = _mm512_sub_ps(round_to<T>(_mm512_mul_ps(x1, load16(c + i, m))),
                                       round_to<T>(_mm512_mul_ps(x2, load16(s + i, m))));
    const __m512 second = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, load16(c + half + i, m))),
                                        round_to<T>(_mm512_mul_ps(x1, load16(s + half + i, m))));
    store16(head + i, first, m);
    store16(head + half + i, second, m);
  }
}
#else  // 8 native AVX2 lanes, lane for lane the same operations (the same bits)
template <typename T>
void rotate_head(T* head, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t m = std::min<int64_t>(8, half - i);
    const __m256 x1 = avx2::load_upto8(head + i, m), x2 = avx2::load_upto8(head + half + i, m);
    const __m256 first = _mm256_sub_ps(round_to8<T>(_mm256_mul_ps(x1, avx2::load_upto8(c + i, m))),
                                       round_to8<T>(_mm256_mul_ps(x2, avx2::load_upto8(s + i, m))));
    const __m256 second = _mm256_add_ps(round_to8<T>(_mm256_mul_ps(x2, avx2::load_upto8(c + half + i, m))),
                                        round_to8<T>(_mm256_mul_ps(x1, avx2::load_upto8(s + half + i, m))));
    avx2::store_upto8(head + i, first, m);
    avx2::store_upto8(head + half + i, second, m);
  }
}
#endif

// In place on the first `num_heads` heads of each row of x ([tokens, >= num_heads * head_dim]):
// x * cos + rotate_half(x) * sin at each token's position, as Hugging Face's apply_rotary_pos_emb.
// cos and sin are [positions, head_dim] tables in x's dtype; positions must lie inside them.
void rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t head_dim) {
  const int64_t rows = x.size(0), half = head_dim / 2;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rotary_embedding: x must be [tokens, >= num_heads * head_dim] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos and sin must be dense [positions, head_dim] tables of x's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == rows, "rotary_embedding: int64 positions per row");
  const at::Tensor pos = positions.contiguous();
  CADENCE_DISPATCH_FLOAT(x.scalar_type(), "rotary_embedding", [&] {
    scalar_t* data = x.data_ptr<scalar_t>();
    const scalar_t* cos_table = cos.data_ptr<scalar_t>();
    const scalar_t* sin_table = sin.data_ptr<scalar_t>();
    const int64_t* p = pos.data_ptr<int64_t>();
    at::parallel_for(0, rows, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* c = cos_table + p[r] * head_dim;
        const scalar_t* s = sin_table + p[r] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) rotate_head(data + r * x.stride(0) + h * head_dim, c, s, half);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("scaled_rms_norm(Tensor(a!) out, Tensor x, Tensor scale, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("scaled_rms_norm", scaled_rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_embedding", rotary_embedding);
}
