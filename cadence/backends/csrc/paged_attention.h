// What paged attention's two translation units share: a call's shape, and the AMX path for prefill
// tiles and decodes (attention_packed.cpp), which paged_attention.cpp hands its bf16 rows to where the CPU
// has tiles.
#pragma once

#include <ATen/ATen.h>

#include "vec.h"

#include <cstdint>
#include <vector>

namespace cadence {

// Sizes of one call, fixed across its tasks; passed by value, so that stores through float pointers
// cannot alias them and loops keep them in registers.
struct Shape {
  int64_t group;        // query heads per KV head
  int64_t chunks;       // head_dim / 16
  int64_t block_size;
  int64_t head_stride;  // elements between KV heads in the cache: num_blocks * block_size * head_dim
  int64_t max_blocks;   // block-table row length
  int64_t q_stride;     // elements between q's rows (tokens); heads and dims are dense
  int64_t window;       // keys a row sees before and at its position; 0: all of them
  float scale;
  float soft_cap;       // 0: none

  // The first key a row that sees `len` keys attends to.
  int64_t begin(int64_t len) const { return window > 0 && len > window ? len - window : 0; }
};

// The next task's context, fetched into L2 while this task computes: a cache whose blocks lie
// scattered (as after requests come and go) defeats the hardware prefetcher between blocks, and
// with it decode attention went from 18.6 to 14.7 ms per 30 layers on a shuffled block table.
template <typename T>
struct Upcoming {
  const T* keys = nullptr;
  const T* values = nullptr;
  const int64_t* blocks = nullptr;
  int64_t num_blocks = 0;
};

// Block i of a task's num_blocks: its share of the next task's keys and values, fetched into L2. Inlined
// by force: called, it left decodes over a shuffled block table 40% slower (26.5 against 18.4 ms).
template <typename T>
__attribute__((always_inline)) inline void prefetch_share(const Upcoming<T>& next, int64_t i, int64_t num_blocks,
                                                          int64_t block_elems) {
  for (int64_t nb = i * next.num_blocks / num_blocks; nb < (i + 1) * next.num_blocks / num_blocks; ++nb) {
    prefetch_block<_MM_HINT_T1>(next.keys + next.blocks[nb] * block_elems, block_elems * sizeof(T));
    prefetch_block<_MM_HINT_T1>(next.values + next.blocks[nb] * block_elems, block_elems * sizeof(T));
  }
}

// Row `key` of a head's cache (keys or values) through a request's block-table row, as bf16 bits.
inline const uint16_t* key_row(const at::BFloat16* cache, const int64_t* blocks, int64_t key, const Shape& s) {
  return reinterpret_cast<const uint16_t*>(cache + (blocks[key / s.block_size] * s.block_size + key % s.block_size) *
                                                       (s.chunks * 16));
}

// The decode shapes compiled for a fixed group and head_dim, where the group's query vectors and sums
// fit the 32 vector registers beside a key (paged_attention.cpp's attend_decode<G, C>, decode_dot.cpp):
// 1-4 query heads per KV head at head_dim 64 (index group - 1), 1-2 at 128 (group + 3); -1 for others.
constexpr int kFixedDecodeShapes = 6;

inline int fixed_decode_shape(const Shape& s) {
  if (s.chunks == 4 && s.group >= 1 && s.group <= 4) return static_cast<int>(s.group - 1);
  if (s.chunks == 8 && s.group >= 1 && s.group <= 2) return static_cast<int>(s.group + 3);
  return -1;
}

#if defined(__AVX512F__)
// VDPBF16PS's operands (attention_packed.cpp, decode_dot.cpp): 32 bf16 (16 pairs) from anywhere (the
// packed operands need not start on a 64-byte line), and one pair (32 bits) in every lane.
inline __m512bh load_pairs(const void* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

inline __m512bh broadcast_pair(uint32_t pair) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
}
#endif

// The largest of a row's scaled scores and the sum of their exponentials, shifted by it: what a
// softmax divides by, and what two parts of one row's attention merge by.
struct Normalizer {
  float max;
  float sum;
};

// Decode rows whose requests begin with the same blocks (a system prompt shared through the prefix
// cache): their shared keys attended once for all of them, as one batch of queries on the tile unit,
// the first part of cascade attention; paged_attention.cpp attends each row's own keys after them and
// merges the two parts by their maxima and sums.
struct SharedPrefixes {
  std::vector<int64_t> keys;  // per row of the call: keys [0, keys) were attended here (0: none)
  std::vector<int64_t> slot;  // per row of the call: its place in the results below, or -1
  std::vector<float> out;     // [slots][heads][head_dim]: each query's exponentials times values, unnormalized
  std::vector<Normalizer> norms;  // [slots][heads]: each query's

  bool empty() const { return slot.empty(); }
};

// SharedPrefixes of `decode_rows` (rows of one query each) over a bf16 cache, for a call without a
// sliding window, over packed keys: groups of at least 4 rows sharing at least 64 keys.
SharedPrefixes attend_shared_prefixes(const Shape& s, const at::BFloat16* q, const at::BFloat16* k_cache,
                                      const at::BFloat16* v_cache, int64_t num_kv_heads, int64_t num_rows,
                                      const int64_t* table, const int64_t* requests, const int64_t* lens,
                                      const std::vector<int64_t>& decode_rows);

// A bf16 decode by VDPBF16PS (decode_dot.cpp), where the CPU has AVX512-BF16 and no tile unit, and the
// shape is one compiled there (1-4 query heads per KV head at head_dim 64, 1-2 at 128): whether a call of
// shape s takes it; the group's scaled scores against keys [begin, len) (q: its bf16 query heads) to
// out [group][len]; and its weighted values, the probabilities bf16 (probs [group][stride] from key
// `begin`, a zero after each row's last), to out [group][head_dim].
bool dot_decodes(const Shape& s);
void dot_decode_scores(const Shape& s, const at::BFloat16* q, int64_t begin, int64_t len, const at::BFloat16* keys,
                       const int64_t* blocks, const Upcoming<at::BFloat16>& next, float* out);
void dot_decode_weigh(const Shape& s, const uint16_t* probs, int64_t stride, int64_t begin, int64_t len,
                      const at::BFloat16* values, const int64_t* blocks, float* out);

// One thread's attention over packed keys and values (attention_packed.cpp), on the AMX tile unit or
// else by VDPBF16PS, over a bf16 cache whose head_dim is a multiple of 32, for one paged_attention call (the caches' contents are the call's). For prefill tiles it keeps, for
// each KV head, the keys and values of the request it last attended, repacked as tile operands, and
// grows them as that request's next tiles read further: a 512-token chunk is 32 tiles, each over every
// key before it. The next request keeps those it reads from the same blocks (a cached prompt prefix).
// A decode reads its keys in place instead (attend_decode): no other row reuses them.
class PackedAttention {
 public:
  PackedAttention(const Shape& s, int64_t num_kv_heads);
  ~PackedAttention();
  PackedAttention(const PackedAttention&) = delete;
  PackedAttention& operator=(const PackedAttention&) = delete;

  // Whether attend_decode takes a call of this shape: a KV head's query heads fit one tile's 16 columns,
  // and 16 keys from a multiple of 16 lie in one block.
  static bool takes_decodes(const Shape& s) { return s.group <= 16 && s.block_size % 16 == 0; }

  // Rows a prefill call takes: two tiles of 16, which share each key and value tile loaded.
  static constexpr int64_t kMaxRows = 32;

  // Rows [0, rows) (at most kMaxRows) of request `request`, at consecutive positions, the first seeing
  // `first_len` keys, against KV head `head`: `q` is the first row's first query head of the KV head
  // (rows s.q_stride apart), `keys`/`values` the head's caches, `blocks` the request's block-table row.
  // Writes the rows' outputs, fp32, to out [kMaxRows][group][head_dim].
  void attend(const at::BFloat16* q, int64_t rows, int64_t first_len, int64_t request, int64_t head,
              const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks, float* out);

  // Up to 16 queries (rows of head_dim bf16, from anywhere) that all see keys [0, shared) through
  // `blocks` (`id` names that prefix among this thread's calls, as `request` does above), against KV head
  // `head`: each query's unnormalized output to outs[i] (head_dim fp32), its normalizer to norms[i].
  void attend_shared(const at::BFloat16* const* queries, int64_t n, int64_t shared, int64_t id, int64_t head,
                     const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks,
                     float* const* outs, Normalizer* norms);

  // One decode row's `group` query heads (`q`: the first, the others after it) against keys
  // [first_key, len) of a KV head (its caches `keys`/`values`, the request's block-table row `blocks`),
  // read in place, with `next`'s context prefetched meanwhile: each head's output, normalized, to
  // out [group][head_dim] fp32 (out must hold 16 rows of head_dim: the tile's rows past `group` are
  // written too, with nothing of use), its normalizer to norms[g]. Needs takes_decodes(s).
  void attend_decode(const at::BFloat16* q, int64_t first_key, int64_t len, const at::BFloat16* keys,
                     const at::BFloat16* values, const int64_t* blocks, const Upcoming<at::BFloat16>& next,
                     float* out, Normalizer* norms);

 private:
  struct Packed {
    int64_t request = -1;
    const int64_t* blocks = nullptr;  // the request's block-table row
    int64_t base = 0;    // the first key packed, a multiple of 32
    int64_t loaded = 0;  // keys [base, loaded) are the cache's; past them, to the 32-key chunk's end, zeros
    std::vector<uint32_t> keys;    // per 16 keys, [head_dim / 2][16]: the keys' dim pairs, transposed
    std::vector<uint16_t> values;  // per 32 keys, [head_dim / 16][16 key pairs][16 dims][2]
  };

  void ensure(Packed& p, int64_t request, int64_t first, int64_t end, const at::BFloat16* keys,
              const at::BFloat16* values, const int64_t* blocks) const;
  void pack_keys(Packed& p, int64_t first, int64_t end, const at::BFloat16* keys, const int64_t* blocks) const;
  void pack_values(Packed& p, int64_t first, int64_t end, const at::BFloat16* values, const int64_t* blocks) const;
  void prepare(int64_t width);
  void score(const uint32_t* keys, int64_t width, int64_t rows, const int64_t* lo, const int64_t* hi);
  void dot_score(const uint32_t* keys, int64_t width, int64_t rows, const int64_t* lo, const int64_t* hi);
  Normalizer exponentials(int64_t row, int64_t lo, int64_t hi, int64_t width);
  void weigh(const uint16_t* values, int64_t width, int64_t rows, float* out, int64_t out_stride);
  void dot_weigh(const uint16_t* values, int64_t width, int64_t rows, float* out, int64_t out_stride);

  const Shape s_;
  const bool amx_;              // the products on the tile unit; else by VDPBF16PS (dot_score, dot_weigh)
  std::vector<Packed> packed_;  // per KV head
  Packed decode_;               // the values of the decode attend_decode last attended
  std::vector<uint16_t> q_;     // one query head's 32 rows, bf16: the scores' A tiles (a decode's B tiles)
  int64_t stride_ = 0;          // elements between the rows of scores_ and probs_ for this tile
  std::vector<float> scores_;   // [kMaxRows][stride_]: the tile's keys from its first
  std::vector<uint16_t> probs_;  // [kMaxRows][stride_]: the exponentials, bf16, zero outside each row's keys
  float tops_[kMaxRows] = {};    // each row's largest score among its keys (score, attend_decode)
  std::vector<float> sums_;      // [16][head_dim]: attend_shared's outputs before they go to their rows
  bool configured_ = false;
};

}  // namespace cadence
