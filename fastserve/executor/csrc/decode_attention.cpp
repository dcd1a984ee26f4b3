// Paged decode attention for CPU: one query token per request, read through block tables.
//
// Why a kernel: on CPU the per-call cost of torch's attention ops (tens to hundreds of
// microseconds) dominates decode, where each request's attention is tiny; one call per layer
// for the whole batch removes that. Parallel over (request, kv head); the query heads sharing
// a kv head are handled together so each K/V row is read once.
//
// Per (request, kv head) task the context is read block by block (a block's K or V rows for
// one head are contiguous and stay in L1 while every query head of the group uses them), K in
// one pass for the scores and V in a second for the output: each byte of the live context is
// read once, and nothing beyond ctx_len. With AVX2 + FMA and head_dim 64 or 128 the dot
// products run four K rows at a time in registers (independent FMA chains instead of one
// latency-bound chain per row) and the output accumulates in registers across a block.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FS_HAVE_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q:           [num_reqs, num_heads, head_dim]           float32
// k/v_cache:   [num_kv_heads, num_slots, head_dim]      float32
// block_table: [num_reqs, max_blocks]                   int32
// ctx_lens:    [num_reqs]                               int32
// returns      [num_reqs, num_heads, head_dim]          float32
namespace {

struct Task {
  const float* q;        // [group, head_dim] query heads sharing this kv head
  const float* k;        // this kv head's K: [num_slots, head_dim]
  const float* v;        // this kv head's V: [num_slots, head_dim]
  const int32_t* table;  // the request's block table
  int64_t ctx, block_size, group, head_dim;
  float scale;
  float* out;            // [group, head_dim]
};

// Scores of one query row against rows [0, n) of a block: s[t] = q . k[t] * scale.
template <int D>
inline void block_scores(const float* q, const float* kblk, int64_t n, float scale, float* s) {
#ifdef FS_HAVE_AVX2
  constexpr int V = D / 8;
  __m256 qv[V];
  for (int i = 0; i < V; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four rows: four independent FMA chains
    const float* k0 = kblk + t * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < V; ++i) {
      a0 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k0 + 8 * i), a0);
      a1 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k0 + D + 8 * i), a1);
      a2 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k0 + 2 * D + 8 * i), a2);
      a3 = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k0 + 3 * D + 8 * i), a3);
    }
    // Horizontal sums of the four accumulators at once: [s0 s1 s2 s3].
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h = _mm256_hadd_ps(h01, h23);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s + t, r);
  }
  for (; t < n; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) a = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kblk + t * D + 8 * i), a);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    s[t] = _mm_cvtss_f32(r);
  }
#else
  for (int64_t t = 0; t < n; ++t) {
    float a = 0.f;
    for (int d = 0; d < D; ++d) a += q[d] * kblk[t * D + d];
    s[t] = a * scale;
  }
#endif
}

// acc += sum_t p[t] v[t] over rows [0, n) of a block.
template <int D>
inline void block_accumulate(const float* p, const float* vblk, int64_t n, float* acc) {
#ifdef FS_HAVE_AVX2
  constexpr int V = D / 8;
  __m256 av[V];
  for (int i = 0; i < V; ++i) av[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int i = 0; i < V; ++i) av[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vblk + t * D + 8 * i), av[i]);
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc + 8 * i, av[i]);
#else
  for (int64_t t = 0; t < n; ++t)
    for (int d = 0; d < D; ++d) acc[d] += p[t] * vblk[t * D + d];
#endif
}

inline void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * ctx;
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
}

// One (request, kv head) with head_dim D known at compile time.
template <int D>
void attend(const Task& k, std::vector<float>& scores) {
  const int64_t bs = k.block_size, ctx = k.ctx, group = k.group;
  scores.resize(group * ctx);
  for (int64_t b = 0; b * bs < ctx; ++b) {  // scores, block by block
    const int64_t n = std::min(bs, ctx - b * bs);
    const float* kblk = k.k + static_cast<int64_t>(k.table[b]) * bs * D;
    for (int64_t g = 0; g < group; ++g)
      block_scores<D>(k.q + g * D, kblk, n, k.scale, scores.data() + g * ctx + b * bs);
  }
  softmax_rows(scores.data(), group, ctx);
  std::fill(k.out, k.out + group * D, 0.f);
  for (int64_t b = 0; b * bs < ctx; ++b) {  // out[g] = sum_t p[g, t] v[t]
    const int64_t n = std::min(bs, ctx - b * bs);
    const float* vblk = k.v + static_cast<int64_t>(k.table[b]) * bs * D;
    for (int64_t g = 0; g < group; ++g)
      block_accumulate<D>(scores.data() + g * ctx + b * bs, vblk, n, k.out + g * D);
  }
}

// Any head_dim: plain loops (the compiler vectorises the inner ones).
void attend_generic(const Task& k, std::vector<float>& scores) {
  const int64_t bs = k.block_size, ctx = k.ctx, group = k.group, D = k.head_dim;
  scores.resize(group * ctx);
  for (int64_t t = 0; t < ctx; ++t) {
    const float* krow = k.k + (static_cast<int64_t>(k.table[t / bs]) * bs + t % bs) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = k.q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * krow[d];
      scores[g * ctx + t] = s * k.scale;
    }
  }
  softmax_rows(scores.data(), group, ctx);
  std::fill(k.out, k.out + group * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const float* vrow = k.v + (static_cast<int64_t>(k.table[t / bs]) * bs + t % bs) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + t];
      float* ag = k.out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vrow[d];
    }
  }
}

}  // namespace

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
  block_table = block_table.contiguous();
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
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
      const Task t{qp + (r * num_heads + kvh * group) * head_dim,
                   kp + kvh * num_slots * head_dim,
                   vp + kvh * num_slots * head_dim,
                   bt + r * max_blocks,
                   lens[r], block_size, group, head_dim, sc,
                   op + (r * num_heads + kvh * group) * head_dim};
      if (head_dim == 64) attend<64>(t, scores);
      else if (head_dim == 128) attend<128>(t, scores);
      else attend_generic(t, scores);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32)");
}
