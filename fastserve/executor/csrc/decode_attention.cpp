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
// read once, and nothing beyond ctx_len. After churn a request's blocks lie anywhere in the
// cache, and one head's block (2 KiB at 16 rows of 64 bfloat16 dims) ends before the hardware
// prefetcher has ramped up, so decode read scattered blocks at a third of the speed it read
// adjacent ones (10-12 against 28-30 GB/s on 2 Zen 4 cores); the task therefore asks for its
// blocks into L2 ahead of use (`BlockPrefetch`): 1.7-1.9x on scattered blocks, 20-23 GB/s.
// It asks for the head of each block only, and leaves the rest to the L2's streamer.
// With AVX2 + FMA and head_dim 64 or 128 the dot products run four K rows at a time in
// registers (independent FMA chains instead of one latency-bound chain per row) and the output
// accumulates in registers across a block.
//
// The cache may be float32, bfloat16 or float16 (`CacheT`): half-precision rows are widened to
// float32 as they are loaded (a shift for bfloat16, F16C for float16), so the math and the
// query stay in float32 and a half cache reads half the bytes, which is what decode waits on.
// Where the CPU has AVX-512 BF16 (the build is -march=native), a bfloat16 cache's decode scores
// are bfloat16 dot products instead and V is widened sixteen lanes at a time: 1.2-1.3x the AVX2
// path on 2 AMD EPYC cores (small and 7B head shapes). FS_NO_AVX512_BF16 builds without it.
// The Python bindings need pybind11 and its tensor type caster only, not all of
// <torch/extension.h> (a third of its compile time).
#include <torch/csrc/utils/pybind.h>

#include "aten_api.h"

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

#ifdef FS_HAVE_AVX512_BF16
// With AVX-512 BF16 (and a bfloat16 cache), decode's scores are bfloat16 dot products: each
// instruction multiplies 32 pairs exactly and adds them in float32, against eight float32
// multiply-adds (and the widening of K) on the AVX2 path. The query is rounded to bfloat16
// once per task: exact for a bfloat16 model's queries, which are bfloat16 values widened.
inline __m512bh load32bh(const BF16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// Scores of one query row (D bfloat16 values in q) against rows [0, n) of a block.
template <int D>
inline void block_scores_dp(const __m512bh* q, const BF16* kblk, int64_t n, float scale, float* s) {
  constexpr int V = D / 32;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four rows: four independent chains
    const BF16* k0 = kblk + t * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < V; ++i) {
      a0 = _mm512_dpbf16_ps(a0, q[i], load32bh(k0 + 32 * i));
      a1 = _mm512_dpbf16_ps(a1, q[i], load32bh(k0 + D + 32 * i));
      a2 = _mm512_dpbf16_ps(a2, q[i], load32bh(k0 + 2 * D + 32 * i));
      a3 = _mm512_dpbf16_ps(a3, q[i], load32bh(k0 + 3 * D + 32 * i));
    }
    s[t] = _mm512_reduce_add_ps(a0) * scale;
    s[t + 1] = _mm512_reduce_add_ps(a1) * scale;
    s[t + 2] = _mm512_reduce_add_ps(a2) * scale;
    s[t + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < V; ++i) a = _mm512_dpbf16_ps(a, q[i], load32bh(kblk + t * D + 32 * i));
    s[t] = _mm512_reduce_add_ps(a) * scale;
  }
}

// acc += sum_t p[t] v[t] over rows [0, n) of a bfloat16 block, sixteen lanes at a time.
template <int D>
inline void block_accumulate_512(const float* p, const BF16* vblk, int64_t n, float* acc) {
  constexpr int V = D / 16;
  __m512 av[V];
  for (int i = 0; i < V; ++i) av[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int i = 0; i < V; ++i) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vblk + t * D + 16 * i));
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      av[i] = _mm512_fmadd_ps(pt, x, av[i]);
    }
  }
  for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + 16 * i, av[i]);
}
#endif
}  // namespace

// q:           [num_reqs, num_heads, head_dim]           float32
// k/v_cache:   [num_kv_heads, num_slots, head_dim]      float32
// block_table: [num_reqs, max_blocks]                   int32
// ctx_lens:    [num_reqs]                               int32
// returns      [num_reqs, num_heads, head_dim]          float32
namespace {

// Asks for the cache line at p in L2. An asm statement, not _mm_prefetch: GCC 12 deleted the
// loops below as work without effect when they held only the builtin (the kernel then ran
// exactly as with no prefetch).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Software prefetch of a task's K and V blocks into L2: the first kAheadBytes of each up
// front (short contexts are then all in flight at once), then one block per block consumed,
// staying kAheadBytes ahead. Tried on scattered blocks: one task ahead, or all of a task's
// blocks at once, lost to this at long contexts (they push unread blocks out of L2), and so
// did one stream of blocks running ahead across a thread's tasks.
constexpr int64_t kAheadBytes = 32 << 10;
// Of each block, only the first kHeadBytes are asked for: their misses start the L2's own
// streaming prefetcher on the rest of the block, and a software prefetch holds one of the
// core's few line-fill buffers until its line arrives, so asking for every line left fewer
// misses in flight. On 2 Sapphire Rapids cores, 12 layers of decode attention at batch 16
// over scattered 16-token blocks (bfloat16 / float32 cache, head_dim 64): 1.15x / 1.25x
// faster at context 64, 1.2x / 1.4x at 512, 1.25x / 1.4x at 1024 than prefetching whole blocks.
// Of the other heads tried, 512 bytes lost at 160-256 tokens, and 2 KiB of a float32 block at
// every length.
constexpr int64_t kHeadBytes = 1024;

template <typename CacheT>
struct BlockPrefetch {
  const CacheT* base;     // this head's K or V: [num_slots, head_dim]
  const int32_t* table;   // the request's block table
  int64_t num_blocks, block_elems, ahead;

  BlockPrefetch(const CacheT* base, const int32_t* table, int64_t num_blocks, int64_t block_elems)
      : base(base), table(table), num_blocks(num_blocks), block_elems(block_elems),
        ahead(std::max<int64_t>(1, kAheadBytes / (block_elems * int64_t(sizeof(CacheT))))) {}

  void fetch(int64_t b) const {
    // A block right after the one before it is left to the hardware prefetcher, which streams
    // adjacent blocks at full speed; asking again cost 15% on adjacent blocks.
    if (b >= num_blocks || (b > 0 && table[b] == table[b - 1] + 1)) return;
    const char* p = reinterpret_cast<const char*>(base + int64_t(table[b]) * block_elems);
    const int64_t bytes = std::min<int64_t>(kHeadBytes, block_elems * int64_t(sizeof(CacheT)));
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(p + o);
  }
  void start() const {
    for (int64_t b = 0; b < ahead; ++b) fetch(b);
  }
  void on_block(int64_t b) const { fetch(b + ahead); }  // block b is about to be read
};

template <typename CacheT>
struct Task {
  const float* q;        // [group, head_dim] query heads sharing this kv head
  const CacheT* k;       // this kv head's K: [num_slots, head_dim]
  const CacheT* v;       // this kv head's V: [num_slots, head_dim]
  const int32_t* table;  // the request's block table
  int64_t ctx, block_size, group, head_dim;
  float scale;
  float* out;            // [group, head_dim]
};

// Scores of one query row against rows [0, n) of a block: s[t] = q . k[t] * scale.
template <int D, typename CacheT>
inline void block_scores(const float* q, const CacheT* kblk, int64_t n, float scale, float* s) {
#ifdef FS_HAVE_AVX2
  constexpr int V = D / 8;
  __m256 qv[V];
  for (int i = 0; i < V; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four rows: four independent FMA chains
    const CacheT* k0 = kblk + t * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < V; ++i) {
      a0 = _mm256_fmadd_ps(qv[i], load8(k0 + 8 * i), a0);
      a1 = _mm256_fmadd_ps(qv[i], load8(k0 + D + 8 * i), a1);
      a2 = _mm256_fmadd_ps(qv[i], load8(k0 + 2 * D + 8 * i), a2);
      a3 = _mm256_fmadd_ps(qv[i], load8(k0 + 3 * D + 8 * i), a3);
    }
    // Horizontal sums of the four accumulators at once: [s0 s1 s2 s3].
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h = _mm256_hadd_ps(h01, h23);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s + t, r);
  }
  for (; t < n; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < V; ++i) a = _mm256_fmadd_ps(qv[i], load8(kblk + t * D + 8 * i), a);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    s[t] = _mm_cvtss_f32(r);
  }
#else
  for (int64_t t = 0; t < n; ++t) {
    float a = 0.f;
    for (int d = 0; d < D; ++d) a += q[d] * static_cast<float>(kblk[t * D + d]);
    s[t] = a * scale;
  }
#endif
}

// acc += sum_t p[t] v[t] over rows [0, n) of a block.
template <int D, typename CacheT>
inline void block_accumulate(const float* p, const CacheT* vblk, int64_t n, float* acc) {
#ifdef FS_HAVE_AVX2
  constexpr int V = D / 8;
  __m256 av[V];
  for (int i = 0; i < V; ++i) av[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int i = 0; i < V; ++i) av[i] = _mm256_fmadd_ps(pt, load8(vblk + t * D + 8 * i), av[i]);
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc + 8 * i, av[i]);
#else
  for (int64_t t = 0; t < n; ++t)
    for (int d = 0; d < D; ++d) acc[d] += p[t] * static_cast<float>(vblk[t * D + d]);
#endif
}

inline void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
    int64_t t = 0;
#ifdef FS_HAVE_AVX2
    // Eight exps at a time: a scalar exp per score cost as much as reading the K/V.
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= ctx; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
      _mm256_storeu_ps(sg + t, e);
      acc = _mm256_add_ps(acc, e);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    sum = _mm_cvtss_f32(h);
#endif
    for (; t < ctx; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
  }
}

// One (request, kv head) with head_dim D known at compile time.
template <int D, typename CacheT>
void attend(const Task<CacheT>& k, std::vector<float>& scores) {
  const int64_t bs = k.block_size, ctx = k.ctx, group = k.group;
  scores.resize(group * ctx);
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  const BlockPrefetch<CacheT> kpf(k.k, k.table, num_blocks, bs * D);
  const BlockPrefetch<CacheT> vpf(k.v, k.table, num_blocks, bs * D);
  kpf.start();
  vpf.start();
#ifdef FS_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<CacheT, BF16>) {  // bfloat16 dot products (see above)
    constexpr int V = D / 32;
    std::vector<__m512bh> qs(group * V);
    for (int64_t g = 0; g < group; ++g)
      for (int i = 0; i < V; ++i) {
        const float* src = k.q + g * D + 32 * i;
        qs[g * V + i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      }
    for (int64_t b = 0; b * bs < ctx; ++b) {
      const int64_t n = std::min(bs, ctx - b * bs);
      const BF16* kblk = k.k + static_cast<int64_t>(k.table[b]) * bs * D;
      kpf.on_block(b);
      for (int64_t g = 0; g < group; ++g)
        block_scores_dp<D>(qs.data() + g * V, kblk, n, k.scale, scores.data() + g * ctx + b * bs);
    }
    softmax_rows(scores.data(), group, ctx);
    std::fill(k.out, k.out + group * D, 0.f);
    for (int64_t b = 0; b * bs < ctx; ++b) {
      const int64_t n = std::min(bs, ctx - b * bs);
      const BF16* vblk = k.v + static_cast<int64_t>(k.table[b]) * bs * D;
      vpf.on_block(b);
      for (int64_t g = 0; g < group; ++g)
        block_accumulate_512<D>(scores.data() + g * ctx + b * bs, vblk, n, k.out + g * D);
    }
    return;
  }
#endif
  for (int64_t b = 0; b * bs < ctx; ++b) {  // scores, block by block
    const int64_t n = std::min(bs, ctx - b * bs);
    const CacheT* kblk = k.k + static_cast<int64_t>(k.table[b]) * bs * D;
    kpf.on_block(b);
    for (int64_t g = 0; g < group; ++g)
      block_scores<D>(k.q + g * D, kblk, n, k.scale, scores.data() + g * ctx + b * bs);
  }
  softmax_rows(scores.data(), group, ctx);
  std::fill(k.out, k.out + group * D, 0.f);
  for (int64_t b = 0; b * bs < ctx; ++b) {  // out[g] = sum_t p[g, t] v[t]
    const int64_t n = std::min(bs, ctx - b * bs);
    const CacheT* vblk = k.v + static_cast<int64_t>(k.table[b]) * bs * D;
    vpf.on_block(b);
    for (int64_t g = 0; g < group; ++g)
      block_accumulate<D>(scores.data() + g * ctx + b * bs, vblk, n, k.out + g * D);
  }
}

// Any head_dim: plain loops (the compiler vectorises the inner ones).
template <typename CacheT>
void attend_generic(const Task<CacheT>& k, std::vector<float>& scores) {
  const int64_t bs = k.block_size, ctx = k.ctx, group = k.group, D = k.head_dim;
  scores.resize(group * ctx);
  for (int64_t t = 0; t < ctx; ++t) {
    const CacheT* krow = k.k + (static_cast<int64_t>(k.table[t / bs]) * bs + t % bs) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = k.q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(krow[d]);
      scores[g * ctx + t] = s * k.scale;
    }
  }
  softmax_rows(scores.data(), group, ctx);
  std::fill(k.out, k.out + group * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const CacheT* vrow = k.v + (static_cast<int64_t>(k.table[t / bs]) * bs + t % bs) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * ctx + t];
      float* ag = k.out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(vrow[d]);
    }
  }
}

}  // namespace

namespace {

// The cache dtypes the kernels read, and a readable error for any other.
void check_cache(const char* op, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf, op,
              ": the KV cache must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(v_cache.scalar_type() == dt, op, ": K and V caches of different dtypes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
}

// Calls fn(CacheT{}) with the C++ type of the cache's dtype.
template <typename Fn>
void with_cache_type(torch::ScalarType dt, Fn&& fn) {
  if (dt == torch::kBFloat16) fn(BF16{});
  else if (dt == torch::kHalf) fn(F16{});
  else fn(float{});
}

template <typename CacheT>
void decode_all(const float* qp, const CacheT* kp, const CacheT* vp, const int32_t* bt,
                const int32_t* lens, float* op, int64_t num_reqs, int64_t num_heads,
                int64_t num_kv_heads, int64_t num_slots, int64_t head_dim, int64_t max_blocks,
                int64_t block_size, float sc) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, kvh = task % num_kv_heads;
      const Task<CacheT> t{qp + (r * num_heads + kvh * group) * head_dim,
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
}

}  // namespace

// q:           [num_reqs, num_heads, head_dim]           float32
// k/v_cache:   [num_kv_heads, num_slots, head_dim]      float32, bfloat16 or float16
// block_table: [num_reqs, max_blocks]                   int32
// ctx_lens:    [num_reqs]                               int32
// returns      [num_reqs, num_heads, head_dim]          float32
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor ctx_lens,
                               int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "decode_attention: a float32 query expected");
  check_cache("decode_attention", k_cache, v_cache);
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && ctx_lens.scalar_type() == torch::kInt32,
              "decode_attention: int32 block table and lengths expected");
  q = q.contiguous();
  block_table = block_table.contiguous();
  auto out = torch::empty_like(q);
  with_cache_type(k_cache.scalar_type(), [&](auto tag) {
    using CacheT = decltype(tag);
    decode_all<CacheT>(q.data_ptr<float>(), k_cache.data_ptr<CacheT>(), v_cache.data_ptr<CacheT>(),
                       block_table.data_ptr<int32_t>(), ctx_lens.data_ptr<int32_t>(),
                       out.data_ptr<float>(), q.size(0), q.size(1), k_cache.size(0),
                       k_cache.size(1), q.size(2), block_table.size(1), block_size,
                       static_cast<float>(scale));
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Paged extend attention: a chunk of q_len new tokens after start_pos cached ones (a later chunk
// of a long prompt, or the uncached rest of a prompt whose prefix was cached). Query i (position
// start_pos + i) attends to keys 0 .. start_pos + i, read block by block through the block
// table: no gather of the context and no [q_len, ctx_len] mask (the bottom-right causal limit
// is a per-row key count). Flash-style online softmax, parallel over (kv head, query tile); a
// tile's query rows (TQ queries x the group of query heads sharing the kv head) share every K/V
// block read, so the context is read q_len / TQ times per kv head, not q_len times. With a
// bfloat16 cache and AVX-512 BF16 the scores are bfloat16 dot products (tile_scores_dp), which
// also make it faster than SDPA for a bfloat16 model's fresh prefills (backends/cpu.py).
namespace {

constexpr int64_t kTileRows = 64;  // query rows (query x head) per tile of scores
constexpr int64_t kKeys = 16;   // keys per inner step (the last may be partial)


template <typename CacheT>
struct ExtendTask {
  const float* q;        // the chunk's queries: [q_len, num_heads, head_dim]
  const CacheT* k;       // this kv head's K: [num_slots, head_dim]
  const CacheT* v;       // this kv head's V: [num_slots, head_dim]
  const int32_t* table;  // the request's block table
  int64_t start_pos, q0, nq, num_heads, head0, group, head_dim, block_size;
  float scale;
  float* out;            // [q_len, num_heads, head_dim]
};

// Per-tile state, rows r = query i * group + g: running max, running sum, unnormalised output.
struct TileBuffers {
  std::vector<float> qs, o, m, l, kt, p;
  std::vector<BF16> qh;        // bfloat16 path: unscaled queries, [rows][d]
  std::vector<uint32_t> kt2;   // bfloat16 path: K as bfloat16 pairs, transposed: [d / 2][kKeys]
  void reset(int64_t rows, int64_t d, bool dp) {
    qs.assign(dp ? 0 : rows * d, 0.f);
    qh.assign(dp ? rows * d : 0, BF16(0.f));
    kt2.assign(dp ? d / 2 * kKeys : 0, 0u);
    o.assign(rows * d, 0.f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.f);
    kt.assign(dp ? 0 : d * kKeys, 0.f);
    p.assign(kTileRows * kKeys, 0.f);
  }
};

// Scores of rows [0, rows) against kKeys keys held transposed in kt [d][kKeys]; s [rows][kKeys].
inline void tile_scores(const float* qs, const float* kt, int64_t rows, int64_t d, float* s) {
#ifdef FS_HAVE_AVX2
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {  // four rows x 16 keys: eight independent FMA chains
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    const float* q0 = qs + r * d;
    for (int64_t j = 0; j < d; ++j) {
      const __m256 k0 = _mm256_loadu_ps(kt + j * kKeys), k1 = _mm256_loadu_ps(kt + j * kKeys + 8);
      __m256 b = _mm256_broadcast_ss(q0 + j);
      a00 = _mm256_fmadd_ps(b, k0, a00); a01 = _mm256_fmadd_ps(b, k1, a01);
      b = _mm256_broadcast_ss(q0 + d + j);
      a10 = _mm256_fmadd_ps(b, k0, a10); a11 = _mm256_fmadd_ps(b, k1, a11);
      b = _mm256_broadcast_ss(q0 + 2 * d + j);
      a20 = _mm256_fmadd_ps(b, k0, a20); a21 = _mm256_fmadd_ps(b, k1, a21);
      b = _mm256_broadcast_ss(q0 + 3 * d + j);
      a30 = _mm256_fmadd_ps(b, k0, a30); a31 = _mm256_fmadd_ps(b, k1, a31);
    }
    float* sr = s + r * kKeys;
    _mm256_storeu_ps(sr, a00); _mm256_storeu_ps(sr + 8, a01);
    _mm256_storeu_ps(sr + 16, a10); _mm256_storeu_ps(sr + 24, a11);
    _mm256_storeu_ps(sr + 32, a20); _mm256_storeu_ps(sr + 40, a21);
    _mm256_storeu_ps(sr + 48, a30); _mm256_storeu_ps(sr + 56, a31);
  }
  for (; r < rows; ++r) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t j = 0; j < d; ++j) {
      const __m256 b = _mm256_broadcast_ss(qs + r * d + j);
      a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + j * kKeys), a0);
      a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kt + j * kKeys + 8), a1);
    }
    _mm256_storeu_ps(s + r * kKeys, a0);
    _mm256_storeu_ps(s + r * kKeys + 8, a1);
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < kKeys; ++t) {
      float a = 0.f;
      for (int64_t j = 0; j < d; ++j) a += qs[r * d + j] * kt[j * kKeys + t];
      s[r * kKeys + t] = a;
    }
#endif
}

#ifdef FS_HAVE_AVX512_BF16
// tile_scores for a bfloat16 cache as bfloat16 dot products, scaled after: s[r][t] =
// scale * q[r] . k[t], with kt2 holding K's bfloat16 pairs transposed ([d / 2][kKeys] words)
// and each query's pair broadcast, as the matmul kernel does (cpu_gemm.cpp): one instruction
// multiplies 16 keys x 2 dims, twice the multiply-adds of float32 FMAs per instruction, and K
// is transposed as words, not widened. The queries are rounded to bfloat16 once (exact for a
// bfloat16 model's queries), as decode's are.
inline void tile_scores_dp(const BF16* qh, const uint32_t* kt2, int64_t rows, int64_t d,
                           float scale, float* s) {
  constexpr int R = 8;  // rows per register tile: eight accumulators, one K load per pair
  const int64_t pairs = d / 2;
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qh + r * d);
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt2 + j * kKeys);
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(int(q32[i * pairs + j])), kv);
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(s + (r + i) * kKeys, _mm512_mul_ps(acc[i], sc));
  }
  for (; r < rows; ++r) {
    __m512 acc = _mm512_setzero_ps();
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qh + r * d);
    for (int64_t j = 0; j < pairs; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(q32[j])),
                             (__m512bh)_mm512_loadu_si512(kt2 + j * kKeys));
    _mm512_storeu_ps(s + r * kKeys, _mm512_mul_ps(acc, sc));
  }
}

#endif

// o[r] += sum_t p[r][t] v[t] for the rows in [r0, r1), keys [0, n).
// NOTE: a row rounds alike whichever path takes it (each key's product added in key order, as
// one fused multiply-add where the build has AVX2 + FMA), so a query's output does not depend
// on the chunk (or the position in it) it came in.
template <typename CacheT>
inline void tile_accumulate(const float* p, const CacheT* vblk, int64_t r0, int64_t r1, int64_t n,
                            int64_t d, float* o) {
#ifdef FS_HAVE_AVX2
  if (d % 32 == 0) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) {  // two rows x 32 dims: eight accumulators, V rows read once
      for (int64_t c = 0; c < d; c += 32) {
        float* o0 = o + r * d + c;
        float* o1 = o0 + d;
        __m256 x0 = _mm256_loadu_ps(o0), x1 = _mm256_loadu_ps(o0 + 8), x2 = _mm256_loadu_ps(o0 + 16),
               x3 = _mm256_loadu_ps(o0 + 24), y0 = _mm256_loadu_ps(o1), y1 = _mm256_loadu_ps(o1 + 8),
               y2 = _mm256_loadu_ps(o1 + 16), y3 = _mm256_loadu_ps(o1 + 24);
        for (int64_t t = 0; t < n; ++t) {
          const CacheT* vr = vblk + t * d + c;
          const __m256 v0 = load8(vr), v1 = load8(vr + 8), v2 = load8(vr + 16), v3 = load8(vr + 24);
          const __m256 pa = _mm256_set1_ps(p[r * kKeys + t]), pb = _mm256_set1_ps(p[(r + 1) * kKeys + t]);
          x0 = _mm256_fmadd_ps(pa, v0, x0); x1 = _mm256_fmadd_ps(pa, v1, x1);
          x2 = _mm256_fmadd_ps(pa, v2, x2); x3 = _mm256_fmadd_ps(pa, v3, x3);
          y0 = _mm256_fmadd_ps(pb, v0, y0); y1 = _mm256_fmadd_ps(pb, v1, y1);
          y2 = _mm256_fmadd_ps(pb, v2, y2); y3 = _mm256_fmadd_ps(pb, v3, y3);
        }
        _mm256_storeu_ps(o0, x0); _mm256_storeu_ps(o0 + 8, x1);
        _mm256_storeu_ps(o0 + 16, x2); _mm256_storeu_ps(o0 + 24, x3);
        _mm256_storeu_ps(o1, y0); _mm256_storeu_ps(o1 + 8, y1);
        _mm256_storeu_ps(o1 + 16, y2); _mm256_storeu_ps(o1 + 24, y3);
      }
    }
    r0 = r;  // an odd last row: plain loops below
  }
#endif
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[r * kKeys + t];
      const CacheT* vr = vblk + t * d;
      float* orow = o + r * d;
#ifdef FS_HAVE_AVX2  // fused, as the paired rows (a CPU without FMA would call libm's fma)
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) orow[j] = std::fma(pt, static_cast<float>(vr[j]), orow[j]);
#else  // every row takes this path: they round alike
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) orow[j] += pt * static_cast<float>(vr[j]);
#endif
    }
}

// Online softmax over one key step for row r: scores s[0, valid) count, the rest masked.
// Returns false when the row sees none of these keys (its output is untouched).
inline bool softmax_step(float* s, int64_t valid, float* m, float* l, float* orow, int64_t d) {
  if (valid <= 0) return false;
  float mx = *m;
#ifdef FS_HAVE_AVX2
  if (valid == kKeys) {
    __m256 x = _mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
    mx = std::max(mx, _mm_cvtss_f32(h));
  } else {
    for (int64_t t = 0; t < valid; ++t) mx = std::max(mx, s[t]);
  }
#else
  for (int64_t t = 0; t < valid; ++t) mx = std::max(mx, s[t]);
#endif
  // 0 on the first step (m = -inf); 1, without a scalar exp, while the row's max holds.
  const float alpha = mx == *m ? 1.f : std::exp(*m - mx);
#ifdef FS_HAVE_AVX2
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 p0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(s), mv));
  __m256 p1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + 8), mv));
  if (valid < kKeys) {  // zero the keys past this row's causal limit (or the block's end)
    const __m256i idx0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lim = _mm256_set1_epi32(static_cast<int>(valid));
    p0 = _mm256_and_ps(p0, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, idx0)));
    p1 = _mm256_and_ps(p1, _mm256_castsi256_ps(
                               _mm256_cmpgt_epi32(lim, _mm256_add_epi32(idx0, _mm256_set1_epi32(8)))));
  }
  _mm256_storeu_ps(s, p0);
  _mm256_storeu_ps(s + 8, p1);
  __m256 sum8 = _mm256_add_ps(p0, p1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  const float sum = _mm_cvtss_f32(h);
#else
  float sum = 0.f;
  for (int64_t t = 0; t < kKeys; ++t) {
    s[t] = t < valid ? std::exp(s[t] - mx) : 0.f;
    sum += s[t];
  }
#endif
  if (alpha != 1.f) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) orow[j] *= alpha;
  }
  *l = *l * alpha + sum;
  *m = mx;
  return true;
}

template <typename CacheT>
void extend_task(const ExtendTask<CacheT>& t, TileBuffers& buf) {
  const int64_t d = t.head_dim, group = t.group, rows = t.nq * group, bs = t.block_size;
#ifdef FS_HAVE_AVX512_BF16
  const bool dp = std::is_same_v<CacheT, BF16> && d % 2 == 0;  // bfloat16 scores (tile_scores_dp)
#else
  constexpr bool dp = false;
#endif
  buf.reset(rows, d, dp);
  for (int64_t i = 0; i < t.nq; ++i)  // pre-scaled queries (or bfloat16 ones), rows (i, g)
    for (int64_t g = 0; g < group; ++g) {
      const float* src = t.q + ((t.q0 + i) * t.num_heads + t.head0 + g) * d;
      const int64_t r = i * group + g;
      if (dp)
        for (int64_t j = 0; j < d; ++j) buf.qh[r * d + j] = BF16(src[j]);
      else
        for (int64_t j = 0; j < d; ++j) buf.qs[r * d + j] = src[j] * t.scale;
    }
  // Query i of the task sees keys [0, first_lim + i); the task needs keys [0, last_lim).
  const int64_t first_lim = t.start_pos + t.q0 + 1, last_lim = first_lim + t.nq - 1;
  // A short chunk after a long cached prefix (a conversation's next turn) reads the prefix's
  // scattered blocks with little work per block: fetched ahead as decode's are.
  const int64_t num_blocks = (last_lim + bs - 1) / bs;
  const BlockPrefetch<CacheT> kpf(t.k, t.table, num_blocks, bs * d);
  const BlockPrefetch<CacheT> vpf(t.v, t.table, num_blocks, bs * d);
  kpf.start();
  vpf.start();
  for (int64_t k0 = 0, n = 0; k0 < last_lim; k0 += n) {
    // Up to kKeys keys from k0, within k0's block and the task's causal reach.
    n = std::min({kKeys, last_lim - k0, bs - k0 % bs});
    if (k0 % bs == 0) {
      kpf.on_block(k0 / bs);
      vpf.on_block(k0 / bs);
    }
    const int64_t slot = static_cast<int64_t>(t.table[k0 / bs]) * bs + k0 % bs;
    const CacheT* kblk = t.k + slot * d;
    const CacheT* vblk = t.v + slot * d;
    if (dp) {  // transposed once as bfloat16 pairs (32-bit words): kt2[j][tt]
      for (int64_t tt = 0; tt < kKeys; ++tt) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(kblk + tt * d);
        for (int64_t j = 0; j < d / 2; ++j) buf.kt2[j * kKeys + tt] = tt < n ? row[j] : 0u;
      }
    } else {
      for (int64_t j = 0; j < d; ++j)  // transposed once (and widened) for every row: kt[j][tt]
        for (int64_t tt = 0; tt < kKeys; ++tt)
          buf.kt[j * kKeys + tt] = tt < n ? static_cast<float>(kblk[tt * d + j]) : 0.f;
    }
    // The rows that see key k0 are a suffix (queries sorted by position), taken a tile at a time
    // so a tile's queries, scores and outputs stay in L1 while the step's K/V are reused.
    const int64_t r_begin = std::max<int64_t>(0, (k0 - first_lim + 1) * group);
    for (int64_t r0 = r_begin; r0 < rows; r0 += kTileRows) {
      const int64_t r1 = std::min(rows, r0 + kTileRows);
      float* s = buf.p.data();
#ifdef FS_HAVE_AVX512_BF16
      if (dp)
        tile_scores_dp(buf.qh.data() + r0 * d, buf.kt2.data(), r1 - r0, d, t.scale, s);
      else
#endif
        tile_scores(buf.qs.data() + r0 * d, buf.kt.data(), r1 - r0, d, s);
      int64_t first = r1;  // the first row that sees one of these keys (a suffix again)
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t valid = std::min(n, first_lim + r / group - k0);
        if (softmax_step(s + (r - r0) * kKeys, valid, &buf.m[r], &buf.l[r], buf.o.data() + r * d, d))
          first = std::min(first, r);
      }
      tile_accumulate(s - r0 * kKeys, vblk, first, r1, n, d, buf.o.data());
    }
  }
  for (int64_t i = 0; i < t.nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const float inv = 1.f / buf.l[r];
      float* dst = t.out + ((t.q0 + i) * t.num_heads + t.head0 + g) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = buf.o[r * d + j] * inv;
    }
}

}  // namespace

// q:           [q_len, num_heads, head_dim]   float32: the chunk's queries
// k/v_cache:   [num_kv_heads, num_slots, head_dim] float32, bfloat16 or float16, the chunk's
//              own K/V written already
// block_table: [>= ceil((start_pos + q_len) / block_size)] int32
// returns      [q_len, num_heads, head_dim]   float32
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, int64_t start_pos, int64_t block_size,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "extend_attention: a float32 query expected");
  check_cache("extend_attention", k_cache, v_cache);
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32, "extend_attention: int32 block table");
  q = q.contiguous();
  block_table = block_table.contiguous();
  const int64_t q_len = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  TORCH_CHECK(block_table.size(0) * block_size >= start_pos + q_len,
              "extend_attention: block table shorter than the context");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  // One task per (kv head, slice of the queries): each reads the context once. The slices
  // split the queries so every thread has work even with fewer kv heads than threads; later
  // queries see more keys, so slice boundaries balance query-key pairs, not query counts.
  const int64_t num_slices = std::min<int64_t>(
      q_len, (at::get_num_threads() + num_kv_heads - 1) / num_kv_heads);
  std::vector<int64_t> bounds(num_slices + 1, q_len);
  bounds[0] = 0;
  for (int64_t sl = 1; sl < num_slices; ++sl) {  // pairs up to query i ~ i * (start + i / 2)
    const double total = q_len * (start_pos + q_len / 2.0), want = total * sl / num_slices;
    int64_t i = bounds[sl - 1];
    while (i < q_len && i * (start_pos + i / 2.0) < want) ++i;
    bounds[sl] = std::max(i, bounds[sl - 1] + 1);
  }
  with_cache_type(k_cache.scalar_type(), [&](auto tag) {
    using CacheT = decltype(tag);
    const CacheT* kp = k_cache.data_ptr<CacheT>();
    const CacheT* vp = v_cache.data_ptr<CacheT>();
    at::parallel_for(0, num_kv_heads * num_slices, 1, [&](int64_t begin, int64_t end) {
      TileBuffers buf;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kvh = task % num_kv_heads, sl = task / num_kv_heads;
        const int64_t q0 = bounds[sl], nq = bounds[sl + 1] - q0;
        if (nq <= 0) continue;
        const ExtendTask<CacheT> t{qp, kp + kvh * num_slots * head_dim,
                                   vp + kvh * num_slots * head_dim, bt, start_pos, q0, nq,
                                   num_heads, kvh * group, group, head_dim, block_size,
                                   static_cast<float>(scale), op};
        extend_task(t, buf);
      }
    });
  });
  return out;
}

// cpu_layers.cpp
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
torch::Tensor rotary_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
#ifdef FS_HAVE_AVX512_BF16
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
// cpu_gemm.cpp
std::vector<int64_t> bf16_packed_shape(int64_t n, int64_t k);
torch::Tensor bf16_pack_weight(torch::Tensor w, c10::optional<torch::Tensor> out);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t n);
torch::Tensor bf16_grouped_linear(torch::Tensor x, std::vector<torch::Tensor> packed,
                                  std::vector<int64_t> sizes, int64_t n);
// cpu_moe.cpp
torch::Tensor bf16_moe_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor ids,
                               std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                               int64_t width, int64_t hidden, int64_t max_rows, bool amx);
torch::Tensor bf16_moe_block(torch::Tensor x, torch::Tensor router, int64_t top_k,
                             bool norm_topk_prob, std::vector<torch::Tensor> gate_up,
                             std::vector<torch::Tensor> down, int64_t width, int64_t hidden,
                             int64_t max_rows, bool amx);
#endif
#ifdef FS_HAVE_AMX_BF16
bool amx_ready();
torch::Tensor bf16_linear_amx(torch::Tensor x, torch::Tensor packed,
                              c10::optional<torch::Tensor> bias, int64_t n);
torch::Tensor bf16_grouped_linear_amx(torch::Tensor x, std::vector<torch::Tensor> packed,
                                      std::vector<int64_t> sizes, int64_t n);
// cpu_attention_amx.cpp
torch::Tensor extend_attention_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_table, int64_t start_pos,
                                   int64_t block_size, double scale);
#endif

// cpu_sampling.cpp
torch::Tensor nucleus_mass(torch::Tensor probs, torch::Tensor drawn);

// Which vector path this build took (it is compiled for the CPU it runs on: -march=native).
std::string isa() {
#if defined(FS_HAVE_AVX512_BF16)
  return "avx512_bf16";
#elif defined(FS_HAVE_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the vector path this build of the kernels takes");
  m.def("rms_norm", &rms_norm, "add + RMSNorm with the plain layer's roundings");
  m.def("store_kv", &store_kv, "write new tokens' K/V at their cache slots");
  m.def("rotary_f32", &rotary_f32, "float32 rotary embedding, bit for bit the plain layer's");
#ifdef FS_HAVE_AVX512_BF16
  m.def("silu_and_mul", &silu_and_mul, "bfloat16 silu(gate) * up, the plain layer's roundings");
  m.def("rotary", &rotary, "bfloat16 rotary embedding, the plain layer's roundings");
  m.def("bf16_packed_shape", &bf16_packed_shape, "the shape bf16_pack_weight gives an [N, K] weight");
  m.def("bf16_pack_weight", &bf16_pack_weight, "a [N, K] bfloat16 weight in bf16_linear's layout",
        py::arg("w"), py::arg("out") = py::none());
  m.def("bf16_linear", &bf16_linear, "x W^T (+ b) in bfloat16, W packed by bf16_pack_weight");
  m.def("bf16_grouped_linear", &bf16_grouped_linear,
        "bf16_linear of row groups, each by its own packed weight (an MoE layer's experts)");
  m.def("bf16_moe_experts", &bf16_moe_experts,
        "an MoE layer's routed experts and each token's weighted sum of them, in one call");
  m.def("bf16_moe_block", &bf16_moe_block,
        "an MoE layer's router, its choices and bf16_moe_experts, in one call");
#endif
#ifdef FS_HAVE_AMX_BF16
  m.def("amx_ready", &amx_ready, "whether this process may use AMX tiles (Linux grants them once asked)");
  m.def("bf16_linear_amx", &bf16_linear_amx, "bf16_linear on AMX tiles (K a multiple of 32)");
  m.def("bf16_grouped_linear_amx", &bf16_grouped_linear_amx,
        "bf16_linear_amx of row groups (multiples of 16), each by its own packed weight");
  m.def("extend_attention_amx", &extend_attention_amx,
        "extend_attention on AMX tiles: bfloat16 query and cache, bfloat16 output");
#endif
  m.def("nucleus_mass", &nucleus_mass,
        "per row, the probability of the tokens ranked before its drawn token (top-p's test)");
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU; float32 query, float32/bfloat16/float16 cache)");
  m.def("extend_attention", &extend_attention,
        "paged attention of a prefill chunk after cached tokens (CPU; float32 query)");
}
