// A prefill chunk's attention on AMX tiles: bfloat16 queries over the bfloat16 cache, through
// the block table, causal after `start_pos` cached tokens (a fresh prompt: start_pos 0).
//
// extend_attention (decode_attention.cpp) computes the scores a tile of queries at a time with
// AVX-512 dot products and accumulates P V in float32 FMAs; on a Sapphire Rapids core that was
// 2.4x torch's bfloat16 SDPA (whose flash attention runs its matmuls on the tiles) at 1024
// tokens. Here both products run on the tiles:
// 1. The context's K and V (every kv head) are gathered once through the block table into the
//    tiles' B layouts: K as [key tile of 16][32-dim chunk][16 dim pairs][16 keys] 32-bit words
//    (two bfloat16 of one key), V as [32-key tile][16-dim column tile][16 key pairs][16 dims]
//    words (one dim of two consecutive keys). Every query tile then loads them as they are.
// 2. Per (kv head, 16 query rows): the rows' whole score rows S = Q K^T (float32; rows are
//    (query, head of the group) pairs), an exact softmax per row over its causal reach (max,
//    exp, sum in float32; P rounded to bfloat16, as flash attention kernels keep it), then
//    O = P V in float32 tiles, divided by the row sums and rounded to bfloat16.
// Two passes over a row (scores kept whole) instead of an online softmax: no rescaling of the
// output tiles. A tile's score rows are 16 x the context in float32 (256 KiB at 4096 tokens).
#include "aten_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#ifdef FS_HAVE_AMX_BF16
bool amx_ready();  // cpu_gemm.cpp

namespace {

constexpr int64_t kRows = 16;      // query rows per tile (A and C tiles' height)
constexpr int64_t kKeyTile = 16;   // keys per score tile (a C tile's width)
constexpr int64_t kPairTile = 32;  // keys per P V product (an A tile row: 32 bfloat16)
constexpr int64_t kColTile = 16;   // output dims per C tile
constexpr int64_t kTileWords = 16 * 16;  // one B tile: 16 rows of 64 bytes, as 32-bit words

// Tiles 0-3: C (16 rows x 16 float32); 4: A (16 rows x 32 bfloat16); 5: B (16 pairs x 16).
constexpr int kNumTiles = 6;

inline uint32_t pair_word(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

struct Packed {
  std::vector<uint32_t> k, v;  // per kv head: k_per_head / v_per_head words
  int64_t k_per_head = 0, v_per_head = 0;
};

// Step 1: every kv head's context [0, kv_len) in the tiles' B layouts (zeros past kv_len).
Packed pack_context(const uint16_t* kc, const uint16_t* vc, const int32_t* table,
                    int64_t num_kv_heads, int64_t num_slots, int64_t d, int64_t bs,
                    int64_t kv_len) {
  const int64_t key_tiles = (kv_len + kKeyTile - 1) / kKeyTile;
  const int64_t pair_tiles = (kv_len + kPairTile - 1) / kPairTile;
  const int64_t chunks = d / 32, col_tiles = d / kColTile;
  Packed p;
  p.k_per_head = key_tiles * chunks * kTileWords;
  p.v_per_head = pair_tiles * col_tiles * kTileWords;
  p.k.assign(num_kv_heads * p.k_per_head, 0u);
  p.v.assign(num_kv_heads * p.v_per_head, 0u);
  auto row_of = [&](const uint16_t* cache, int64_t h, int64_t key) {
    const int64_t slot = static_cast<int64_t>(table[key / bs]) * bs + key % bs;
    return cache + (h * num_slots + slot) * d;
  };
  // Tasks: (kv head, 32-key tile): its two K tiles' words and its V tile's.
  at::parallel_for(0, num_kv_heads * pair_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / pair_tiles, pt = task % pair_tiles;
      uint32_t* kh = p.k.data() + h * p.k_per_head;
      uint32_t* vh = p.v.data() + h * p.v_per_head + pt * col_tiles * kTileWords;
      for (int64_t n = 0; n < kPairTile; ++n) {
        const int64_t key = pt * kPairTile + n;
        if (key >= kv_len) break;
        // K: word (dims 2q, 2q + 1) of this key at [tile][chunk][pair][key in tile]
        const uint32_t* kr = reinterpret_cast<const uint32_t*>(row_of(kc, h, key));
        uint32_t* kt = kh + (key / kKeyTile) * chunks * kTileWords + key % kKeyTile;
        for (int64_t q = 0; q < d / 2; ++q) kt[(q / 16) * kTileWords + (q % 16) * 16] = kr[q];
      }
      for (int64_t pr = 0; pr < kPairTile / 2; ++pr) {  // V: dims of keys 2pr, 2pr + 1
        const int64_t k0 = pt * kPairTile + 2 * pr;
        if (k0 >= kv_len) break;
        const uint16_t* a = row_of(vc, h, k0);
        const uint16_t* b = k0 + 1 < kv_len ? row_of(vc, h, k0 + 1) : nullptr;
        for (int64_t j = 0; j < d; ++j)
          vh[(j / kColTile) * kTileWords + pr * 16 + j % kColTile] = pair_word(a[j], b ? b[j] : 0);
      }
    }
  });
  return p;
}

struct Chunk {
  const uint16_t* q;  // [q_len, num_heads, d]
  uint16_t* out;      // the same shape
  int64_t q_len, num_heads, group, d, start_pos, kv_len;
  float scale;
};

struct Buffers {
  std::vector<uint16_t> q;   // [16][d]: the tile's query rows
  std::vector<float> s;      // [16][ld]: score rows
  std::vector<uint16_t> p;   // [16][ld]: probabilities, bfloat16
  std::vector<float> o;      // [4 tiles][16][16]: a column group's output
  int64_t ld = 0;
};

// Step 2 for one (kv head, row tile): rows r -> query q0 + r / group, head h * group + r % group.
void attend_tile(const Chunk& c, const Packed& pk, int64_t h, int64_t row0, Buffers& b) {
  const int64_t d = c.d, rows_total = c.q_len * c.group;
  const int64_t rows = std::min(kRows, rows_total - row0);
  std::fill(b.q.begin(), b.q.end(), 0);
  int64_t lim[kRows];
  int64_t reach = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    if (r >= rows) {
      lim[r] = 0;
      continue;
    }
    const int64_t i = (row0 + r) / c.group, g = (row0 + r) % c.group;
    std::memcpy(b.q.data() + r * d, c.q + (i * c.num_heads + h * c.group + g) * d, d * 2);
    lim[r] = c.start_pos + i + 1;
    reach = std::max(reach, lim[r]);
  }
  const int64_t key_tiles = (reach + kKeyTile - 1) / kKeyTile;
  const int64_t pair_tiles = (reach + kPairTile - 1) / kPairTile;
  const int64_t chunks = d / 32, col_tiles = d / kColTile;
  const uint32_t* kh = pk.k.data() + h * pk.k_per_head;
  const uint32_t* vh = pk.v.data() + h * pk.v_per_head;
  // S = Q K^T, a key tile at a time.
  for (int64_t kt = 0; kt < key_tiles; ++kt) {
    _tile_zero(0);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      _tile_loadd(4, b.q.data() + ch * 32, d * 2);
      _tile_loadd(5, kh + (kt * chunks + ch) * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, b.s.data() + kt * kKeyTile, b.ld * 4);
  }
  // Softmax per row over its reach; P zero past it (to the last pair tile's end).
  float inv_sum[kRows];
  const __m512 scale = _mm512_set1_ps(c.scale);
  const int64_t width = pair_tiles * kPairTile;
  for (int64_t r = 0; r < kRows; ++r) {
    float* s = b.s.data() + r * b.ld;
    uint16_t* p = b.p.data() + r * b.ld;
    const int64_t n = lim[r];
    if (n == 0) {
      std::memset(p, 0, width * 2);
      inv_sum[r] = 0.f;
      continue;
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    if (t < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, s + t));
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t < width; t += 16) {
      __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv), scale));
      if (t + 16 > n) {
        const __mmask16 m = t >= n ? 0 : static_cast<__mmask16>((1u << (n - t)) - 1);
        e = _mm512_maskz_mov_ps(m, e);
      }
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // O = P V, four 16-dim column tiles at a time.
  for (int64_t j0 = 0; j0 < col_tiles; j0 += 4) {
    const int nj = static_cast<int>(std::min<int64_t>(4, col_tiles - j0));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t pt = 0; pt < pair_tiles; ++pt) {
      _tile_loadd(4, b.p.data() + pt * kPairTile, b.ld * 2);
      const uint32_t* vt = vh + (pt * col_tiles + j0) * kTileWords;
      _tile_loadd(5, vt, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nj > 1) {
        _tile_loadd(5, vt + kTileWords, 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (nj > 2) {
        _tile_loadd(5, vt + 2 * kTileWords, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (nj > 3) {
        _tile_loadd(5, vt + 3 * kTileWords, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* o = b.o.data();
    _tile_stored(0, o, 64);
    _tile_stored(1, o + kTileWords, 64);
    _tile_stored(2, o + 2 * kTileWords, 64);
    _tile_stored(3, o + 3 * kTileWords, 64);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = (row0 + r) / c.group, g = (row0 + r) % c.group;
      uint16_t* dst = c.out + (i * c.num_heads + h * c.group + g) * d + j0 * kColTile;
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      for (int j = 0; j < nj; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * kColTile),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                _mm512_loadu_ps(o + j * kTileWords + r * 16), inv)));
    }
  }
}

}  // namespace

// q:           [q_len, num_heads, head_dim] bfloat16 (unit last stride): the chunk's queries
// k/v_cache:   [num_kv_heads, num_slots, head_dim] bfloat16, the chunk's own K/V written already
// block_table: [>= ceil((start_pos + q_len) / block_size)] int32
// returns      [q_len, num_heads, head_dim] bfloat16; head_dim a multiple of 32.
torch::Tensor extend_attention_amx(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_table, int64_t start_pos,
                                   int64_t block_size, double scale) {
  TORCH_CHECK(amx_ready(), "extend_attention_amx: Linux refused this process the AMX tile state");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && q.dim() == 3,
              "extend_attention_amx: a bfloat16 query [q_len, num_heads, head_dim] expected");
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "extend_attention_amx: contiguous bfloat16 caches of one shape expected");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32, "extend_attention_amx: int32 block table");
  q = q.contiguous();
  block_table = block_table.contiguous();
  const int64_t q_len = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  TORCH_CHECK(d % 32 == 0 && k_cache.size(2) == d,
              "extend_attention_amx: head_dim must be a multiple of 32 and the cache's, got ", d);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "extend_attention_amx: heads not a multiple of kv heads");
  const int64_t kv_len = start_pos + q_len;
  TORCH_CHECK(block_table.size(0) * block_size >= kv_len,
              "extend_attention_amx: block table shorter than the context");
  auto out = torch::empty_like(q);
  if (q_len == 0) return out;
  const Packed pk = pack_context(
      reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
      block_table.data_ptr<int32_t>(), num_kv_heads, num_slots, d, block_size, kv_len);
  const Chunk c{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), q_len, num_heads,
                num_heads / num_kv_heads, d, start_pos, kv_len, static_cast<float>(scale)};
  const int64_t row_tiles = (q_len * c.group + kRows - 1) / kRows;
  const int64_t tasks = num_kv_heads * row_tiles;
  // Later row tiles reach more keys: tasks zig-zag (first, last, second, ...) so that the
  // contiguous ranges parallel_for hands the threads carry near-equal work.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(kNumTiles);  // NOTE: per thread: the tile configuration is a thread's state
    Buffers b;
    b.ld = (kv_len + kPairTile - 1) / kPairTile * kPairTile;
    b.q.resize(kRows * d);
    b.s.resize(kRows * b.ld);
    b.p.resize(kRows * b.ld);
    b.o.resize(4 * kTileWords);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % num_kv_heads, k = task / num_kv_heads;
      const int64_t rt = k % 2 == 0 ? k / 2 : row_tiles - 1 - k / 2;
      attend_tile(c, pk, h, rt * kRows, b);
    }
    _tile_release();
  });
  return out;
}
#endif  // FS_HAVE_AMX_BF16
