// Rows of a quantized weight, dequantized: the embedding lookup of a quantized vocabulary.
//
// cadence/quantization/packed.py: unpack_rows computes the same in torch ops (a dozen calls over
// gathers and reshapes: 0.37 ms of a 7.7 ms one-token decode step on SmolLM2); this reads the bytes
// of the asked rows straight from the packed layout (quant_linear.cpp describes it), value =
// code * scale + minimum in float32 (the symmetric forms' minimum -2^(bits-1) * scale), then
// rounded to the output dtype: the torch path's values, bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroupPanels = 4;
constexpr int64_t kStepBytes = 64;  // one step: 4 columns of 16 rows

float half_at(const uint8_t* bytes) {
  at::Half value;
  std::memcpy(&value, bytes, sizeof(value));
  return static_cast<float>(value);
}

// The code of the row in lane `lane` of its panel, for column 4 * step + j of one block whose
// codes start at `body`.
int code_at(const uint8_t* body, int64_t lane, int64_t step, int64_t j, int64_t bits, int64_t steps) {
  const int64_t at = lane * 4 + j;
  if (bits == 8) return body[step * kStepBytes + at];
  const int64_t half = steps / 2;  // step s shares its byte with step s + half: low and high nibble
  const uint8_t nibbles = body[(step % half) * kStepBytes + at];
  int code = step < half ? nibbles & 0xF : nibbles >> 4;
  if (bits > 4) {
    const int64_t high_bits = bits - 4, per = bits == 5 ? 8 : 4;  // steps per vector of high bits
    const uint8_t high = body[steps * kStepBytes / 2 + (step / per) * kStepBytes + at];
    code |= ((high >> ((step % per) * high_bits)) & ((1 << high_bits) - 1)) << 4;
  }
  return code;
}

template <typename scalar_t>
void unpack_row(const uint8_t* packed, int64_t row, int64_t blocks, int64_t run_bytes, int64_t cols, int64_t bits,
                int64_t block, bool symmetric, scalar_t* out) {
  const int64_t group = row / (kLanes * kGroupPanels), panel = row / kLanes % kGroupPanels, lane = row % kLanes;
  const int64_t header = (symmetric ? 1 : 2) * 2 * kLanes, steps = block / 4;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* run = packed + ((group * blocks + b) * kGroupPanels + panel) * run_bytes;
    const float scale = half_at(run + 2 * lane);
    const float minimum = symmetric ? -static_cast<float>(1 << (bits - 1)) * scale : half_at(run + 2 * kLanes + 2 * lane);
    for (int64_t step = 0; step < steps; ++step) {
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t col = b * block + 4 * step + j;
        if (col >= cols) return;
        const float scaled = static_cast<float>(code_at(run + header, lane, step, j, bits, steps)) * scale;
        out[col] = static_cast<scalar_t>(scaled + minimum);
      }
    }
  }
}

// packed [groups, blocks, 4, bytes] uint8 (packed.py: QuantizedMatrix.packed), rows [T] int64 ->
// [T, cols] of dtype (float32 or bfloat16).
at::Tensor quant_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t cols, int64_t bits, int64_t block,
                      bool symmetric, at::ScalarType dtype) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroupPanels && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "quant_rows: packed must be a dense [groups, blocks, 4, bytes] uint8");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "quant_rows: rows must be [T] int64");
  TORCH_CHECK((bits == 4 || bits == 5 || bits == 6 || bits == 8) && block % 8 == 0 &&
                  cols <= packed.size(1) * block, "quant_rows: no layout of ", bits, "-bit codes in blocks of ", block);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_rows: float32 or bfloat16 out");
  const at::Tensor ids = rows.contiguous();
  const int64_t count = ids.size(0), blocks = packed.size(1), run_bytes = packed.size(3);
  const int64_t limit = packed.size(0) * kLanes * kGroupPanels;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < limit, "quant_rows: row ", id[t], " out of range");
  at::Tensor out = at::empty({count, cols}, packed.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "quant_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const uint8_t* p = packed.data_ptr<uint8_t>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) unpack_row(p, id[t], blocks, run_bytes, cols, bits, block, symmetric, o + t * cols);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("quant_rows(Tensor packed, Tensor rows, int cols, int bits, int block, bool symmetric, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("quant_rows", quant_rows); }
