// Attention read straight from the paged KV cache on x86 CPUs (AVX-512), and the store before it.
//
// Every query row (a decode's one token, or any token of a prefill) attends to the first seq_len
// tokens of its block-table row: its request's cached context up to and including its own position,
// so causal masking is just each row's length. One task per (row, KV head): the query heads that
// share the KV head are scored against the keys block by block, softmaxed in fp32, and weighted into
// the values. Keys and values are read in place, with the next block prefetched, instead of being
// gathered into a contiguous copy first (which writes and rereads the whole context every layer).
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cadence;

template <typename T>
inline void prefetch_block(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Sizes of one call, fixed across its tasks.
struct Shape {
  int64_t group;        // query heads per KV head
  int64_t chunks;       // head_dim / 16
  int64_t block_size;
  int64_t head_stride;  // elements between KV heads in the cache: num_blocks * block_size * head_dim
  int64_t max_blocks;   // block-table row length
  int64_t q_stride;     // elements between q's rows (tokens); heads and dims are dense
  float scale;
};

// Scores of `group` query rows (fp32, pre-scaled, [group][head_dim]) against `seq_len` keys.
template <typename T>
void score(const Shape& s, const float* q, const T* keys, const int64_t* blocks, int64_t seq_len,
           float* scores /* [group][seq_len] */) {
  const int64_t dim = s.chunks * 16, block_elems = s.block_size * dim;
  __m512 k[16];
  for (int64_t first = 0, b = 0; first < seq_len; first += s.block_size, ++b) {
    const T* block = keys + blocks[b] * block_elems;
    if (first + s.block_size < seq_len) prefetch_block(keys + blocks[b + 1] * block_elems, block_elems * sizeof(T));
    const int64_t n = std::min(s.block_size, seq_len - first);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < s.chunks; ++c) k[c] = load16(block + t * dim + c * 16);
      for (int64_t g = 0; g < s.group; ++g) {
        __m512 acc = _mm512_mul_ps(k[0], _mm512_loadu_ps(q + g * dim));
        for (int64_t c = 1; c < s.chunks; ++c) acc = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(q + g * dim + c * 16), acc);
        scores[g * seq_len + first + t] = _mm512_reduce_add_ps(acc);
      }
    }
  }
}

// Softmax of one row in place; returns nothing, the row then sums to 1.
void softmax(float* row, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, row + full));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), m));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), m));
    _mm512_mask_storeu_ps(row + full, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (int64_t i = 0; i < full; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
  if (tail) _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), inv));
}

// out[g] = sum_t probs[g][t] * v[t] for the `group` rows, accumulated in fp32.
template <typename T>
void weigh(const Shape& s, const float* probs, const T* values, const int64_t* blocks, int64_t seq_len,
           float* acc /* [group][head_dim] */) {
  const int64_t dim = s.chunks * 16, block_elems = s.block_size * dim;
  std::fill(acc, acc + s.group * dim, 0.0f);
  __m512 v[16];
  for (int64_t first = 0, b = 0; first < seq_len; first += s.block_size, ++b) {
    const T* block = values + blocks[b] * block_elems;
    if (first + s.block_size < seq_len) prefetch_block(values + blocks[b + 1] * block_elems, block_elems * sizeof(T));
    const int64_t n = std::min(s.block_size, seq_len - first);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < s.chunks; ++c) v[c] = load16(block + t * dim + c * 16);
      for (int64_t g = 0; g < s.group; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * seq_len + first + t]);
        float* row = acc + g * dim;
        for (int64_t c = 0; c < s.chunks; ++c) _mm512_storeu_ps(row + c * 16, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(row + c * 16)));
      }
    }
  }
}

template <typename T>
void attend(const Shape& s, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens) {
  const int64_t num_rows = q.size(0), num_kv_heads = k_cache.size(0), dim = s.chunks * 16;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lens, lens + num_rows);
  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(s.group * dim), scores(s.group * longest), acc(s.group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, head = task % num_kv_heads, len = lens[r];
      const int64_t out_at = (r * num_kv_heads + head) * s.group * dim;  // out is [r][head][g][dim]
      const T* q_row = q_ptr + r * s.q_stride + head * s.group * dim;
      const __m512 scale = _mm512_set1_ps(s.scale);
      for (int64_t i = 0; i < s.group * dim; i += 16) _mm512_storeu_ps(&qf[i], _mm512_mul_ps(load16(q_row + i), scale));
      const int64_t* blocks = table + r * s.max_blocks;
      score(s, qf.data(), k_ptr + head * s.head_stride, blocks, len, scores.data());
      for (int64_t g = 0; g < s.group; ++g) softmax(scores.data() + g * len, len);
      weigh(s, scores.data(), v_ptr + head * s.head_stride, blocks, len, acc.data());
      for (int64_t i = 0; i < s.group * dim; i += 16) store16(out_ptr + out_at + i, _mm512_loadu_ps(&acc[i]));
    }
  });
}

// out, q: [rows, num_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim];
// block_table: [rows, max_blocks] int64; seq_lens: [rows] int64, each >= 1.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: out and the caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q's heads and dims must be dense");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention: block_table and seq_lens must be int64");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256, "paged_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_attention: query heads must be a multiple of KV heads");
  if (q.size(0) == 0) return;
  const Shape s{q.size(1) / k_cache.size(0), head_dim / 16, k_cache.size(2),
                k_cache.size(1) * k_cache.size(2) * head_dim, block_table.size(1), q.stride(0),
                static_cast<float>(scale)};
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  CADENCE_DISPATCH_FLOAT(q.scalar_type(), "paged_attention", [&] { attend<scalar_t>(s, out, q, k_cache, v_cache, table, lens); });
}

// k_cache[h, slot] = k[t, h] and v_cache[h, slot] = v[t, h] for slot = slot_mapping[t]: the step's new
// keys and values written into the head-major caches [num_kv_heads, num_blocks * block_size, head_dim]
// (viewed flat over blocks). k and v are [tokens, num_kv_heads, head_dim] with dense heads.
void store_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "store_kv: the caches must be contiguous and alike");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
              k.sizes() == v.sizes() && k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(),
              "store_kv: k and v must be [tokens, heads, head_dim] with dense heads, in the caches' dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), "store_kv: int64 slot per token");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t head_stride = k_cache.numel() / k_cache.size(0), bytes = dim * k.element_size();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t size = k.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (h * head_stride + slot[t] * dim) * size;
        std::memcpy(kc + dst, kp + (t * k.stride(0) + h * dim) * size, bytes);
        std::memcpy(vc + dst, vp + (t * v.stride(0) + h * dim) * size, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("store_kv", store_kv);
}
