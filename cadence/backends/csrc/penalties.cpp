// The sampler's repetition, frequency and presence penalties on the CPU, in place, row by row over the
// tokens each row has seen (cadence/executor/sampling_plan.py: _apply_penalties, whose torch ops made
// flat row * V + token ids, sorted them with torch.unique and gathered and scattered through them: 4.5
// ms for 64 rows of 384 tokens at a repetition penalty on 2 AMD EPYC cores). Here each row counts its
// output tokens in an array of the vocabulary's size kept per thread, changes each seen logit once (a
// flag per token), and clears what it touched. The same values as the torch ops: repetition first
// (HF / vLLM: a logit above 0 divided by the factor, else multiplied), then frequency per occurrence in
// the output plus presence once (OpenAI), subtracted as torch adds their negation.
// Built on first use by cadence/backends/cpu_kernels.py; registered as torch.ops.cadence_cpu.*.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

struct Seen {
  std::vector<int32_t> count;  // per token: occurrences in the row's output
  std::vector<uint8_t> done;   // per token: changed already
};

// ids[offsets[j], offsets[j + 1]): the j-th penalized row's tokens.
void penalize_row(float* logits, int64_t vocab, const int64_t* prompt, int64_t prompt_len, const int64_t* output,
                  int64_t output_len, const float* repetition, const float* frequency, const float* presence,
                  Seen& seen) {
  for (int64_t i = 0; i < output_len; ++i) ++seen.count[output[i]];
  const auto change = [&](int64_t token) {
    if (seen.done[token]) return;
    seen.done[token] = 1;
    float v = logits[token];
    if (repetition) v = v > 0 ? v / *repetition : v * *repetition;
    if (frequency && seen.count[token] > 0) {
      v = v + -(*frequency * static_cast<float>(seen.count[token]) + *presence);
    }
    logits[token] = v;
  };
  for (int64_t i = 0; i < output_len; ++i) change(output[i]);
  if (repetition) {
    for (int64_t i = 0; i < prompt_len; ++i) change(prompt[i]);
  }
  for (int64_t i = 0; i < output_len; ++i) seen.count[output[i]] = 0, seen.done[output[i]] = 0;
  for (int64_t i = 0; i < prompt_len && repetition; ++i) seen.done[prompt[i]] = 0;
}

void check_ids(const at::Tensor& ids, const at::Tensor& offsets, int64_t rows, int64_t vocab, const char* what) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "apply_penalties: ", what,
              " ids must be 1-D int64");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.size(0) == rows + 1,
              "apply_penalties: ", what, " offsets must be [rows + 1] int64");
  TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab),
              "apply_penalties: ", what, " ids must be tokens of the vocabulary");
}

// logits [B, V] fp32 contiguous, changed in place at rows[j] from its prompt's and output's ids (flat, with
// offsets [R + 1]); repetition, frequency, presence: None or [B] fp32 (frequency and presence together).
void apply_penalties(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& prompt_ids,
                     const at::Tensor& prompt_offsets, const at::Tensor& output_ids, const at::Tensor& output_offsets,
                     const std::optional<at::Tensor>& repetition, const std::optional<at::Tensor>& frequency,
                     const std::optional<at::Tensor>& presence) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_penalties: logits must be [B, V] float32, contiguous");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_penalties: rows must be 1-D int64");
  TORCH_CHECK(frequency.has_value() == presence.has_value(), "apply_penalties: frequency and presence together");
  const int64_t batch = logits.size(0), vocab = logits.size(1), count = rows.size(0);
  check_ids(prompt_ids, prompt_offsets, count, vocab, "prompt");
  check_ids(output_ids, output_offsets, count, vocab, "output");
  for (const auto* factors : {&repetition, &frequency, &presence}) {
    TORCH_CHECK(!*factors || ((*factors)->dim() == 1 && (*factors)->scalar_type() == at::kFloat &&
                              (*factors)->is_contiguous() && (*factors)->size(0) == batch),
                "apply_penalties: each penalty must be [B] float32");
  }
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t *p = prompt_ids.data_ptr<int64_t>(), *po = prompt_offsets.data_ptr<int64_t>();
  const int64_t *o = output_ids.data_ptr<int64_t>(), *oo = output_offsets.data_ptr<int64_t>();
  const float* rep = repetition ? repetition->data_ptr<float>() : nullptr;
  const float* freq = frequency ? frequency->data_ptr<float>() : nullptr;
  const float* pres = presence ? presence->data_ptr<float>() : nullptr;
  float* x = logits.data_ptr<float>();
  for (int64_t j = 0; j < count; ++j) TORCH_CHECK(r[j] >= 0 && r[j] < batch, "apply_penalties: a row out of range");
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Seen seen{std::vector<int32_t>(vocab), std::vector<uint8_t>(vocab)};
    for (int64_t j = begin; j < end; ++j) {
      const int64_t b = r[j];
      penalize_row(x + b * vocab, vocab, p + po[j], po[j + 1] - po[j], o + oo[j], oo[j + 1] - oo[j],
                   rep ? rep + b : nullptr, freq ? freq + b : nullptr, pres ? pres + b : nullptr, seen);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence_cpu, m) {
  m.def("apply_penalties(Tensor(a!) logits, Tensor rows, Tensor prompt_ids, Tensor prompt_offsets, Tensor output_ids, "
        "Tensor output_offsets, Tensor? repetition, Tensor? frequency, Tensor? presence) -> ()");
}

TORCH_LIBRARY_IMPL(cadence_cpu, CPU, m) { m.impl("apply_penalties", apply_penalties); }
