// Attention read straight from the paged KV cache on x86 CPUs (AVX-512), and the store before it.
//
// Every query row (a decode's one token, or any token of a prefill) attends to the first seq_len
// tokens of its request's block-table row: its cached context up to and including its own position,
// so causal masking is just each row's length. A sliding window (Gemma, Mistral) is a lower bound on
// the same range: the row sees the last `window` of those keys, and nothing before them is read.
// Soft-capping (Gemma 2) maps each scaled score s to cap * tanh(s / cap) before the softmax. Keys and values are read in place through the block
// table instead of being gathered into a contiguous copy first (which writes and rereads the whole
// context every layer). Tasks are (rows, KV head), where the query heads sharing the KV head go
// together, dealt to the threads in contiguous shares of about equal keys read (shares_of):
// - a decode row streams its context once: scores by dot products, an fp32 softmax, weighted values,
//   with the next block prefetched, and the next task's keys and values meanwhile (memory-bound); past
//   512 keys, in parts of 512 that are tasks of their own, merged after (kDecodePartKeys, merge_parts),
//   so that one long decode's keys are read by every thread;
// - up to 16 consecutive rows of a prefill form a tile that walks the keys in 16-key chunks, each
//   transposed once so that a query's 16 scores are head_dim FMAs, and each value chunk serves every
//   query of the tile (compute-bound);
// - with a bf16 cache on a CPU with AMX, a tile of 4 rows or more goes to the tile unit instead
//   (attention_packed.cpp: PackedAttention), 4-6x faster on long prompts, and so does a decode where the
//   call's shape allows (PackedAttention::takes_decodes), about 10% faster; and decodes that share their
//   first blocks attend to those together there first (attend_shared_prefixes), then each to its own
//   keys, the two parts merged (cascade attention);
// - without AMX but with AVX512-BF16, the same tiles and shared prefixes take the same packed steps
//   by VDPBF16PS (about 2.5x the fp32 path on long prompts), and decodes of the shapes compiled there
//   read their keys and values as bf16 pairs (decode_dot.cpp; attend_decode_dot).
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "paged_attention.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace cadence;

// Scores of `group` query rows (fp32, pre-scaled, [group][head_dim]) against keys [begin, seq_len).
// G and C: the group and head_dim / 16 when fixed at compile time (the query vectors then stay in
// registers across the keys instead of being reloaded for each: the same FMAs and sums), 0: read from s.
template <int G, int C, typename T>
void score(const Shape s, const float* q, const T* keys, const int64_t* blocks, int64_t begin, int64_t seq_len,
           float* scores /* [group][seq_len] */, const Upcoming<T>& next) {
  const int64_t group = G ? G : s.group, chunks = C ? C : s.chunks;
  const int64_t dim = chunks * 16, block_elems = s.block_size * dim, first_block = begin / s.block_size;
  const int64_t num_blocks = (seq_len + s.block_size - 1) / s.block_size - first_block;
#if defined(__AVX512F__)
  __m512 k[C ? C : 16];
  [[maybe_unused]] __m512 qv[G ? G : 1][C ? C : 1];
  if constexpr (G && C) {
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + g * dim + c * 16);
    }
  }
#endif
  for (int64_t first = first_block * s.block_size, b = first_block; first < seq_len; first += s.block_size, ++b) {
    const T* block = keys + blocks[b] * block_elems;
    prefetch_share(next, b - first_block, num_blocks, block_elems);
    if (first + s.block_size < seq_len) prefetch_block(keys + blocks[b + 1] * block_elems, block_elems * sizeof(T));
    const int64_t n = std::min(s.block_size, seq_len - first);
    for (int64_t t = std::max(int64_t{0}, begin - first); t < n; ++t) {
#if defined(__AVX512F__)
      for (int64_t c = 0; c < chunks; ++c) k[c] = load16(block + t * dim + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc;
        if constexpr (G && C) {
          acc = _mm512_mul_ps(k[0], qv[g][0]);
          for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(k[c], qv[g][c], acc);
        } else {
          acc = _mm512_mul_ps(k[0], _mm512_loadu_ps(q + g * dim));
          for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(q + g * dim + c * 16), acc);
        }
        scores[g * seq_len + first + t] = _mm512_reduce_add_ps(acc);
      }
#else  // the same sums in native halves (vec.h: load8x2); the key is reread from L1 per query head
      const T* key = block + t * dim;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * dim;
        __m256 k_lo, k_hi;
        load8x2(key, k_lo, k_hi);
        __m256 lo = _mm256_mul_ps(k_lo, _mm256_loadu_ps(qg)), hi = _mm256_mul_ps(k_hi, _mm256_loadu_ps(qg + 8));
        for (int64_t c = 1; c < chunks; ++c) {
          load8x2(key + c * 16, k_lo, k_hi);
          lo = _mm256_fmadd_ps(k_lo, _mm256_loadu_ps(qg + c * 16), lo);
          hi = _mm256_fmadd_ps(k_hi, _mm256_loadu_ps(qg + c * 16 + 8), hi);
        }
        scores[g * seq_len + first + t] = reduce_add8x2(lo, hi);
      }
#endif
    }
  }
}

// Soft-capping in place: cap * tanh(s / cap) for each of n scores (Gemma 2's attention logits).
void soft_cap(float* row, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) row[i] = cap * std::tanh(row[i] / cap);
}

// Softmax of one row in place: the row then sums to 1.
Normalizer softmax(float* row, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, row + full));
  const float top = _mm512_reduce_max_ps(vmax);
  const __m512 m = _mm512_set1_ps(top);
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
  const float sum = _mm512_reduce_add_ps(vsum);
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
  for (int64_t i = 0; i < full; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
  if (tail) _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), inv));
  return {top, sum};
}

// A decode's attention to its own keys (acc, normalized, with its normalizer) and to the keys it shares
// with other decodes (SharedPrefixes: unnormalized sums `shared`, and theirs), merged into acc: each
// part's weight is its sum of exponentials, rescaled to the larger of the two maxima.
void merge(float* acc, int64_t dim, Normalizer own, const float* shared, Normalizer prefix) {
  const float top = std::max(own.max, prefix.max);
  const float a = std::exp(prefix.max - top), b = own.sum * std::exp(own.max - top);
  const float inv = 1.0f / (prefix.sum * a + b);
  const __m512 va = _mm512_set1_ps(a * inv), vb = _mm512_set1_ps(b * inv);
  for (int64_t d = 0; d < dim; d += 16) {
    _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_mul_ps(va, _mm512_loadu_ps(shared + d)),
                                            _mm512_mul_ps(vb, _mm512_loadu_ps(acc + d))));
  }
}

// out[g] = sum_t probs[g][t] * v[t] for the `group` rows, accumulated in fp32. The block walk repeats
// score()'s on purpose: shared through a lambda, decode attention ran 25% slower (9.4 -> 12 ms per
// batch-64 step of 30 layers) as GCC stopped keeping the loop's values in registers. G and C as
// score()'s: when fixed, the group's sums stay in registers across the keys instead of being loaded
// and stored for each (the same FMAs in the same order).
template <int G, int C, typename T>
void weigh(const Shape s, const float* probs, const T* values, const int64_t* blocks, int64_t begin, int64_t seq_len,
           float* acc /* [group][head_dim] */) {
  const int64_t group = G ? G : s.group, chunks = C ? C : s.chunks;
  const int64_t dim = chunks * 16, block_elems = s.block_size * dim, first_block = begin / s.block_size;
  if constexpr (!(G && C)) std::fill(acc, acc + group * dim, 0.0f);  // fixed shapes store their sums at the end
#if defined(__AVX512F__)
  __m512 v[C ? C : 16];
  [[maybe_unused]] __m512 a[G ? G : 1][C ? C : 1];
  if constexpr (G && C) {
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
    }
  }
#endif
  for (int64_t first = first_block * s.block_size, b = first_block; first < seq_len; first += s.block_size, ++b) {
    const T* block = values + blocks[b] * block_elems;
    if (first + s.block_size < seq_len) prefetch_block(values + blocks[b + 1] * block_elems, block_elems * sizeof(T));
    const int64_t n = std::min(s.block_size, seq_len - first);
    for (int64_t t = std::max(int64_t{0}, begin - first); t < n; ++t) {
#if defined(__AVX512F__)
      for (int64_t c = 0; c < chunks; ++c) v[c] = load16(block + t * dim + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * seq_len + first + t]);
        if constexpr (G && C) {
          for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
        } else {
          float* row = acc + g * dim;
          for (int64_t c = 0; c < chunks; ++c) {
            _mm512_storeu_ps(row + c * 16, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(row + c * 16)));
          }
        }
      }
#else  // as score() does
      const T* value = block + t * dim;
      for (int64_t g = 0; g < group; ++g) {
        const __m256 p = _mm256_set1_ps(probs[g * seq_len + first + t]);
        float* row = acc + g * dim;
        for (int64_t c = 0; c < chunks; ++c) {
          __m256 v_lo, v_hi;
          load8x2(value + c * 16, v_lo, v_hi);
          _mm256_storeu_ps(row + c * 16, _mm256_fmadd_ps(p, v_lo, _mm256_loadu_ps(row + c * 16)));
          _mm256_storeu_ps(row + c * 16 + 8, _mm256_fmadd_ps(p, v_hi, _mm256_loadu_ps(row + c * 16 + 8)));
        }
      }
#endif
    }
  }
#if defined(__AVX512F__)
  if constexpr (G && C) {
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * dim + c * 16, a[g][c]);
    }
  }
#endif
}

// Rows attended together: consecutive query rows of one request (a prefill chunk), at most this many
// on the fp32 path (PackedAttention::kMaxRows over packed keys).
constexpr int64_t kTileRows = 16;
// Tiles of at least this many rows take the packed keys, where they can (PackedAttention). On the tile
// unit 32 tiles over 200 keys each took 1.21x the fp32 path's time at 2 rows, 0.84x at 4, 0.35x at 16;
// by VDPBF16PS (AMD EPYC, 2026-12-07) 0.61x at 4 rows, 0.52x at 8, 0.48x at 16 (over 1,000 keys 0.59x,
// 0.56x, 0.54x).
constexpr int64_t kPackedTileRows = 4;

// rows [first, first + count) of one request, at consecutive positions.
struct Tile {
  int64_t first;
  int64_t count;
};

std::vector<Tile> tiles_of(const int64_t* requests, const int64_t* lens, int64_t num_rows, int64_t max_rows) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < num_rows;) {
    int64_t n = 1;
    while (r + n < num_rows && n < max_rows && requests[r + n] == requests[r] && lens[r + n] == lens[r] + n) ++n;
    tiles.push_back({r, n});
    r += n;
  }
  return tiles;
}

// A decode's keys past this many go in parts of this many (the last part the rest), each part a task
// of its own, merged in key order after (merge_parts). With one task per KV head, one decode (3 KV
// heads on SmolLM2) left one of two threads twice the other's keys, and sixteen threads thirteen idle;
// the parts depend on the decode's own keys only, so they make its bits depend on neither the batch
// nor the count of threads. One decode's 30 layers over 2,048 keys on 2 AMD EPYC cores (2026-12-07):
// 1.8-2.7 ms against 2.6-3.6 whole, over 4,096 keys 5.6 against 7.4; 64 decodes over 2,000 keys each,
// where every thread had whole decodes already, about 2% slower (a part costs about 0.4 us of its
// own). Parts of 256 keys were no faster than 512 for one decode; of 1,024, 6-23% slower between
// 1,100 and 3,000 keys.
constexpr int64_t kDecodePartKeys = 512;

// One task: rows of one tile against one KV head's keys [begin, end) (a tile's rows: from the keys
// they skip, through their own); `part`: its slot among the call's decode parts, or -1 for a whole task.
struct Task {
  int64_t tile;
  int64_t head;
  int64_t begin;
  int64_t end;
  int64_t part;
};

// Tile-major, then KV head, then part. `first_key`: per row, the first key it reads.
template <typename FirstKey>
std::vector<Task> tasks_of(const std::vector<Tile>& tiles, const int64_t* lens, int64_t num_kv_heads,
                           const FirstKey& first_key, int64_t* num_parts) {
  std::vector<Task> tasks;
  *num_parts = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const int64_t row = tiles[i].first, begin = first_key(row), len = lens[row];
    const bool split = tiles[i].count == 1 && len - begin > kDecodePartKeys;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (!split) {
        tasks.push_back({static_cast<int64_t>(i), h, begin, len, -1});
        continue;
      }
      for (int64_t first = begin; first < len; first += kDecodePartKeys) {
        tasks.push_back({static_cast<int64_t>(i), h, first, std::min(len, first + kDecodePartKeys), (*num_parts)++});
      }
    }
  }
  return tasks;
}

// Where each of `parts` threads' share of the tasks begins, the last entry the task count: contiguous
// runs of about equal work, a task's work being the keys its rows read. parallel_for alone splits the
// tasks by count, so a decode over a long context beside short ones left one thread most of the step:
// serving's contexts are heavy-tailed (a batch of 2,000 + 3 x 200 keys took 1.7x the time of 4 x 650
// over 30 layers on the 2-core AVX2 machine; now about the same).
std::vector<int64_t> shares_of(const std::vector<Task>& tasks, const std::vector<Tile>& tiles, const int64_t* lens,
                               const Shape s, int64_t parts) {
  std::vector<int64_t> work(tasks.size());
  int64_t total = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Tile& tile = tiles[tasks[i].tile];
    const int64_t last = lens[tile.first + tile.count - 1];
    // a decode reads its task's keys; each row of a tile at most its last row's, from its window's start
    work[i] = tile.count == 1 ? tasks[i].end - tasks[i].begin
                              : tile.count * (last - std::max(s.begin(last), tasks[i].begin));
    total += work[i];
  }
  std::vector<int64_t> bounds(parts + 1, static_cast<int64_t>(tasks.size()));
  bounds[0] = 0;
  int64_t done = 0, part = 1;
  for (size_t i = 0; i < tasks.size(); ++i) {
    // A task goes to the share whose stretch of the total its middle falls in.
    while (part < parts && 2 * done + work[i] > 2 * total * part / parts) bounds[part++] = static_cast<int64_t>(i);
    done += work[i];
  }
  return bounds;
}

// One decode's parts (acc [count][group][dim] in key order, each normalized, with its normalizers
// [count][group]) into acc [group][dim] and `own`, as if attended in one pass: each part weighted by
// its sum of exponentials, rescaled to the largest maximum.
void merge_parts(int64_t group, int64_t dim, const float* parts, const Normalizer* norms, int64_t count, float* acc,
                 Normalizer* own) {
  for (int64_t g = 0; g < group; ++g) {
    float top = norms[g].max;
    for (int64_t p = 1; p < count; ++p) top = std::max(top, norms[p * group + g].max);
    float total = 0.0f;
    for (int64_t p = 0; p < count; ++p) total += norms[p * group + g].sum * std::exp(norms[p * group + g].max - top);
    float* out = acc + g * dim;
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(out + d, _mm512_setzero_ps());
    for (int64_t p = 0; p < count; ++p) {
      const Normalizer n = norms[p * group + g];
      const __m512 weight = _mm512_set1_ps(n.sum * std::exp(n.max - top) / total);
      const float* in = parts + (p * group + g) * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        _mm512_storeu_ps(out + d, _mm512_fmadd_ps(weight, _mm512_loadu_ps(in + d), _mm512_loadu_ps(out + d)));
      }
    }
    own[g] = {top, total};
  }
}

// Per-thread working memory, sized for the largest task of the call. Every buffer starts on a 64-byte
// line: full-width loads that straddle two lines cost twice (decode attention ran 25% slower).
class Scratch {
 public:
  Scratch(const Shape s, int64_t longest, int64_t tile_rows) : pair_stride((longest + 2) / 2 * 2) {
    const int64_t dim = s.chunks * 16, queries = tile_rows * s.group;
    const int64_t sizes[] = {queries * dim, queries * longest, queries * dim, dim * 16, 16 * dim,
                             s.group * pair_stride / 2};
    int64_t total = 0;
    for (const int64_t size : sizes) total += (size + 15) / 16 * 16;
    arena_.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
    TORCH_CHECK(arena_ != nullptr, "paged_attention: out of memory for scratch buffers");
    float* next = arena_.get();
    float* pairs_area = nullptr;
    float** buffers[] = {&q, &scores, &acc, &keys_t, &values, &pairs_area};
    for (int i = 0; i < 6; ++i) {
      *buffers[i] = next;
      next += (sizes[i] + 15) / 16 * 16;
    }
    pairs = reinterpret_cast<uint16_t*>(pairs_area);
  }

  float* q;       // [queries][head_dim], pre-scaled
  float* scores;  // [queries][keys]
  float* acc;     // [queries][head_dim]
  float* keys_t;  // [head_dim][16]: one key chunk, transposed
  float* values;  // [16][head_dim]: one value chunk
  const int64_t pair_stride;  // even, past the longest context by at least one
  uint16_t* pairs;  // [group][pair_stride]: a decode's probabilities in bf16 (decode_dot.cpp)

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> arena_;
};

// acc[0:16C] += sum_t probs[t] * values[t][0:16C] over n rows of fp32 values, accumulators in registers.
template <int C>
void accumulate(float* acc, const float* probs, const float* values, int64_t n) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 p = _mm512_set1_ps(probs[t]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + t * C * 16 + c * 16), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
}

using Accumulate = void (*)(float*, const float*, const float*, int64_t);

template <int... C>
constexpr std::array<Accumulate, sizeof...(C)> accumulators(std::integer_sequence<int, C...>) {
  return {&accumulate<C + 1>...};
}

// A decode's group of rows of scores ([group][len]) over keys [begin, len), soft-capped where the call
// caps them, to their softmax in place; their normalizers to `own`.
void decode_softmax(const Shape s, float* scores, int64_t begin, int64_t len, Normalizer* own) {
  for (int64_t g = 0; g < s.group; ++g) {
    if (s.soft_cap > 0) soft_cap(scores + g * len + begin, len - begin, s.soft_cap);
    own[g] = softmax(scores + g * len + begin, len - begin);
  }
}

// A decode's attention to its keys [begin, len): the group's scores, their softmax (normalizers to
// `own`), and the weighted values into w.acc. G and C as score()'s.
template <int G, int C, typename T>
void attend_decode(const Shape s, Scratch& w, int64_t begin, int64_t len, const T* keys, const T* values,
                   const int64_t* blocks, const Upcoming<T>& next, Normalizer* own) {
  score<G, C>(s, w.q, keys, blocks, begin, len, w.scores, next);
  decode_softmax(s, w.scores, begin, len, own);
  weigh<G, C>(s, w.scores, values, blocks, begin, len, w.acc);
}

#if defined(__AVX512F__)
// A bf16 decode by VDPBF16PS (decode_dot.cpp; dot_decodes(s)): its group's scores, their softmax
// (normalizers to `own`), the probabilities rounded to bf16 with a zero after each row, and the
// weighted values into w.acc.
void attend_decode_dot(const Shape s, Scratch& w, const at::BFloat16* q, int64_t begin, int64_t len,
                       const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks,
                       const Upcoming<at::BFloat16>& next, Normalizer* own) {
  dot_decode_scores(s, q, begin, len, keys, blocks, next, w.scores);
  decode_softmax(s, w.scores, begin, len, own);
  const int64_t n = len - begin;
  for (int64_t g = 0; g < s.group; ++g) {
    const float* row = w.scores + g * len + begin;
    auto* probs = reinterpret_cast<at::BFloat16*>(w.pairs + g * w.pair_stride);
    for (int64_t k = 0; k < n; k += 16) store16(probs + k, load16(row + k, tail_mask(n - k)), tail_mask(n - k));
    w.pairs[g * w.pair_stride + n] = 0;
  }
  dot_decode_weigh(s, w.pairs, w.pair_stride, begin, len, values, blocks, w.acc);
}
#endif

// attend_decode with the group and head_dim fixed at compile time where the group's query vectors and
// sums fit the 32 vector registers beside a key (AVX-512: 1-4 query heads per KV head at head_dim 64,
// 1-2 at 128; decode attention 20 -> 15-16 ms per 30 layers at batch 64, SmolLM2's shape), else read.
template <typename T>
void attend_decode(const Shape s, Scratch& w, int64_t begin, int64_t len, const T* keys, const T* values,
                   const int64_t* blocks, const Upcoming<T>& next, Normalizer* own) {
#if defined(__AVX512F__)
  using Fixed = void (*)(const Shape, Scratch&, int64_t, int64_t, const T*, const T*, const int64_t*,
                         const Upcoming<T>&, Normalizer*);
  static constexpr Fixed kFixed[kFixedDecodeShapes] = {  // by fixed_decode_shape (paged_attention.h)
      &attend_decode<1, 4, T>, &attend_decode<2, 4, T>, &attend_decode<3, 4, T>, &attend_decode<4, 4, T>,
      &attend_decode<1, 8, T>, &attend_decode<2, 8, T>};
  if (const int shape = fixed_decode_shape(s); shape >= 0) {
    return kFixed[shape](s, w, begin, len, keys, values, blocks, next, own);
  }
#endif
  attend_decode<0, 0>(s, w, begin, len, keys, values, blocks, next, own);
}

// The tile's queries ([rows * group][head_dim], pre-scaled fp32; query j is row j / group) against the
// keys one 16-key chunk at a time: the chunk is transposed to [head_dim][16], so a query's 16 scores
// are head_dim FMAs with no horizontal sums, and each chunk's values serve every query of the tile.
// Row i sees keys [s.begin(first_len + i), first_len + i). Writes the tile's outputs (fp32) to scratch.acc.
template <typename T>
void attend_tile(const Shape s, Scratch& w, int64_t rows, int64_t first_len, const T* keys, const T* values,
                 const int64_t* blocks) {
  static constexpr auto kAccumulate = accumulators(std::make_integer_sequence<int, 16>{});
  const int64_t dim = s.chunks * 16, block_elems = s.block_size * dim, queries = rows * s.group;
  const int64_t longest = first_len + rows - 1;
  std::fill(w.acc, w.acc + queries * dim, 0.0f);
  for (int pass = 0; pass < 2; ++pass) {  // 0: scores, then softmax; 1: weighted values
    for (int64_t first = s.begin(first_len); first < longest;) {
      const int64_t in_block = first % s.block_size;
      const int64_t n = std::min({int64_t{16}, s.block_size - in_block, longest - first});
      const T* src = (pass == 0 ? keys : values) + blocks[first / s.block_size] * block_elems + in_block * dim;
      if (pass == 1) {
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t c = 0; c < s.chunks; ++c) _mm512_storeu_ps(w.values + t * dim + c * 16, load16(src + t * dim + c * 16));
        }
      } else {
        for (int64_t c = 0; c < s.chunks; ++c) {
          __m512 rows[16];
          for (int64_t t = 0; t < 16; ++t) rows[t] = t < n ? load16(src + t * dim + c * 16) : _mm512_setzero_ps();
          transpose16(rows);
          for (int i = 0; i < 16; ++i) _mm512_store_ps(w.keys_t + (c * 16 + i) * 16, rows[i]);
        }
      }
      for (int64_t j = 0; j < queries; ++j) {
        const int64_t len = first_len + j / s.group;
        // this chunk's keys [first + lo, first + hi) that query j sees
        const int64_t lo = std::max(int64_t{0}, s.begin(len) - first), hi = std::min(n, len - first);
        if (lo >= hi) continue;
        float* row_scores = w.scores + j * longest;
        if (pass == 0) {
          const float* q = w.q + j * dim;
          __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t d = 0; d < dim; d += 4) {
            for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + u]), _mm512_load_ps(w.keys_t + (d + u) * 16), acc[u]);
          }
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
          _mm512_mask_storeu_ps(row_scores + first, static_cast<__mmask16>(tail_mask(hi) & ~tail_mask(lo)), sum);
        } else {
          kAccumulate[s.chunks - 1](w.acc + j * dim, row_scores + first + lo, w.values + lo * dim, hi - lo);
        }
      }
      first += n;
    }
    if (pass == 0) {
      for (int64_t j = 0; j < queries; ++j) {
        const int64_t len = first_len + j / s.group, begin = s.begin(len);
        float* row = w.scores + j * longest + begin;
        if (s.soft_cap > 0) soft_cap(row, len - begin, s.soft_cap);
        softmax(row, len - begin);
      }
    }
  }
}

// A tile's outputs, fp32 [rows][group][head_dim] in acc, to out's rows (`row_stride` apart) from the
// tile's first row's first head of the KV head.
template <typename T>
void store_tile(const Shape s, T* out, int64_t row_stride, int64_t rows, const float* acc) {
  const int64_t width = s.group * s.chunks * 16;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t e = 0; e < width; e += 16) store16(out + i * row_stride + e, _mm512_load_ps(acc + i * width + e));
  }
}

template <typename T>
void attend(const Shape s, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& row_requests,
            const at::Tensor& seq_lens) {
  const int64_t num_rows = q.size(0), num_kv_heads = k_cache.size(0), dim = s.chunks * 16;
  const int64_t heads = num_kv_heads * s.group;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* requests = row_requests.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lens, lens + num_rows);
  // A bf16 cache's prefill tiles go to the tile unit where the CPU has one, else to VDPBF16PS where it
  // has those (attention_packed.cpp: packed), and decodes to the tile unit.
  const bool packable = std::is_same_v<T, at::BFloat16> && dim % 32 == 0;
  const bool amx = packable && use_amx(), packed = amx || (packable && use_bf16_dot());
#if defined(__AVX512F__)
  const bool dot = packable && dot_decodes(s);  // decodes by VDPBF16PS (decode_dot.cpp)
#endif
  const int64_t tile_rows = packed ? PackedAttention::kMaxRows : kTileRows;
  const std::vector<Tile> tiles = tiles_of(requests, lens, num_rows, tile_rows);
  SharedPrefixes shared;  // and decodes that share their first keys attend to those together first
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (packed && s.window == 0) {
      std::vector<int64_t> decodes;
      for (const Tile& tile : tiles) {
        if (tile.count == 1) decodes.push_back(tile.first);
      }
      shared = attend_shared_prefixes(s, q_ptr, k_ptr, v_ptr, num_kv_heads, num_rows, table, requests, lens, decodes);
    }
  }
#endif
  // The first key a decode reads: past those it shares with other decodes, if any (SharedPrefixes exist
  // only without a window).
  auto first_key = [&](int64_t row) { return shared.empty() ? s.begin(lens[row]) : shared.keys[row]; };
  int64_t num_parts = 0;
  const std::vector<Task> tasks = tasks_of(tiles, lens, num_kv_heads, first_key, &num_parts);
  std::vector<float> part_acc(num_parts * s.group * dim);  // merge_parts' inputs
  std::vector<Normalizer> part_norms(num_parts * s.group);
  // A decode's output (acc, normalized, with `own`), merged with its shared prefix's if it has one, to out.
  auto finish_decode = [&](const Tile& tile, int64_t head, float* acc, const Normalizer* own) {
    if (!shared.empty() && shared.slot[tile.first] >= 0) {
      const int64_t first = shared.slot[tile.first] * heads + head * s.group;
      for (int64_t g = 0; g < s.group; ++g) {
        merge(acc + g * dim, dim, own[g], shared.out.data() + (first + g) * dim, shared.norms[first + g]);
      }
    }
    store_tile(s, out_ptr + (tile.first * heads + head * s.group) * dim, heads * dim, 1, acc);
  };
  auto attend_tasks = [&](int64_t begin, int64_t end) {
    if (begin == end) return;
    Scratch w(s, longest, tile_rows);
    std::vector<Normalizer> own(s.group);  // a decode's heads' normalizers
#if defined(__AVX512F__)
    std::optional<PackedAttention> unit;  // made at this share's first task on the tile unit, if it has one
#endif
    const __m512 scale = _mm512_set1_ps(s.scale);
    auto upcoming = [&](int64_t task) {  // the keys of this share's task after `task`, if any
      Upcoming<T> next;
      if (task + 1 < end) {
        const Task& nt = tasks[task + 1];
        const int64_t first_block = nt.begin / s.block_size;
        next = {k_ptr + nt.head * s.head_stride, v_ptr + nt.head * s.head_stride,
                table + requests[tiles[nt.tile].first] * s.max_blocks + first_block,
                (nt.end + s.block_size - 1) / s.block_size - first_block};
      }
      return next;
    };
    for (int64_t task = begin; task < end; ++task) {
      const Task& t = tasks[task];
      const Tile tile = tiles[t.tile];
      const int64_t head = t.head, len = t.end;
      const int64_t* blocks = table + requests[tile.first] * s.max_blocks;
      const T* keys = k_ptr + head * s.head_stride;
      const T* values = v_ptr + head * s.head_stride;
      bool attended = false;  // on the tile unit or by VDPBF16PS
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const T* q_tile = q_ptr + tile.first * s.q_stride + head * s.group * dim;
        if (packed && (tile.count >= kPackedTileRows || (amx && tile.count == 1 && PackedAttention::takes_decodes(s)))) {
          if (!unit) unit.emplace(s, num_kv_heads);
          if (tile.count == 1) {
            unit->attend_decode(q_tile, t.begin, len, keys, values, blocks, upcoming(task), w.acc, own.data());
          } else {
            unit->attend(q_tile, tile.count, len, requests[tile.first], head, keys, values, blocks, w.acc);
          }
          attended = true;
        }
      }
#endif
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (!attended && tile.count == 1 && dot) {
          attend_decode_dot(s, w, q_ptr + tile.first * s.q_stride + head * s.group * dim, t.begin, len, keys, values,
                            blocks, upcoming(task), own.data());
          attended = true;
        }
      }
#endif
      if (!attended) {
        for (int64_t i = 0; i < tile.count; ++i) {  // the tile's queries, scaled: [row][g][dim]
          const T* q_row = q_ptr + (tile.first + i) * s.q_stride + head * s.group * dim;
          for (int64_t e = 0; e < s.group * dim; e += 16) {
            _mm512_store_ps(w.q + i * s.group * dim + e, _mm512_mul_ps(load16(q_row + e), scale));
          }
        }
        if (tile.count == 1) {  // a decode: stream the context once for the group's heads
          attend_decode(s, w, t.begin, len, keys, values, blocks, upcoming(task), own.data());
        } else {
          attend_tile(s, w, tile.count, len, keys, values, blocks);
        }
      }
      if (t.part >= 0) {  // one part of a decode's keys: kept for merge_parts
        std::copy(w.acc, w.acc + s.group * dim, part_acc.data() + t.part * s.group * dim);
        std::copy(own.begin(), own.end(), part_norms.begin() + t.part * s.group);
      } else if (tile.count == 1) {
        finish_decode(tile, head, w.acc, own.data());
      } else {
        store_tile(s, out_ptr + (tile.first * heads + head * s.group) * dim, heads * dim, tile.count, w.acc);
      }
    }
  };
  const std::vector<int64_t> shares = shares_of(tasks, tiles, lens, s, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(shares.size()) - 1, 1, [&](int64_t first_share, int64_t last_share) {
    for (int64_t share = first_share; share < last_share; ++share) attend_tasks(shares[share], shares[share + 1]);
  });
  if (num_parts == 0) return;
  Scratch merged(s, 1, 1);  // its acc: 64-byte aligned, as store_tile reads it
  std::vector<Normalizer> own(s.group);
  for (size_t i = 0; i < tasks.size();) {  // each split decode's parts, consecutive tasks
    if (tasks[i].part < 0) {
      ++i;
      continue;
    }
    size_t n = 1;
    while (i + n < tasks.size() && tasks[i + n].tile == tasks[i].tile && tasks[i + n].head == tasks[i].head) ++n;
    const int64_t first = tasks[i].part;
    merge_parts(s.group, dim, part_acc.data() + first * s.group * dim, part_norms.data() + first * s.group,
                static_cast<int64_t>(n), merged.acc, own.data());
    finish_decode(tiles[tasks[i].tile], tasks[i].head, merged.acc, own.data());
    i += n;
  }
}

// Turns paged attention's VDPBF16PS path on or off (tests and benchmarks compare it with the fp32 path);
// whether it is on.
bool switch_bf16_dot(bool enable) {
  bf16_dot_enabled = enable;
  return cadence::use_bf16_dot();
}

// out, q: [rows, num_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim];
// block_table: [requests, max_blocks] int64; row_requests: [rows] int64, each row's request;
// seq_lens: [rows] int64, each row's position + 1, at least 1; window: the last keys of those a row
// sees (0: all); soft_cap: 0 for none.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& row_requests, const at::Tensor& seq_lens,
                     double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: out and the caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q's heads and dims must be dense");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              row_requests.scalar_type() == at::kLong, "paged_attention: block_table, row_requests, seq_lens: int64");
  TORCH_CHECK(row_requests.numel() == q.size(0) && seq_lens.numel() == q.size(0), "paged_attention: one entry per row");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256, "paged_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "paged_attention: window and soft_cap must not be negative");
  if (q.size(0) == 0) return;
  const Shape s{q.size(1) / k_cache.size(0), head_dim / 16, k_cache.size(2),
                k_cache.size(1) * k_cache.size(2) * head_dim, block_table.size(1), q.stride(0),
                window, static_cast<float>(scale), static_cast<float>(soft_cap)};
  const at::Tensor table = block_table.contiguous(), requests = row_requests.contiguous(), lens = seq_lens.contiguous();
  CADENCE_DISPATCH_FLOAT(q.scalar_type(), "paged_attention",
                         [&] { attend<scalar_t>(s, out, q, k_cache, v_cache, table, requests, lens); });
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
  m.def("use_bf16_dot(bool enable) -> bool", switch_bf16_dot);  // no tensors: callable on any dispatch key
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor row_requests, Tensor seq_lens, float scale, int window, float soft_cap) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("store_kv", store_kv);
}
