// Paged decode attention for CPU: one query token per request, read through block tables.
//
// Why a kernel: on CPU the per-call cost of torch's attention ops (tens to hundreds of
// microseconds) dominates decode, where each request's attention is tiny; one call per layer
// for the whole batch removes that. Parallel over (request, kv head); the query heads sharing
// a kv head are handled together so each K/V row is read once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q:           [num_reqs, num_heads, head_dim]           float32
// k/v_cache:   [num_kv_heads, num_slots, head_dim]      float32
// block_table: [num_reqs, max_blocks]                   int32
// ctx_lens:    [num_reqs]                               int32
// returns      [num_reqs, num_heads, head_dim]          float32
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor ctx_lens,
                               int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "decode_attention: float32 tensors expected");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && ctx_lens.scalar_type() == torch::kInt32,
              "decode_attention: int32 block table and lengths expected");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = ctx_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t ctx = lens[r];
      scores.assign(group * ctx, 0.f);
      const float* kh = kp + kvh * num_slots * head_dim;
      const float* vh = vp + kvh * num_slots * head_dim;
      const float* qr = qp + (r * num_heads + kvh * group) * head_dim;
      // scores[g, t] = q[g] . k[t] * scale
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t blk = bt[r * max_blocks + t / block_size];
        const float* krow = kh + (blk * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qr + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * krow[d];
          scores[g * ctx + t] = s * sc;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax over t
        float* sg = scores.data() + g * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {  // out[g] = sum_t p[g, t] v[t]
        const int64_t blk = bt[r * max_blocks + t / block_size];
        const float* vrow = vh + (blk * block_size + t % block_size) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vrow[d];
        }
      }
      float* orow = op + (r * num_heads + kvh * group) * head_dim;
      std::copy(acc.begin(), acc.end(), orow);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32)");
}
