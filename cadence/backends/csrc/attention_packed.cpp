// Paged attention over keys and values packed as bf16 pairs (bf16 caches, head_dim a multiple of 32):
// prefill tiles and decodes on the AMX tile unit, and where the CPU has no tile unit but has
// AVX512-BF16 (AMD Zen 4 and later), prefill tiles by VDPBF16PS (dot_score, dot_weigh: the same
// packing, exponentials and sums, each tile step a register loop). Decodes: attend_decode, below the
// prefill's steps.
//
// The fp32 tile path (paged_attention.cpp: attend_tile) took one 2,048-token prompt's attention in
// 31 ms a layer on 2 Sapphire Rapids-class cores (SmolLM2: 9 query heads over 3 KV heads), against
// 8.7 ms for torch's flash attention, which runs on tiles; under load the long prompts' first tokens
// were cadence's TTFT p99. Here, for each query head of the tile's KV head in turn:
// - scores S = Q K^T by TDPBF16PS: the A tile is the head's 16 rows by 32 dims, a B tile 16 dim pairs
//   by 16 keys (each key's dims read as 32-bit pairs and transposed); each row's maximum over its keys
//   is taken as the tiles are stored, from L1 (a pass of its own, from L2, was two fifths of the
//   exponentials' time: 8 prompts' 64-token chunks over 1,088 keys took 52-55 ms for 30 layers
//   against 57-62 with it; the same bits);
// - exponentials of the scaled scores less their row's maximum, in fp32, summed, and rounded to bf16
//   as P, zero outside each row's keys (its causal end and its sliding window);
// - O = P V by TDPBF16PS: the A tile is P's 16 rows by 32 keys, a B tile 16 key pairs by 16 dims (two
//   value rows interleaved); the rows are divided by their sums at the end.
// Keys are walked in 32-key chunks aligned to the request's first key, whatever the tile, so a row's
// sums are the same sequence of tile steps in any batch. A call takes up to 32 rows: two row tiles,
// which share each key and value tile loaded (those come from L2 past a few hundred keys, and the
// products waited on them: 32 prompts' 64-token chunks over 1,088 cached keys took 175-179 ms for 30
// layers against 206-212 with one row tile a call; the same bits). P in bf16 is what flash attention
// on tiles does too; the fp32 path keeps probabilities in fp32 (the two differ by about 2^-9 relative).
// attend_shared_prefixes (below) runs the same steps for decodes that share their first blocks: their
// queries together over the shared keys, unnormalized, for paged_attention.cpp to merge with each
// decode's own keys (cascade attention).
// On 2 AMD EPYC cores with AVX512-BF16 (2026-12-07) the VDPBF16PS steps took a 2,048-token prompt's
// attention in 15.5-17.9 ms a layer against 39-41 on the fp32 path, 32 prompts' 64-token chunks over
// 1,088 cached keys in 19-20 ms against 46-52, and 32 decodes sharing 1,024 of their 1,150 keys in
// 16.8-17.1 ms a step (30 layers) against 29.5-29.9 (benchmarks/cpu_kernels.py); there each
// VDPBF16PS step is at the core's rate, and packing is about a sixth of the time.
// Built with the other kernels by cadence/backends/cpu_kernels.py; not at all in their AVX2 build.

#include "paged_attention.h"

#if defined(__AVX512F__)

#include "amx.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

namespace cadence {

namespace {

constexpr int64_t kChunk = 32;  // keys per step: a P tile's width, two score tiles

int64_t round_down(int64_t n) { return n / kChunk * kChunk; }

int64_t round_up(int64_t n) { return (n + kChunk - 1) / kChunk * kChunk; }

// 2^t for t <= 0, to about 4e-5 relative: 2^f, f = t - round(t) in [-0.5, 0.5], by its Taylor
// polynomial of degree 4, scaled by 2^round(t). Its results are rounded to bf16 (2^-9) before use, so
// exp16's precision would be spent for nothing, and the exponentials were half of a prefill tile's time.
__m512 exp2_bf16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // n far below -126 gives 0
}

// Lanes 2j and 2j + 1 of the result: lane j of the lower and of the upper 256 bits (two rows interleaved).
__m512i interleave_index() {
  alignas(64) int16_t index[32];
  for (int j = 0; j < 16; ++j) {
    index[2 * j] = static_cast<int16_t>(j);
    index[2 * j + 1] = static_cast<int16_t>(16 + j);
  }
  return _mm512_load_si512(index);
}

// Dims [32c, 32c + 32) of 16 rows (nullptr: a row of zeros) as a B tile, 16 dim pairs x 16 rows: each
// row's dims read as 32-bit pairs and transposed, which moves 32-bit lanes only, so the bf16 pairs'
// bits are kept.
void pair_tile(const uint16_t* const (&rows)[16], int64_t c, uint32_t* tile) {
  __m512 r[16];
  for (int t = 0; t < 16; ++t) r[t] = rows[t] ? _mm512_loadu_ps(rows[t] + 32 * c) : _mm512_setzero_ps();
  transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + i * 16, r[i]);
}

// row[0:dim] times 1 / sum, `sum` being its exponentials' sum: a row's weighted values, normalized.
void normalize(float* row, int64_t dim, float sum) {
  const __m512 v = _mm512_set1_ps(1.0f / sum);
  for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), v));
}

// Which of the keys [k, k + 16) a row that sees keys [lo, hi) sees.
__mmask16 keys_in(int64_t lo, int64_t hi, int64_t k) {
  if (k >= hi || k + 16 <= lo) return 0;
  return static_cast<__mmask16>(tail_mask(hi - k) & ~tail_mask(std::max<int64_t>(0, lo - k)));
}

// A row's scores x[k, k + 16), just written: those it sees (keys [lo, hi)) soft-capped in place
// (Gemma 2: cap * tanh(s / cap) of each scaled score), and `top`, its running maximum, over them. Taken
// while the scores are in L1, so that the exponentials need not read a row twice.
__m512 take(const Shape& s, float* x, int64_t k, int64_t lo, int64_t hi, __m512 top) {
  if (s.soft_cap > 0) {
    for (int64_t j = std::max(k, lo); j < std::min(k + 16, hi); ++j) {
      x[j] = s.soft_cap * std::tanh(x[j] * s.scale / s.soft_cap);
    }
  }
  return _mm512_max_ps(top, _mm512_mask_loadu_ps(top, keys_in(lo, hi, k), x + k));
}

// take() of rows [0, rows) of scores (`stride` floats apart) over the 32 keys from c.
void take_chunk(const Shape& s, float* scores, int64_t stride, int64_t c, int64_t rows, const int64_t* lo,
                const int64_t* hi, __m512* top) {
  for (int64_t i = 0; i < rows; ++i) {
    float* x = scores + i * stride;
    if (s.soft_cap == 0 && lo[i] <= c && c + kChunk <= hi[i]) {  // the row sees all 32
      top[i] = _mm512_max_ps(top[i], _mm512_max_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(x + c + 16)));
    } else {
      top[i] = take(s, x, c + 16, lo[i], hi[i], take(s, x, c, lo[i], hi[i], top[i]));
    }
  }
}

}  // namespace

PackedAttention::PackedAttention(const Shape& s, int64_t num_kv_heads)
    : s_(s), amx_(use_amx()), packed_(num_kv_heads), q_(kMaxRows * s.chunks * 16) {}

PackedAttention::~PackedAttention() {
  if (configured_) release_tiles();
}

void PackedAttention::attend(const at::BFloat16* q, int64_t rows, int64_t first_len, int64_t request, int64_t head,
                          const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks, float* out) {
  const int64_t dim = s_.chunks * 16, last_len = first_len + rows - 1;
  const int64_t first = round_down(s_.begin(first_len)), width = round_up(last_len) - first;
  Packed& p = packed_[head];
  ensure(p, request, first, last_len, keys, values, blocks);
  prepare(width);
  for (int64_t g = 0; g < s_.group; ++g) {
    // The head's rows as the A tiles; rows past the tile's keep what they held: a row of sums depends
    // on its own row alone, and those rows' outputs are never stored.
    for (int64_t i = 0; i < rows; ++i) std::memcpy(q_.data() + i * dim, q + i * s_.q_stride + g * dim, dim * 2);
    int64_t lo[kMaxRows], hi[kMaxRows];  // each row's keys, from the tile's first
    for (int64_t i = 0; i < rows; ++i) {
      lo[i] = s_.begin(first_len + i) - first;
      hi[i] = first_len + i - first;
    }
    score(p.keys.data() + (first - p.base) * dim / 2, width, rows, lo, hi);
    float sums[kMaxRows];
    for (int64_t i = 0; i < rows; ++i) sums[i] = exponentials(i, lo[i], hi[i], width).sum;
    float* head_out = out + g * dim;
    weigh(p.values.data() + (first - p.base) * dim, width, rows, head_out, s_.group * dim);
    for (int64_t i = 0; i < rows; ++i) normalize(head_out + i * s_.group * dim, dim, sums[i]);
  }
}

void PackedAttention::attend_shared(const at::BFloat16* const* queries, int64_t n, int64_t shared, int64_t id,
                                 int64_t head, const at::BFloat16* keys, const at::BFloat16* values,
                                 const int64_t* blocks, float* const* outs, Normalizer* norms) {
  const int64_t dim = s_.chunks * 16, width = round_up(shared);
  Packed& p = packed_[head];
  ensure(p, id, 0, shared, keys, values, blocks);
  prepare(width);
  sums_.resize(kAmxRows * dim);
  for (int64_t i = 0; i < n; ++i) std::memcpy(q_.data() + i * dim, queries[i], dim * 2);
  int64_t lo[kAmxRows], hi[kAmxRows];
  std::fill_n(lo, n, 0);
  std::fill_n(hi, n, shared);
  score(p.keys.data(), width, n, lo, hi);
  for (int64_t i = 0; i < n; ++i) norms[i] = exponentials(i, 0, shared, width);
  weigh(p.values.data(), width, n, sums_.data(), dim);
  for (int64_t i = 0; i < n; ++i) std::memcpy(outs[i], sums_.data() + i * dim, dim * sizeof(float));
}

// The tiles configured (at this thread's first tile: most calls' threads never get one), and the
// scores and exponentials sized for a tile over `width` keys.
void PackedAttention::prepare(int64_t width) {
  if (amx_ && !configured_) {
    configure_tiles();
    configured_ = true;
  }
  // Rows one 32-key chunk longer than the keys: a power-of-two row length put the 16 rows of a tile
  // in one L1 set (the scores took twice the time).
  stride_ = width + kChunk;
  scores_.resize(kMaxRows * stride_);
  probs_.resize(kMaxRows * stride_);
}

// Keys and values [first, end) of the request packed in p, from what it holds already where it can.
void PackedAttention::ensure(Packed& p, int64_t request, int64_t first, int64_t end, const at::BFloat16* keys,
                          const at::BFloat16* values, const int64_t* blocks) const {
  if (p.request != request || first < p.base) {
    // Another request keeps the whole chunks of keys it reads from the same blocks (a prompt prefix
    // cached for both), within the same base: 8 prompts' chunks over a 1,024-token system prompt
    // each packed it again.
    int64_t same = 0;
    if (p.request >= 0 && first == p.base) {
      const int64_t packed_blocks = (p.loaded + s_.block_size - 1) / s_.block_size;
      while (same < packed_blocks && p.blocks[same] == blocks[same]) ++same;
    }
    p.request = request;
    p.blocks = blocks;
    p.loaded = std::max(first, round_down(std::min(p.loaded, same * s_.block_size)));
    p.base = first;
  }
  if (end <= p.loaded) return;
  const int64_t from = round_down(p.loaded), to = round_up(end), dim = s_.chunks * 16;
  p.keys.resize((to - p.base) * dim / 2);
  p.values.resize((to - p.base) * dim);
  for (int64_t k = from; k < to; k += kChunk) {
    pack_keys(p, k, end, keys, blocks);
    pack_values(p, k, end, values, blocks);
  }
  p.loaded = end;
}

// Keys [first, first + 32) as two B tiles' worth for each 32 dims: 16 dim pairs x 16 keys. Keys from
// `end` on are zeros.
void PackedAttention::pack_keys(Packed& p, int64_t first, int64_t end, const at::BFloat16* keys,
                             const int64_t* blocks) const {
  const int64_t dim = s_.chunks * 16;
  for (int64_t half = first; half < first + kChunk; half += 16) {
    uint32_t* chunk = p.keys.data() + (half - p.base) * dim / 2;
    const uint16_t* rows[16];
    for (int64_t t = 0; t < 16; ++t) rows[t] = half + t < end ? key_row(keys, blocks, half + t, s_) : nullptr;
    for (int64_t c = 0; c < dim / 32; ++c) pair_tile(rows, c, chunk + 16 * c * 16);
  }
}

// Values [first, first + 32) as a B tile for each 16 dims: 16 key pairs x 16 dims, the pair's two
// values side by side. Values from `end` on are zeros (their probabilities are too, but 0 x NaN is not).
void PackedAttention::pack_values(Packed& p, int64_t first, int64_t end, const at::BFloat16* values,
                               const int64_t* blocks) const {
  static const __m512i kInterleave = interleave_index();
  const int64_t dim = s_.chunks * 16;
  uint16_t* chunk = p.values.data() + (first - p.base) * dim;
  for (int64_t pair = 0; pair < kChunk / 2; ++pair) {
    const int64_t a = first + 2 * pair, b = a + 1;
    const uint16_t* va = a < end ? key_row(values, blocks, a, s_) : nullptr;
    const uint16_t* vb = b < end ? key_row(values, blocks, b, s_) : nullptr;
    for (int64_t g = 0; g < dim / 16; ++g) {
      const __m256i x = va ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 16 * g)) : _mm256_setzero_si256();
      const __m256i y = vb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 16 * g)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
      _mm512_storeu_si512(chunk + (16 * g + pair) * 32, _mm512_permutexvar_epi16(kInterleave, both));
    }
  }
}

// scores_ [kMaxRows][stride_] = q_ K^T over the packed keys from the tile's first; of rows [0, rows),
// each seeing keys [lo[i], hi[i]) from there, tops_ their maxima (see take). Past 16 rows the second
// row tile takes each key tile loaded as well: the products waited on those loads (from L2: 1,088
// keys are 139 KB a KV head), not on each other. A row's sums are the same steps either way.
void PackedAttention::score(const uint32_t* keys, int64_t width, int64_t rows, const int64_t* lo, const int64_t* hi) {
  if (!amx_) return dot_score(keys, width, rows, lo, hi);
  const int64_t dim = s_.chunks * 16, half = 16 * dim / 2;  // one 16-key half of a chunk
  const bool two = rows > kAmxRows;
  const uint16_t* lower_q = q_.data() + kAmxRows * dim;
  float* lower = scores_.data() + kAmxRows * stride_;  // the second row tile's scores
  __m512 top[kMaxRows];
  for (int64_t i = 0; i < rows; ++i) top[i] = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < width; c += kChunk) {
    const uint32_t* k = keys + c * dim / 2;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t d = 0; d < dim / 32; ++d) {
      _tile_loadd(4, q_.data() + 32 * d, dim * 2);
      _tile_loadd(6, k + 256 * d, kAmxRowBytes);
      _tile_loadd(7, k + half + 256 * d, kAmxRowBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, lower_q + 32 * d, dim * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, scores_.data() + c, stride_ * 4);
    _tile_stored(1, scores_.data() + c + 16, stride_ * 4);
    if (two) {
      _tile_stored(2, lower + c, stride_ * 4);
      _tile_stored(3, lower + c + 16, stride_ * 4);
    }
    take_chunk(s_, scores_.data(), stride_, c, rows, lo, hi, top);
  }
  for (int64_t i = 0; i < rows; ++i) tops_[i] = _mm512_reduce_max_ps(top[i]);
}

// Row `row`'s exponentials into probs_ (bf16; zero outside its keys [lo, hi) from the tile's first),
// shifted by its maximum (tops_), and their normalizer. Keys go in groups of 16 aligned to the
// request's first key, so that the sum's lanes see the same keys whichever tile the row is in.
Normalizer PackedAttention::exponentials(int64_t row, int64_t lo, int64_t hi, int64_t width) {
  const float* x = scores_.data() + row * stride_;
  uint16_t* out = probs_.data() + row * stride_;
  const int64_t start = lo / 16 * 16;
  const float scale = s_.soft_cap > 0 ? 1.0f : s_.scale;  // soft-capped scores are scaled already
  // e^(scale * (x - max)) = 2^(x * scale * log2(e) - max * scale * log2(e))
  const float scale2 = scale * 1.44269504088896341f, top_score = tops_[row];
  const __m512 vscale = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(top_score * scale2);
  std::fill(out, out + start, uint16_t{0});
  __m512 sum = _mm512_setzero_ps();
  int64_t k = start;
  for (; k < hi; k += 16) {
    const __mmask16 m = keys_in(lo, hi, k);
    const __m512 e = _mm512_maskz_mov_ps(m, exp2_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, x + k), vscale, shift)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  std::fill(out + k, out + width, uint16_t{0});
  return {top_score * scale, _mm512_reduce_add_ps(sum)};
}

// out [rows][dim] (rows `out_stride` floats apart) = probs_ V over the packed values from the tile's
// first. Sum tiles 0 and 1 take 32 dims of the first row tile; 2 and 3 the same dims of the second
// past 16 rows, sharing each value tile loaded (see score), or else the next 32 dims.
void PackedAttention::weigh(const uint16_t* values, int64_t width, int64_t rows, float* out, int64_t out_stride) {
  if (!amx_) return dot_weigh(values, width, rows, out, out_stride);
  const int64_t dim = s_.chunks * 16, stride = out_stride * 4;
  constexpr int64_t kGroup = 16 * 32;  // one B tile: 16 key pairs x 16 dims x 2
  const bool two = rows > kAmxRows;
  const uint16_t* lower = probs_.data() + kAmxRows * stride_;
  float* lower_out = out + kAmxRows * out_stride;
  for (int64_t g = 0; g < dim / 16; g += two ? 2 : 4) {  // g: the first of the pass's 16-dim groups
    const bool four = !two && g + 4 <= dim / 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < width; c += kChunk) {
      const uint16_t* v = values + c * dim + g * kGroup;
      _tile_loadd(4, probs_.data() + c, stride_ * 2);
      _tile_loadd(6, v, kAmxRowBytes);
      _tile_loadd(7, v + kGroup, kAmxRowBytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, lower + c, stride_ * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      } else if (four) {  // tile 5 is free here: one of these loads waits on a product, not two
        _tile_loadd(5, v + 2 * kGroup, kAmxRowBytes);
        _tile_loadd(6, v + 3 * kGroup, kAmxRowBytes);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, out + 16 * g, stride);
    _tile_stored(1, out + 16 * g + 16, stride);
    if (two) {
      _tile_stored(2, lower_out + 16 * g, stride);
      _tile_stored(3, lower_out + 16 * g + 16, stride);
    } else if (four) {
      _tile_stored(2, out + 16 * g + 32, stride);
      _tile_stored(3, out + 16 * g + 48, stride);
    }
  }
}

namespace {

// Rows [0, R) of a tile's scores over one 32-key chunk by VDPBF16PS: q holds each row's dim pairs
// (`pairs` apart), keys the chunk's two packed 16-key halves ([pairs][16] each, `half` apart). A row's
// 16 sums of a half are its pairs broadcast against the half's pair rows, in the pairs' order, as the
// tile unit takes them: each pair row loaded serves the R rows.
template <int R>
void dot_score_rows(const uint32_t* q, int64_t pairs, const uint32_t* keys, int64_t half, float* out, int64_t stride) {
  __m512 lower[R], upper[R];
  for (int r = 0; r < R; ++r) lower[r] = upper[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh k0 = load_pairs(keys + 16 * j), k1 = load_pairs(keys + 16 * (half + j));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = broadcast_pair(q[r * pairs + j]);
      lower[r] = _mm512_dpbf16_ps(lower[r], a, k0);
      upper[r] = _mm512_dpbf16_ps(upper[r], a, k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * stride, lower[r]);
    _mm512_storeu_ps(out + r * stride + 16, upper[r]);
  }
}

// Rows [0, R) of O = P V over G of the values' 16-dim groups by VDPBF16PS, across the `width` keys:
// probs holds each row's bf16 probabilities (`stride` apart), read as key pairs, values the packed
// values from the first group ([width / 32][groups][16 key pairs][16 dims][2]). Each row's sums take
// the key pairs in order, whatever the rows beside it.
template <int R, int G>
void dot_weigh_rows(const uint32_t* probs, int64_t stride, const uint16_t* values, int64_t width, int64_t groups,
                    float* out, int64_t out_stride) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < width; c += kChunk) {
    const uint16_t* chunk = values + c * groups * 16;  // 16 key-pair vectors of 32 a group
    for (int64_t pair = 0; pair < 16; ++pair) {
      __m512bh v[G];
      for (int g = 0; g < G; ++g) v[g] = load_pairs(chunk + 32 * (g * 16 + pair));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh p = broadcast_pair(probs[r * stride + c / 2 + pair]);
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], p, v[g]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * out_stride + 16 * g, acc[r][g]);
  }
}

constexpr int kDotScoreRows = 8;  // 16 sums + 2 key pair rows + a broadcast of the 32 registers
constexpr int kDotWeighRows = 6;  // 6 x 4 sums + 4 value vectors + a broadcast

using DotScore = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t);
using DotWeigh = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);

template <int... R>
constexpr std::array<DotScore, sizeof...(R)> dot_scorers(std::integer_sequence<int, R...>) {
  return {&dot_score_rows<R + 1>...};
}

template <int G, int... R>
constexpr std::array<DotWeigh, sizeof...(R)> dot_weighers(std::integer_sequence<int, R...>) {
  return {&dot_weigh_rows<R + 1, G>...};
}

}  // namespace

// score() by VDPBF16PS, for a CPU without the tile unit: the same products and sums per score, the
// rows 8 at a time over each 32-key chunk, which stays in L1 for all of them.
void PackedAttention::dot_score(const uint32_t* keys, int64_t width, int64_t rows, const int64_t* lo, const int64_t* hi) {
  static constexpr auto kScore = dot_scorers(std::make_integer_sequence<int, kDotScoreRows>{});
  const int64_t pairs = s_.chunks * 8;
  const uint32_t* q = reinterpret_cast<const uint32_t*>(q_.data());
  __m512 top[kMaxRows];
  for (int64_t i = 0; i < rows; ++i) top[i] = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < width; c += kChunk) {
    const uint32_t* chunk = keys + c * pairs;
    for (int64_t r = 0; r < rows; r += kDotScoreRows) {
      const int64_t n = std::min<int64_t>(kDotScoreRows, rows - r);
      kScore[n - 1](q + r * pairs, pairs, chunk, pairs, scores_.data() + r * stride_ + c, stride_);
    }
    take_chunk(s_, scores_.data(), stride_, c, rows, lo, hi, top);
  }
  for (int64_t i = 0; i < rows; ++i) tops_[i] = _mm512_reduce_max_ps(top[i]);
}

// weigh() by VDPBF16PS: rows 6 at a time, each pass over the keys taking 64 dims.
void PackedAttention::dot_weigh(const uint16_t* values, int64_t width, int64_t rows, float* out, int64_t out_stride) {
  static constexpr auto kFour = dot_weighers<4>(std::make_integer_sequence<int, kDotWeighRows>{});
  static constexpr auto kTwo = dot_weighers<2>(std::make_integer_sequence<int, kDotWeighRows>{});
  const int64_t groups = s_.chunks;  // head_dim is a multiple of 32: an even count of 16-dim groups
  const uint32_t* probs = reinterpret_cast<const uint32_t*>(probs_.data());
  for (int64_t r = 0; r < rows; r += kDotWeighRows) {
    const int64_t n = std::min<int64_t>(kDotWeighRows, rows - r);
    for (int64_t g = 0; g < groups; g += 4) {
      const auto& weigh_rows = g + 4 <= groups ? kFour : kTwo;
      weigh_rows[n - 1](probs + r * stride_ / 2, stride_ / 2, values + g * 16 * 32, width, groups,
                        out + r * out_stride + 16 * g, out_stride);
    }
  }
}

// A decode's scores come from its keys in place, as A tiles of 16 keys by 32 dims (16 keys from a
// multiple of 16 are 16 rows of one block), against its query heads as B tiles (16 dim pairs by the
// heads); each 16 x 16 tile of sums is stored and its heads' columns gathered into their rows of
// scores_. The rest is the prefill's: exponentials, the values packed as B tiles, O = P V. On 2
// Sapphire Rapids-class cores 64 decodes over 200 keys took 17.8-18.2 ms per 30 layers this way
// against 19.9-20.2 on the fp32 path (dot products, an fp32 softmax, weighted sums): both wait on the
// cache's bytes (from a cache that fits in L3 the two took 0.40 and 0.48 ms a layer).
void PackedAttention::attend_decode(const at::BFloat16* q, int64_t first_key, int64_t len, const at::BFloat16* keys,
                                 const at::BFloat16* values, const int64_t* blocks,
                                 const Upcoming<at::BFloat16>& next, float* out, Normalizer* norms) {
  const int64_t dim = s_.chunks * 16, first = round_down(first_key), width = round_up(len) - first;
  const int64_t block_elems = s_.block_size * dim;
  prepare(width);
  uint32_t* heads = reinterpret_cast<uint32_t*>(q_.data());  // per 32 dims: 16 dim pairs x 16 heads
  const uint16_t* head_rows[16];
  for (int64_t g = 0; g < 16; ++g) {
    head_rows[g] = g < s_.group ? reinterpret_cast<const uint16_t*>(q + g * dim) : nullptr;
  }
  for (int64_t c = 0; c < dim / 32; ++c) pair_tile(head_rows, c, heads + 16 * c * 16);
  // lane i: the offset of row i of a 16 x 16 fp32 tile
  static const __m512i kColumn =
      _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  alignas(64) float sums[16 * 16];  // [key][head]
  const int64_t start = first_key / 16 * 16, groups = (len - start + 15) / 16;
  for (int64_t k = start, i = 0; k < len; k += 16, ++i) {
    // this group's share of the next task's blocks, as score() in paged_attention.cpp spreads them (the
    // loop shared as a member of Upcoming made both decode paths about 15% slower), then this task's
    // next keys
    for (int64_t nb = i * next.num_blocks / groups; nb < (i + 1) * next.num_blocks / groups; ++nb) {
      prefetch_block<_MM_HINT_T1>(next.keys + next.blocks[nb] * block_elems, block_elems * 2);
      prefetch_block<_MM_HINT_T1>(next.values + next.blocks[nb] * block_elems, block_elems * 2);
    }
    if (k + 16 < len) prefetch_block(key_row(keys, blocks, k + 16, s_), 16 * dim * 2);
    const uint16_t* rows = key_row(keys, blocks, k, s_);
    _tile_zero(0);
    for (int64_t c = 0; c < dim / 32; ++c) {
      _tile_loadd(1, rows + 32 * c, dim * 2);
      _tile_loadd(2, heads + c * 256, kAmxRowBytes);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sums, 16 * sizeof(float));
    for (int64_t g = 0; g < s_.group; ++g) {
      _mm512_storeu_ps(scores_.data() + g * stride_ + k - first, _mm512_i32gather_ps(kColumn, sums + g, 4));
    }
  }
  // Each head's maximum in a pass of its own: within the loop above it slowed the decodes by 5%.
  const int64_t lo = first_key - first, hi = len - first;
  for (int64_t g = 0; g < s_.group; ++g) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo / 16 * 16; j < hi; j += 16) top = take(s_, scores_.data() + g * stride_, j, lo, hi, top);
    tops_[g] = _mm512_reduce_max_ps(top);
    norms[g] = exponentials(g, lo, hi, width);
  }
  decode_.base = first;
  decode_.values.resize(width * dim);
  for (int64_t k = first; k < first + width; k += kChunk) {
    if (k + kChunk < len) prefetch_block(key_row(values, blocks, k + kChunk, s_), 16 * dim * 2);
    if (k + kChunk + 16 < len) prefetch_block(key_row(values, blocks, k + kChunk + 16, s_), 16 * dim * 2);
    pack_values(decode_, k, len, values, blocks);
  }
  weigh(decode_.values.data(), width, kAmxRows, out, dim);  // out holds a whole tile's rows
  for (int64_t g = 0; g < s_.group; ++g) normalize(out + g * dim, dim, norms[g].sum);
}

namespace {

constexpr int64_t kCascadeRows = 4;   // rows sharing a prefix, at least, for it to be attended once
constexpr int64_t kCascadeKeys = 64;  // keys they share, at least

struct Cascade {
  std::vector<int64_t> rows;
  int64_t keys;  // [0, keys): whole blocks every row shares, and before each row's last key
};

std::vector<Cascade> cascades_of(const Shape& s, const int64_t* table, const int64_t* requests, const int64_t* lens,
                                 const std::vector<int64_t>& decode_rows) {
  std::map<int64_t, std::vector<int64_t>> by_first_block;
  for (const int64_t r : decode_rows) {
    if (lens[r] > kCascadeKeys) by_first_block[table[requests[r] * s.max_blocks]].push_back(r);
  }
  std::vector<Cascade> cascades;
  for (auto& [block, rows] : by_first_block) {
    if (static_cast<int64_t>(rows.size()) < kCascadeRows) continue;
    int64_t limit = INT64_MAX;  // blocks each row sees whole, its own current key left after them
    for (const int64_t r : rows) limit = std::min(limit, (lens[r] - 1) / s.block_size);
    const int64_t* lead = table + requests[rows[0]] * s.max_blocks;
    int64_t common = 0;
    auto shared = [&](int64_t b) {
      return std::all_of(rows.begin(), rows.end(), [&](int64_t r) { return table[requests[r] * s.max_blocks + b] == lead[b]; });
    };
    while (common < limit && shared(common)) ++common;
    if (common * s.block_size >= kCascadeKeys) cascades.push_back({std::move(rows), common * s.block_size});
  }
  return cascades;
}

}  // namespace

SharedPrefixes attend_shared_prefixes(const Shape& s, const at::BFloat16* q, const at::BFloat16* k_cache,
                                      const at::BFloat16* v_cache, int64_t num_kv_heads, int64_t num_rows,
                                      const int64_t* table, const int64_t* requests, const int64_t* lens,
                                      const std::vector<int64_t>& decode_rows) {
  SharedPrefixes shared;
  const std::vector<Cascade> cascades = cascades_of(s, table, requests, lens, decode_rows);
  if (cascades.empty()) return shared;
  const int64_t dim = s.chunks * 16, heads = num_kv_heads * s.group;
  shared.keys.assign(num_rows, 0);
  shared.slot.assign(num_rows, -1);
  struct Task {
    int64_t cascade, head, first;  // queries [first, first + 16) of the cascade's rows x group heads
  };
  std::vector<Task> tasks;
  int64_t slots = 0;
  for (size_t c = 0; c < cascades.size(); ++c) {
    for (const int64_t r : cascades[c].rows) {
      shared.keys[r] = cascades[c].keys;
      shared.slot[r] = slots++;
    }
    const int64_t queries = static_cast<int64_t>(cascades[c].rows.size()) * s.group;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t first = 0; first < queries; first += kAmxRows) tasks.push_back({static_cast<int64_t>(c), h, first});
    }
  }
  shared.out.resize(slots * heads * dim);
  shared.norms.resize(slots * heads);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    PackedAttention unit(s, num_kv_heads);
    for (int64_t t = begin; t < end; ++t) {
      const Task task = tasks[t];
      const Cascade& c = cascades[task.cascade];
      const int64_t n = std::min(kAmxRows, static_cast<int64_t>(c.rows.size()) * s.group - task.first);
      const at::BFloat16* queries[kAmxRows];
      float* outs[kAmxRows];
      Normalizer norms[kAmxRows];
      int64_t results[kAmxRows];  // each query's place: [slot][head]
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = c.rows[(task.first + i) / s.group], head = task.head * s.group + (task.first + i) % s.group;
        queries[i] = q + row * s.q_stride + head * dim;
        results[i] = shared.slot[row] * heads + head;
        outs[i] = shared.out.data() + results[i] * dim;
      }
      unit.attend_shared(queries, n, c.keys, task.cascade, task.head, k_cache + task.head * s.head_stride,
                         v_cache + task.head * s.head_stride, table + requests[c.rows[0]] * s.max_blocks, outs, norms);
      for (int64_t i = 0; i < n; ++i) shared.norms[results[i]] = norms[i];
    }
  });
  return shared;
}

}  // namespace cadence

#pragma GCC pop_options

#endif
