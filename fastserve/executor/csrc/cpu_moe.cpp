// A mixture of experts' routed half in one call on a CPU with AVX-512 BF16: the router and
// its choices, the (token, choice) pairs grouped by expert, the grouped matmuls, SiLU-and-mul,
// and each token's weighted sum of its choices.
//
// Why: at decode the block's torch ops around the matmuls (route, sort, count, gather, pad,
// scale, scatter, sum: ~25 dispatches from Python) took longer than the experts' matmuls
// themselves, 580 us a layer against 550 at one token on a 2-core Sapphire Rapids, each op
// slowed by the caches the weights had just swept.
//
// The results are those of the block's torch path (fastserve/model/mlp.py) bit for bit: the
// router's choices by the same ATen ops, each expert's rows by the same grouped kernels, each
// output rounded to bfloat16, scaled by its weight rounded to bfloat16 (the product rounded),
// the choices summed in float32 in their order and rounded once (torch's sum of bfloat16).
#include "aten_api.h"

#include <cstring>
#include <vector>

#include "vec.h"

#ifdef FS_HAVE_AVX512_BF16
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t n);
torch::Tensor bf16_grouped_linear(torch::Tensor x, std::vector<torch::Tensor> packed,
                                  std::vector<int64_t> sizes, int64_t n);
#ifdef FS_HAVE_AMX_BF16
torch::Tensor bf16_linear_amx(torch::Tensor x, torch::Tensor packed,
                              c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor bf16_grouped_linear_amx(torch::Tensor x, std::vector<torch::Tensor> packed,
                                      std::vector<int64_t> sizes, int64_t n);
#endif

namespace {

constexpr int64_t kGrainRows = 16;  // tokens per parallel chunk of the gather and the sum

// Each token's sum over its choices j of bf16(y[pos[t, j]] * bf16(w[t, j])), in float32,
// rounded once to bfloat16.
void weighted_sum(const BF16* y, const int64_t* pos, const float* w, BF16* out, int64_t tokens,
                  int64_t top_k, int64_t hidden) {
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t h = 0;
      for (; h + 16 <= hidden; h += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < top_k; ++j) {
          const float wj = static_cast<float>(static_cast<BF16>(w[t * top_k + j]));
          const __m512 prod = _mm512_mul_ps(widen16(y + pos[t * top_k + j] * hidden + h),
                                            _mm512_set1_ps(wj));
          acc = _mm512_add_ps(acc, round16(prod));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * hidden + h),
                            (__m256i)_mm512_cvtneps_pbh(acc));
      }
      for (; h < hidden; ++h) {
        float acc = 0.f;
        for (int64_t j = 0; j < top_k; ++j) {
          const float wj = static_cast<float>(static_cast<BF16>(w[t * top_k + j]));
          const float yj = static_cast<float>(y[pos[t * top_k + j] * hidden + h]);
          acc += static_cast<float>(static_cast<BF16>(yj * wj));
        }
        out[t * hidden + h] = static_cast<BF16>(acc);
      }
    }
  });
}

}  // namespace

// x [tokens, K] bfloat16; weights [tokens, top_k] float32 and ids [tokens, top_k] int64: each
// token's chosen experts (distinct) and their weights; gate_up[e] / down[e]: expert e's
// [width, K] and [hidden, width / 2] weights packed by bf16_pack_weight. On AMX tiles (`amx`)
// each expert's group is padded with zero rows to the tiles' 16. Returns [tokens, hidden], or
// None where a group would pass `max_rows` (the caller's other path takes such a batch).
torch::Tensor bf16_moe_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor ids,
                               std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                               int64_t width, int64_t hidden, int64_t max_rows, bool amx) {
  const int64_t tokens = x.size(0), num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "bf16_moe_experts: a contiguous [tokens, K] bfloat16 x expected, got ",
              x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && ids.scalar_type() == torch::kInt64 &&
                  ids.is_contiguous(),
              "bf16_moe_experts: ids must be a contiguous int64 [", tokens, ", top_k], got ",
              ids.scalar_type(), " of shape ", ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32 &&
                  weights.is_contiguous(),
              "bf16_moe_experts: weights must be contiguous float32 of ids' shape ", ids.sizes(),
              ", got ", weights.scalar_type(), " of shape ", weights.sizes());
  TORCH_CHECK(down.size() == gate_up.size() && num_experts > 0,
              "bf16_moe_experts: ", gate_up.size(), " gate/up weights for ", down.size(), " down");
#ifdef FS_HAVE_AMX_BF16
  const int64_t multiple = amx ? 16 : 1;
#else
  TORCH_CHECK(!amx, "bf16_moe_experts: this build of the kernels has no AMX path");
  const int64_t multiple = 1;
#endif
  const int64_t top_k = ids.size(1), pairs = tokens * top_k, k = x.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  // The pairs counted and placed by expert, each expert's in token order (a stable sort).
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "bf16_moe_experts: expert id ", id[p],
                " of ", num_experts, " experts");
    ++counts[id[p]];
  }
  std::vector<int64_t> sizes(num_experts), start(num_experts);
  int64_t rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    sizes[e] = (counts[e] + multiple - 1) / multiple * multiple;
    if (sizes[e] > max_rows) return torch::Tensor();
    start[e] = rows;
    rows += sizes[e];
  }
  std::vector<int64_t> pos(pairs), next = start;
  for (int64_t p = 0; p < pairs; ++p) pos[p] = next[id[p]]++;
  auto gathered = torch::empty({rows, k}, x.options());  // [rows, K], expert by expert
  const BF16* src = x.data_ptr<BF16>();
  BF16* dst = gathered.data_ptr<BF16>();
  for (int64_t e = 0; e < num_experts; ++e)  // each group's padding rows, after its own
    std::memset(dst + (start[e] + counts[e]) * k, 0, (sizes[e] - counts[e]) * k * sizeof(BF16));
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin * top_k; p < end * top_k; ++p)
      std::memcpy(dst + pos[p] * k, src + (p / top_k) * k, k * sizeof(BF16));
  });
#ifdef FS_HAVE_AMX_BF16
  const auto matmul = amx ? bf16_grouped_linear_amx : bf16_grouped_linear;
#else
  const auto matmul = bf16_grouped_linear;
#endif
  const auto y = matmul(silu_and_mul(matmul(gathered, gate_up, sizes, width)), down, sizes, hidden);
  auto out = torch::empty({tokens, hidden}, x.options());
  weighted_sum(y.data_ptr<BF16>(), pos.data(), weights.data_ptr<float>(), out.data_ptr<BF16>(),
               tokens, top_k, hidden);
  return out;
}

// The whole routed half of a block: the router's logits by the kernels' matmul (`router`
// packed by bf16_pack_weight, one output per expert), its choices by the ATen ops of the
// block's `route` (softmax in float32, top-k, renormalised where `norm_topk_prob`), then
// bf16_moe_experts. The same ops as the block's, called from here with no Python between them.
torch::Tensor bf16_moe_block(torch::Tensor x, torch::Tensor router, int64_t top_k,
                             bool norm_topk_prob, std::vector<torch::Tensor> gate_up,
                             std::vector<torch::Tensor> down, int64_t width, int64_t hidden,
                             int64_t max_rows, bool amx) {
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
#ifdef FS_HAVE_AMX_BF16
  const auto linear = amx ? bf16_linear_amx : bf16_linear;
#else
  const auto linear = bf16_linear;
#endif
  const auto logits = linear(x, router, c10::nullopt, num_experts);  // [tokens, experts]
  auto [weights, ids] = at::topk(at::softmax(logits.to(torch::kFloat32), -1), top_k, -1);
  if (norm_topk_prob) weights.div_(weights.sum(-1, true));
  return bf16_moe_experts(x, weights.contiguous(), ids.contiguous(), std::move(gate_up),
                          std::move(down), width, hidden, max_rows, amx);
}
#endif  // FS_HAVE_AVX512_BF16
