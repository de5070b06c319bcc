// The AMX tile unit (Sapphire Rapids and later), shared by the kernels that use it (bf16_linear.cpp,
// attention_packed.cpp): whether this process may use it, the switch tests and benchmarks turn it off
// with, and the one tile shape they all load.
#pragma once

#include <atomic>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#endif

namespace cadence {

// The CPU has its bf16 tiles, and Linux lets this process use their state (asked once).
inline bool amx_available() {
#if defined(__AVX512F__)
  static const bool available = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           __builtin_cpu_supports("avx512bf16") && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return available;
#else
  return false;  // the AVX2 build over SIMDe
#endif
}

// Whether the kernels take their AMX paths (where the CPU has one): tests and benchmarks compare a
// kernel's two paths in one process (torch.ops.cadence_cpu.use_amx).
inline std::atomic<bool> amx_enabled{true};

inline bool use_amx() { return amx_enabled && amx_available(); }

// The CPU has AVX512-BF16's dot products (VDPBF16PS: two bf16 products summed into each fp32 lane),
// which paged attention's prefill tiles take where it has no tile unit (AMD Zen 4 and later, Cooper
// Lake), and the switch tests and benchmarks compare them with the fp32 path by
// (torch.ops.cadence_cpu.use_bf16_dot).
inline bool bf16_dot_available() {
#if defined(__AVX512F__)
  static const bool available = __builtin_cpu_supports("avx512bf16");
  return available;
#else
  return false;
#endif
}

inline std::atomic<bool> bf16_dot_enabled{true};

inline bool use_bf16_dot() { return bf16_dot_enabled && bf16_dot_available(); }

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("amx-tile")

// A tile is at most 16 rows of 64 bytes: 16 x 32 bf16 (an A operand: rows by k-pairs), 16 k-pairs x
// 16 columns of bf16 pairs (a B operand), or 16 x 16 fp32 sums.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxRowBytes = 64;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles at the full shape. Tile state is per thread: each parallel region that uses tiles
// configures them first (another kernel may have run on the thread since) and releases them after.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kAmxRows;
    config.colsb[t] = kAmxRowBytes;
  }
  _tile_loadconfig(&config);
}

// Not inlined where called: GCC compiles a destructor's clones outside the caller's target pragma.
__attribute__((noinline)) inline void release_tiles() { _tile_release(); }

#pragma GCC pop_options
#endif

}  // namespace cadence
