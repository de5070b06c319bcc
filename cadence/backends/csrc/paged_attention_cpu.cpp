// Decode attention read straight from the paged KV cache on x86 CPUs (AVX-512).
//
// One task per (sequence, KV head): the query heads that share the KV head are scored against the
// sequence's keys block by block through its block-table row, softmaxed in fp32, and weighted into
// the values. Keys and values are read once, with the next block prefetched, instead of being
// gathered into a contiguous copy first (which writes and rereads the whole context every layer).
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch's float -> bfloat16 cast does (inputs here are finite).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// e^x for x <= 0 (scores minus their max), Cephes' expf polynomial: relative error ~1e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
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
void decode(const Shape& s, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens) {
  const int64_t num_seqs = q.size(0), num_kv_heads = k_cache.size(0), dim = s.chunks * 16;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lens, lens + num_seqs);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(s.group * dim), scores(s.group * longest), acc(s.group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, head = task % num_kv_heads, len = lens[seq];
      const int64_t row = (seq * num_kv_heads + head) * s.group * dim;  // q and out are [seq][head][g][dim]
      const __m512 scale = _mm512_set1_ps(s.scale);
      for (int64_t i = 0; i < s.group * dim; i += 16) _mm512_storeu_ps(&qf[i], _mm512_mul_ps(load16(q_ptr + row + i), scale));
      const int64_t* blocks = table + seq * s.max_blocks;
      score(s, qf.data(), k_ptr + head * s.head_stride, blocks, len, scores.data());
      for (int64_t g = 0; g < s.group; ++g) softmax(scores.data() + g * len, len);
      weigh(s, scores.data(), v_ptr + head * s.head_stride, blocks, len, acc.data());
      for (int64_t i = 0; i < s.group * dim; i += 16) store16(out_ptr + row + i, _mm512_loadu_ps(&acc[i]));
    }
  });
}

// out, q: [num_seqs, num_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim];
// block_table: [num_seqs, max_blocks] int64; seq_lens: [num_seqs] int64, each >= 1.
void paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_table and seq_lens must be int64");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256, "paged_decode: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode: query heads must be a multiple of KV heads");
  if (q.size(0) == 0) return;
  const Shape s{q.size(1) / k_cache.size(0), head_dim / 16, k_cache.size(2),
                k_cache.size(1) * k_cache.size(2) * head_dim, block_table.size(1), static_cast<float>(scale)};
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  if (q.scalar_type() == at::kBFloat16) {
    decode<at::BFloat16>(s, out, q, k_cache, v_cache, table, lens);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode: bfloat16 or float32 only");
    decode<float>(s, out, q, k_cache, v_cache, table, lens);
  }
}

}  // namespace

TORCH_LIBRARY(cadence_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("paged_decode", paged_decode); }
