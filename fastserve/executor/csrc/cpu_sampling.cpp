// Top-p by rejection on CPU (fastserve/executor/draws.py, draw_in_nucleus): each round sums,
// for every row, the probability of the tokens ranked before the token it drew (more likely
// than it, or as likely with a lower id: the stable sort's order). torch needs six passes over
// the batch for it (two comparisons, the ids', the masks' combination, a product, a sum: 3 ms
// at 32 x 32,000 on 2 cores); this is one read of each row.
//
// Each row is summed on one thread in one order whatever the batch holds, so a seeded
// request's tokens do not depend on the rows beside it.
#include "aten_api.h"

namespace {

float mass_before(const float* w, int64_t vocab, int64_t drawn) {
  const float at = w[drawn];  // NOTE: a NaN compares false throughout: a mass of 0
  float below = 0.f, above = 0.f;
#pragma omp simd reduction(+ : below)
  for (int64_t i = 0; i < drawn; ++i) below += w[i] >= at ? w[i] : 0.f;
#pragma omp simd reduction(+ : above)
  for (int64_t i = drawn + 1; i < vocab; ++i) above += w[i] > at ? w[i] : 0.f;
  return below + above;
}

}  // namespace

// probs [n, vocab] float32 (rows contiguous), drawn [n] long in [0, vocab): [n] float32.
torch::Tensor nucleus_mass(torch::Tensor probs, torch::Tensor drawn) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.stride(1) == 1,
              "nucleus_mass: probs must be [n, vocab] float32 with contiguous rows");
  TORCH_CHECK(drawn.dim() == 1 && drawn.scalar_type() == torch::kLong &&
                  drawn.size(0) == probs.size(0),
              "nucleus_mass: drawn must be [n] long, one per row of probs");
  const int64_t rows = probs.size(0), vocab = probs.size(1), stride = probs.stride(0);
  auto ids = drawn.contiguous();
  const int64_t* d = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(d[r] >= 0 && d[r] < vocab, "nucleus_mass: drawn token ", d[r],
                " outside the vocabulary of ", vocab);
  auto out = torch::empty({rows}, probs.options());
  const float* w = probs.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = mass_before(w + r * stride, vocab, d[r]);
  });
  return out;
}
