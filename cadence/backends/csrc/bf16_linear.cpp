// bf16 GEMM for linear layers on x86 CPUs with AVX512-BF16: y = x @ W.T (+ bias), fp32 accumulation.
//
// The weight is packed once into panels of 48 output columns. Within a panel, each pair of input
// features k, k+1 holds the 48 columns' two weights side by side: three 64-byte vectors, exactly
// the operands of three VDPBF16PS. A thread owns whole panels, so each weight byte is read from
// memory once per call (once per 256 rows of x), by one core. For each panel the rows of x go 8 at
// a time: 24 fp32 accumulators (8 rows x 48 columns) stay in registers while the panel's vectors
// stream from L1/L2, and the next panel is prefetched a few lines per step so that the weights
// (which do not fit in the caches: 270 MB per decode step for SmolLM2) arrive while this one
// computes.
//
// Measured here by benchmarks/cpu_kernels.py (2 Zen 5 cores, SmolLM2's shapes, all 30 layers):
// 889-946 GFLOP/s at 64 rows against 684-716 for oneDNN's prepacked GEMM; at 2,048 rows, which go
// in L2-sized blocks of 256, 917 against 884-897. Each output is one fixed sequence of fp32 adds,
// whatever the batch. Built on first use by cadence/backends/cpu_kernels.py; registered as
// torch.ops.cadence_cpu.*.
//
// On CPUs with AMX (Sapphire Rapids and later) the same panels go through the tile unit instead
// (amx_linear below) wherever the input width is a multiple of 32: on 2 such cores, the same
// benchmark gave 1,048 GFLOP/s at 64 rows against 231 by VDPBF16PS and 931 for oneDNN (which takes
// AMX too), 1,740 at 2,048 rows (oneDNN 2,241), and one row 11.1 ms against 12.8 for the 30 layers.
// Past 16 rows (since 2026-12-06: past kPanelRowsMax, or kSiluPanelRowsMax for gate/up with SiLU) the
// tiles go two row tiles by two column blocks with x streamed (amx_block_tiles):
// on a slower hour of that VM, 1.12-1.21x oneDNN's speed at 64 rows (before: 0.75-0.85x) and
// 0.88-0.98x at 2,048 (before: 0.83-0.87x), the same bits. Each unit of column blocks fetches the
// next one's into L2 while it computes (UnitBlocks): a layer's four GEMMs, 30 layers in turn, took
// 13.4-13.7 ms at 64 rows against 14.4-14.8 and 48.4-48.7 at 512 against 55.1-57.0.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Outside the target region below: called on every CPU (the kernels' AVX2 build loads this file on
// CPUs without AVX-512, where code of that region must never run).
bool bf16_linear_supported() { return __builtin_cpu_supports("avx512bf16"); }

// Whether the kernels with an AMX path (this GEMM, paged attention's prefill tiles) take it from now
// on, where the CPU has one: tests and benchmarks compare the two paths in one process. Returns
// whether they will.
bool use_amx(bool enable) {
  cadence::amx_enabled = enable;
  return cadence::use_amx();
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace {

constexpr int64_t kPanelCols = 48;  // three vectors of 16 fp32 lanes
constexpr int64_t kPanelVecs = kPanelCols / 16;
constexpr int64_t kTileRows = 8;  // 8 x 3 accumulators + 3 weight vectors + 1 broadcast: 28 of 32 registers
constexpr int64_t kLine = 64;
constexpr int64_t kRowBlock = 256;  // 256 rows of K=576 take 288 KiB
// Below kTileRows rows a call is bound by reading the weights, and a thread's panels are one run of
// memory: each pair step fetches its own 192 bytes this far ahead into L2. The hardware prefetchers
// alone (which stop at every 4-KiB page) streamed 30 layers' and the LM head's 269 MB at one row in
// 9.5-12.0 ms; 6 KiB ahead 8.5-10.7 (5 KiB 2% slower than 6; 3, 4, 7, 8 and 16 KiB 4-13%; into L1
// or non-temporal: slower than none), and one bf16 stream decoded at 87 tok/s against 77 (2026-12-07, AMD EPYC).
constexpr int64_t kStreamAhead = 6144;

// W [N, K] bf16 -> [ceil(N/48), ceil(K/2), 48, 2], zero-padded (padding columns are never stored).
at::Tensor pack_bf16_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_linear: a [N, K] bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({panels * kPanelCols, pairs * 2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({panels, kPanelCols, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// One row of a panel's fp32 sums (its first `cols` columns), plus the bias, rounded to bf16 into
// `out`: how both paths end.
void store_panel_row(const __m512* acc, at::BFloat16* out, int64_t cols, const at::BFloat16* bias) {
  for (int v = 0; v < kPanelVecs && 16 * v < cols; ++v) {
    const __mmask16 m = cadence::tail_mask(cols - 16 * v);
    cadence::store16(out + 16 * v, bias ? _mm512_add_ps(acc[v], cadence::load16(bias + 16 * v, m)) : acc[v], m);
  }
}

// Rows [0, R) of x against one panel: out[r, c] = bias[c] + sum_k x[r, k] * panel[k, c] for c < cols.
// x holds each row's k-pairs as int32 (two bf16), `row_pairs` apart. While it runs, it prefetches
// `fetch_per_pair` lines of `prefetch` per pair step.
template <int R>
void panel_tile(const int32_t* x, int64_t row_pairs, const __m512bh* panel, int64_t pairs, at::BFloat16* out,
                int64_t out_stride, int64_t cols, const at::BFloat16* bias, const char* prefetch,
                int64_t fetch_per_pair) {
  __m512 acc[R][kPanelVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < fetch_per_pair; ++i) _mm_prefetch(prefetch + (p * fetch_per_pair + i) * kLine, _MM_HINT_T1);
    const __m512bh w0 = panel[kPanelVecs * p], w1 = panel[kPanelVecs * p + 1], w2 = panel[kPanelVecs * p + 2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[r * row_pairs + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store_panel_row(acc[r], out + r * out_stride, cols, bias);
}

using PanelTile = void (*)(const int32_t*, int64_t, const __m512bh*, int64_t, at::BFloat16*, int64_t, int64_t,
                           const at::BFloat16*, const char*, int64_t);
constexpr PanelTile kTiles[kTileRows + 1] = {nullptr,        panel_tile<1>, panel_tile<2>, panel_tile<3>, panel_tile<4>,
                                             panel_tile<5>, panel_tile<6>, panel_tile<7>, panel_tile<8>};

}  // namespace

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace {

// The AMX path: TDPBF16PS over the same panels. A B tile is 16 k-pairs of 16 columns, two bf16
// each: in a panel, 64 bytes of every pair's 192, so each of the panel's three column blocks loads
// straight from it with a 192-byte stride. Tiles 0-2 hold a 16-row x 48-column block of fp32 sums,
// 3 the rows' next 32 input features, 4-6 the panel's. Every output is the same sequence of tile
// steps whatever the batch (a row of sums depends only on its own row of x, and rows past the batch
// are never stored), so it is batch-invariant as the
// VDPBF16PS path is, though the two round differently (a tile step adds both products of a pair to
// the sum; VDPBF16PS adds them one at a time).
using cadence::configure_tiles;
using cadence::kAmxRows;
constexpr int64_t kAmxPairs = 16;
// Up to this many rows a thread owns whole panels and runs each over the rows 16 at a time: a panel
// is one contiguous run of the weight, which the hardware prefetchers stream at the memory's speed
// (the LM head's 57 MB at 22 GB/s up to 16 rows). Column blocks in pairs (below) read 64 bytes of every
// 192 and streamed at 13-16 GB/s: 17 to 32 rows of the LM head took 3.1 ms by panels against 3.6-3.8,
// 64 rows 4.0-4.2 against 4.2-4.4, and 30 layers at 64 rows 13.6-14.4 ms against 14.4-15.1. Past it
// the pairs' reuse of each weight tile across rows wins.
constexpr int64_t kPanelRowsMax = 64;
// Up to this many rows gate/up goes by panels too, then through silu_and_mul (the same bits as the
// fused pass): 30 layers' GEMMs at 17 rows 11.2-11.3 ms against 12.2-12.7 fused, at 32 rows 10.5-10.7
// against 11.0-11.4; at 64 rows the fused pass won (12.5-13.1 against 13.7-14.1).
constexpr int64_t kSiluPanelRowsMax = 32;

// Rows [0, m) (m <= 16) of x (`x_stride` bf16 apart; 16 rows readable) against one panel.
void amx_panel_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* panel, int64_t pairs,
                    at::BFloat16* out, int64_t out_stride, int64_t m, int64_t cols, const at::BFloat16* bias,
                    float* sums) {
  constexpr int64_t kPairBytes = kPanelCols * 2 * sizeof(at::BFloat16);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    const at::BFloat16* w = panel + p * kPanelCols * 2;
    _tile_loadd(3, x + 2 * p, x_stride * sizeof(at::BFloat16));
    _tile_loadd(4, w, kPairBytes);
    _tile_loadd(5, w + 32, kPairBytes);
    _tile_loadd(6, w + 64, kPairBytes);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  constexpr int64_t kSumBytes = kPanelCols * sizeof(float);
  _tile_stored(0, sums, kSumBytes);
  _tile_stored(1, sums + 16, kSumBytes);
  _tile_stored(2, sums + 32, kSumBytes);
  for (int64_t r = 0; r < m; ++r) {
    __m512 acc[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) acc[v] = cadence::load16(sums + r * kPanelCols + 16 * v);
    store_panel_row(acc, out + r * out_stride, cols, bias);
  }
}

// A batch of more rows goes by two 16-row tiles of x against two 16-column blocks: four sum tiles,
// the two A tiles and the two B tiles. A thread runs its blocks over every 32 rows of a 256-row
// block in turn, and the A tiles are loaded with the streaming hint (TILELOADDT1), so that the two
// B blocks (36 KiB at K=576) stay in L1 while x passes through from L2. With plain loads x's tiles
// evicted them, every operand came from L2, and the tile unit waited on it: half its peak at
// best, with one A tile and three B tiles a panel, or the same with two and two.
constexpr int64_t kBlockCols = 16;

// Column block b of a packed weight: its 16 columns' pairs, 64 bytes of each of its panel's 192.
const at::BFloat16* column_block(const at::BFloat16* packed, int64_t pairs, int64_t b) {
  return packed + (b / 3) * pairs * kPanelCols * 2 + (b % 3) * 2 * kBlockCols;
}

// One row of a gate block's and an up block's sums (16 columns each, `sums` and `sums + 16`) plus
// their biases, rounded as bf16_linear stores them, then silu_and_mul's arithmetic: the same bits as
// the two kernels, without the gate/up output's trip through memory.
void store_silu_row(const float* sums, at::BFloat16* out, const at::BFloat16* gate_bias, const at::BFloat16* up_bias) {
  __m512 gate = cadence::load16(sums), up = cadence::load16(sums + kBlockCols);
  if (gate_bias) {
    gate = _mm512_add_ps(gate, cadence::load16(gate_bias));
    up = _mm512_add_ps(up, cadence::load16(up_bias));
  }
  gate = cadence::round_to<at::BFloat16>(gate);
  const __m512 silu = cadence::round_to<at::BFloat16>(cadence::silu16(gate));
  cadence::store16(out, _mm512_mul_ps(silu, cadence::round_to<at::BFloat16>(up)));
}

constexpr int64_t kSumCols = 2 * kBlockCols;  // a row group's sums: 32 rows of 32 columns

// A row group's sums whose rows are still to be stored. They are stored a few at a time inside the
// next group's tile loop, so that the vector work (SiLU's exponentials above all) runs while the
// tile unit computes instead of between its products.
struct PendingRows {
  const float* sums = nullptr;
  at::BFloat16* out = nullptr;
  int64_t out_stride = 0, cols = 0, next = 0, end = 0;
  const at::BFloat16* bias = nullptr;
  const at::BFloat16* up_bias = nullptr;
  bool silu = false;  // a gate block and its up block, stored as silu(gate) * up

  void store(int64_t count) {
    for (const int64_t stop = std::min(end, next + count); next < stop; ++next) {
      const float* row = sums + next * kSumCols;
      at::BFloat16* out_row = out + next * out_stride;
      if (silu) {
        store_silu_row(row, out_row, bias, up_bias);
      } else {
        const __m512 acc[kPanelVecs] = {cadence::load16(row), cadence::load16(row + kBlockCols), _mm512_setzero_ps()};
        store_panel_row(acc, out_row, cols, bias);
      }
    }
  }
};

// A unit's column blocks (the second may be absent). A thread fetches its next unit's into L2 a few
// lines per tile step while this one computes: a unit's blocks are 64 bytes of every 192 of their
// panels, which the hardware prefetchers do not run ahead on, and each unit would otherwise begin by
// waiting on memory for them.
struct UnitBlocks {
  const at::BFloat16* block[2] = {nullptr, nullptr};
  int64_t next = 0, end = 0;  // lines: [0, pairs) the first block's, [pairs, 2 pairs) the second's

  void fetch(int64_t count, int64_t pairs) {
    for (const int64_t stop = std::min(end, next + count); next < stop; ++next) {
      const int64_t line = next % pairs;
      _mm_prefetch(reinterpret_cast<const char*>(block[next / pairs] + line * kPanelCols * 2), _MM_HINT_T1);
    }
  }
};

// kRowTiles 16-row tiles of x (tile i from a[i], `a_stride[i]` bf16 apart) against kBlocks column
// blocks from b[0..kBlocks), their sums into `sums` (tile (i, c) at row 16 i, column 16 c), while
// `pending` is stored.
template <int kRowTiles, int kBlocks>
void amx_block_tiles(const at::BFloat16* const* a, const int64_t* a_stride, const at::BFloat16* const* b,
                     int64_t pairs, float* sums, PendingRows& pending, UnitBlocks& fetch, int64_t fetch_per_step) {
  constexpr int64_t kPairBytes = kPanelCols * 2 * sizeof(at::BFloat16);
  const int64_t steps = pairs / kAmxPairs, per_step = (pending.end - pending.next + steps - 1) / steps;
  _tile_zero(0);
  if constexpr (kBlocks == 2) _tile_zero(1);
  if constexpr (kRowTiles == 2) _tile_zero(2);
  if constexpr (kRowTiles == 2 && kBlocks == 2) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    _tile_stream_loadd(4, a[0] + 2 * p, a_stride[0] * sizeof(at::BFloat16));
    if constexpr (kRowTiles == 2) _tile_stream_loadd(5, a[1] + 2 * p, a_stride[1] * sizeof(at::BFloat16));
    _tile_loadd(6, b[0] + p * kPanelCols * 2, kPairBytes);
    if constexpr (kBlocks == 2) _tile_loadd(7, b[1] + p * kPanelCols * 2, kPairBytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kBlocks == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kRowTiles == 2 && kBlocks == 2) _tile_dpbf16ps(3, 5, 7);
    pending.store(per_step);
    fetch.fetch(fetch_per_step, pairs);
  }
  pending.store(pending.end);
  constexpr int64_t kSumBytes = kSumCols * sizeof(float);
  _tile_stored(0, sums, kSumBytes);
  if constexpr (kBlocks == 2) _tile_stored(1, sums + kBlockCols, kSumBytes);
  if constexpr (kRowTiles == 2) _tile_stored(2, sums + kAmxRows * kSumCols, kSumBytes);
  if constexpr (kRowTiles == 2 && kBlocks == 2) _tile_stored(3, sums + kAmxRows * kSumCols + kBlockCols, kSumBytes);
}

// bf16_linear's AMX path: x [rows, 2 * pairs] with unit column stride, pairs a multiple of 16. With
// `silu_half` (a multiple of 16) the weight's rows are a gate half and an up half of that many each,
// and out [rows, silu_half] gets silu(gate) * up.
void amx_linear(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* packed, int64_t panels,
                int64_t pairs, at::BFloat16* out, int64_t out_features, const at::BFloat16* bias,
                int64_t silu_half = 0) {
  const int64_t tail_first = rows - rows % kAmxRows;
  const int64_t blocks = (out_features + kBlockCols - 1) / kBlockCols;  // those past it are padding
  // Up to kPanelRowsMax rows a thread owns whole panels (the weights' stream decides there); past
  // that, and always for gate/up with SiLU (which bf16_linear_silu sends past kSiluPanelRowsMax rows),
  // pairs of column blocks: two side by side, or a gate block and its up block.
  const bool silu = silu_half > 0, by_blocks = silu || rows > kPanelRowsMax;
  const int64_t units = silu ? silu_half / kBlockCols : (blocks + 1) / 2;
  at::parallel_for(0, by_blocks ? units : panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // tile state is per thread
    alignas(64) float sums[4 * kAmxRows * kSumCols];  // two row groups' (a panel's 16 rows take less)
    // A tile reads 16 rows: the last few rows of x go from a copy 16 rows long, kept by the thread
    // (what its rows past the batch hold only reaches sums that are never stored). A decode step's
    // linears would otherwise each allocate and clear one.
    thread_local std::vector<at::BFloat16> tail;
    if (tail_first < rows) {
      tail.resize(std::max<size_t>(tail.size(), kAmxRows * 2 * pairs));
      for (int64_t r = tail_first; r < rows; ++r) {
        std::copy_n(x + r * x_stride, 2 * pairs, tail.data() + (r - tail_first) * 2 * pairs);
      }
    }
    const auto tile_rows = [&](int64_t r0) { return r0 < tail_first ? x + r0 * x_stride : tail.data(); };
    const auto tile_stride = [&](int64_t r0) { return r0 < tail_first ? x_stride : 2 * pairs; };
    if (!by_blocks) {
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
          amx_panel_rows(tile_rows(r0), tile_stride(r0), packed + j * pairs * kPanelCols * 2, pairs,
                         out + r0 * out_features + j * kPanelCols, out_features, std::min(kAmxRows, rows - r0),
                         std::min(kPanelCols, out_features - j * kPanelCols), bias ? bias + j * kPanelCols : nullptr, sums);
        }
      }
    }
    // Unit j's column blocks: two side by side, or a gate block and its up block.
    const auto first_block = [&](int64_t j) { return silu ? j : 2 * j; };
    const auto unit_blocks = [&](int64_t j) {
      const int64_t first = first_block(j), second = silu ? j + units : 2 * j + 1;
      return UnitBlocks{{column_block(packed, pairs, first), second < blocks ? column_block(packed, pairs, second) : nullptr},
                        0, second < blocks ? 2 * pairs : pairs};
    };
    PendingRows pending;
    int64_t groups = 0;  // row groups run, alternating between two halves of `sums`
    for (int64_t first_row = 0; by_blocks && first_row < rows; first_row += kRowBlock) {
      const int64_t block_end = std::min(rows, first_row + kRowBlock);
      const int64_t block_steps = (block_end - first_row + 2 * kAmxRows - 1) / (2 * kAmxRows) * (pairs / kAmxPairs);
      for (int64_t j = begin; j < end; ++j) {
        const int64_t col = first_block(j) * kBlockCols;
        const int64_t cols = silu ? kBlockCols : std::min(2 * kBlockCols, out_features - col);
        const int64_t out_stride = silu ? silu_half : out_features;
        const UnitBlocks own = unit_blocks(j);
        const at::BFloat16* const* b = own.block;
        const bool two_blocks = b[1] != nullptr;
        // The next unit this thread runs: the next one here, or its first in the next row block.
        const bool last_unit = j + 1 == end;
        UnitBlocks fetch = last_unit && block_end == rows ? UnitBlocks{} : unit_blocks(last_unit ? begin : j + 1);
        const int64_t fetch_per_step = (fetch.end + block_steps - 1) / block_steps;
        const at::BFloat16* bias_j = bias ? bias + col : nullptr;
        const at::BFloat16* up_bias = silu && bias ? bias + silu_half + col : nullptr;
        for (int64_t r0 = first_row; r0 < block_end; r0 += 2 * kAmxRows) {
          const at::BFloat16* a[2] = {tile_rows(r0), tile_rows(r0 + kAmxRows)};
          const int64_t a_stride[2] = {tile_stride(r0), tile_stride(r0 + kAmxRows)};
          const int64_t m[2] = {std::min(kAmxRows, block_end - r0), std::min(kAmxRows, block_end - r0 - kAmxRows)};
          const bool two_tiles = m[1] > 0;
          float* group_sums = sums + (groups++ % 2) * 2 * kAmxRows * kSumCols;
          if (two_tiles && two_blocks) {
            amx_block_tiles<2, 2>(a, a_stride, b, pairs, group_sums, pending, fetch, fetch_per_step);
          } else if (two_tiles) {
            amx_block_tiles<2, 1>(a, a_stride, b, pairs, group_sums, pending, fetch, fetch_per_step);
          } else if (two_blocks) {
            amx_block_tiles<1, 2>(a, a_stride, b, pairs, group_sums, pending, fetch, fetch_per_step);
          } else {
            amx_block_tiles<1, 1>(a, a_stride, b, pairs, group_sums, pending, fetch, fetch_per_step);
          }
          pending = {group_sums, out + r0 * out_stride + col, out_stride, cols, 0, m[0] + std::max<int64_t>(m[1], 0),
                     bias_j, up_bias, silu};
        }
      }
    }
    pending.store(pending.end);
    _tile_release();
  });
}

}  // namespace

#pragma GCC pop_options
#endif

namespace {

// x [M, K] bf16 checked against a weight packed from pack_bf16_linear of `out_features` rows and its
// bias, and given dense rows that start on 4-byte boundaries (pairs are read as int32).
at::Tensor checked_input(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanelCols && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && (out_features + kPanelCols - 1) / kPanelCols == packed.size(0),
              "bf16_linear: the weight must come from pack_bf16_linear of ", out_features, " rows");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) == 2 * packed.size(1),
              "bf16_linear: x must be [M, ", 2 * packed.size(1), "] bf16");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == at::kBFloat16),
              "bf16_linear: bias must be dense [", out_features, "] bf16");
  const bool pair_aligned = x_in.stride(1) == 1 && x_in.stride(0) % 2 == 0 &&
                            reinterpret_cast<uintptr_t>(x_in.data_ptr()) % 4 == 0;
  return pair_aligned ? x_in : x_in.contiguous();
}

// x [M, K] bf16 (dense rows), packed from pack_bf16_linear of a [out_features, K] weight, bias
// [out_features] bf16 or None -> [M, out_features] bf16.
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  const at::Tensor x = checked_input(x_in, packed, bias, out_features);
  const int64_t rows = x.size(0), panels = packed.size(0), pairs = packed.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
#if defined(__AVX512F__)
  if (pairs % kAmxPairs == 0 && cadence::use_amx()) {
    amx_linear(x.data_ptr<at::BFloat16>(), x.stride(0), rows, packed.data_ptr<at::BFloat16>(), panels, pairs,
               out.data_ptr<at::BFloat16>(), out_features, bias ? bias->data_ptr<at::BFloat16>() : nullptr);
    return out;
  }
#endif
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t row_pairs = x.stride(0) / 2;
  const __m512bh* w = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const at::BFloat16* b = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
  const int64_t panel_vecs = pairs * kPanelVecs;  // also the panel's 64-byte lines
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Rows go in blocks small enough to stay in L2 while the thread's panels pass over them.
    for (int64_t first_row = 0; first_row < rows; first_row += kRowBlock) {
      const int64_t block_rows = std::min(kRowBlock, rows - first_row);
      const int64_t tiles = (block_rows + kTileRows - 1) / kTileRows;
      // A few rows (one tile) are bound by the weights' memory traffic: each pair step fetches the
      // weights kStreamAhead bytes on. More rows fetch the next panel over the panel's tiles.
      const bool streaming = block_rows < kTileRows;
      const int64_t fetch_per_pair = streaming ? kPanelVecs : (panel_vecs + tiles * pairs - 1) / (tiles * pairs);
      for (int64_t j = begin; j < end; ++j) {
        const __m512bh* panel = w + j * panel_vecs;
        const char* next = reinterpret_cast<const char*>(streaming ? panel : panel + panel_vecs);
        const int64_t cols = std::min(kPanelCols, out_features - j * kPanelCols);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = first_row + t * kTileRows;
          // tile t fetches lines [first_line, first_line + pairs * fetch_per_pair) from `next`
          const int64_t first_line = streaming ? kStreamAhead / kLine : t * pairs * fetch_per_pair;
          const bool fetching = streaming || (j + 1 < end && first_line < panel_vecs);
          kTiles[std::min(kTileRows, rows - r0)](xp + r0 * row_pairs, row_pairs, panel, pairs,
                                                 o + r0 * out_features + j * kPanelCols, out_features, cols,
                                                 b ? b + j * kPanelCols : nullptr,
                                                 fetching ? next + first_line * kLine : nullptr, fetching ? fetch_per_pair : 0);
        }
      }
    }
  });
  return out;
}

// silu_and_mul(bf16_linear(x, packed, bias, out_features)) of a fused [gate | up] weight: [M, out_features / 2].
// Past kSiluPanelRowsMax rows on the AMX path, with halves of whole column blocks, in one pass
// (amx_linear's silu_half): the same bits, without writing the gate/up output and reading it back.
at::Tensor bf16_linear_silu(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(out_features % 2 == 0, "bf16_linear_silu: the weight's rows must be a gate half and an up half");
  const at::Tensor x = checked_input(x_in, packed, bias, out_features);
  const int64_t rows = x.size(0), half = out_features / 2;
  at::Tensor out = at::empty({rows, half}, x.options());
#if defined(__AVX512F__)
  if (rows > kSiluPanelRowsMax && half % kBlockCols == 0 && packed.size(1) % kAmxPairs == 0 && cadence::use_amx()) {
    amx_linear(x.data_ptr<at::BFloat16>(), x.stride(0), rows, packed.data_ptr<at::BFloat16>(), packed.size(0),
               packed.size(1), out.data_ptr<at::BFloat16>(), out_features,
               bias ? bias->data_ptr<at::BFloat16>() : nullptr, half);
    return out;
  }
#endif
  static const auto silu_and_mul = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("cadence_cpu::silu_and_mul", "")
                                       .typed<void(const at::Tensor&, const at::Tensor&)>();
  silu_and_mul.call(out, bf16_linear(x, packed, bias, out_features));
  return out;
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("bf16_linear_supported() -> bool", bf16_linear_supported);  // no tensors: callable on any dispatch key
  m.def("use_amx(bool enable) -> bool", use_amx);
  m.def("pack_bf16_linear(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) {
  m.impl("pack_bf16_linear", pack_bf16_linear);
  m.impl("bf16_linear", bf16_linear);
  m.impl("bf16_linear_silu", bf16_linear_silu);
}
