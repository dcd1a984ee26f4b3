// bfloat16 linear layers, y = x W^T (+ b), on a CPU with AVX-512 BF16 (no AMX).
//
// Why our own: oneDNN's bf16 matmul with a packed weight reached 16-21 GB/s of weight reads at
// decode batches on a 2-core Zen 4, where a plain sum over memory reaches 28-36 GB/s; a decode
// step of the small preset streams 219 MB of weights, so the matmuls set the step's time.
// Measured side by side on the small preset's 49 matmuls (2 cores, medians,
// benchmarks/cpu/cpu_matmul.py): 1.8x oneDNN at 1-16 rows, 1.35x at 32, 1.07x at 256 (compute-bound
// there, ~85% of the `vdpbf16ps` peak), 0.96-1.0x from 2048 to 8192 rows (in passes of
// kChunkRows rows), where it is 1.03-1.05x `F.linear` on the plain weight.
//
// Where the CPU has AMX (bf16_linear_amx), the same packed weight is read by tiles: 16 k pairs of
// a block are 16 rows of 256 bytes, and each 64 bytes of them is a B tile of 16 outputs in the
// pair-interleaved order `tdpbf16ps` takes, loaded with a 256-byte stride. A decode batch is
// bound by reading the weights there too: oneDNN's AMX matmul read them at 15-19 GB/s at 1-32
// rows on a 2-core Sapphire Rapids, where this kernel's AVX-512 path streamed 28 GB/s at one row
// but, at 1/32 the tiles' throughput, was compute-bound from 16 rows on.
//
// Layout: the weight [N, K] is packed once into blocks of 64 outputs, each [K/2][64][2]: one
// 64-byte load is 16 outputs x 2 consecutive k, which `vdpbf16ps` multiplies by a broadcast
// pair (x[m, k], x[m, k+1]) and adds into 16 float32 sums, so no sum is ever reduced across
// lanes. A register tile is up to 6 rows x 64 outputs (24 accumulators + 4 weight registers).
// Memory: each block is read from memory once, by its first tile; the tiles (and 48-row
// panels) after it read it from L2. So that memory is not idle while they do, the tiles of
// the block's last panel also prefetch their shares of the next block into L2.
// Sums are float32 (the products of two bfloat16 are exact), rounded once to bfloat16 (nearest
// even), as torch's matmul does; only the order of the sums differs from it.
#include "aten_api.h"

#include <algorithm>
#include <cstring>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec.h"

#ifdef FS_HAVE_AVX512_BF16
namespace {

constexpr int64_t kBlockN = 64;     // outputs per packed block
constexpr int kMaxTileRows = 6;     // rows per register tile
constexpr int64_t kPanelRows = 48;  // rows per parallel task
// Rows per pass over the weight. Every block is multiplied by all of a pass's rows, so a pass's
// input must stay in cache while the blocks stream by: unchunked, 8192 rows ran at 0.90x oneDNN's
// packed matmul and 0.92x F.linear (small preset, 2-core Zen 4); in 512-row passes, 0.96-0.98x
// and 1.03-1.05x, and 2048 rows as fast as in one pass (benchmarks/cpu/cpu_matmul.py, medians).
constexpr int64_t kChunkRows = 512;
constexpr int64_t kPrefetchBytes = 2048;  // ahead in the block being read (to L1)

struct Gemm {
  const uint32_t* x;  // rows of x as bfloat16 pairs
  int64_t sx;         // row stride, in pairs
  const uint16_t* w;  // packed weight
  int64_t k2;         // pairs per row (K / 2, rounded up)
  const float* bias;  // [blocks * 64] or nullptr
  uint16_t* y;        // output rows
  int64_t sy, n;      // row stride, valid outputs
  int64_t block_bytes() const { return k2 * kBlockN * 2 * 2; }
};

// Rows [row, row + MT) x block nb; prefetches pf_lines lines of [pf, pf_end) per pair to L2.
template <int MT>
void tile(const Gemm& g, int64_t row, int64_t nb, const char* pf, int64_t pf_lines,
          const char* pf_end) {
  const uint16_t* wb = g.w + nb * g.k2 * kBlockN * 2;
  __m512 acc[MT][4];
  for (int j = 0; j < 4; ++j) {
    const __m512 b0 = g.bias ? _mm512_loadu_ps(g.bias + nb * kBlockN + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) acc[i][j] = b0;
  }
  const uint32_t* xr = g.x + row * g.sx;
  for (int64_t kp = 0; kp < g.k2; ++kp) {
    const uint16_t* wk = wb + kp * kBlockN * 2;
    for (int64_t l = 0; l < pf_lines; ++l) {
      const char* p = pf + (kp * pf_lines + l) * 64;
      if (p < pf_end) _mm_prefetch(p, _MM_HINT_T1);
    }
    const char* ahead = reinterpret_cast<const char*>(wk) + kPrefetchBytes;
    for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 32),
                  w2 = _mm512_loadu_si512(wk + 64), w3 = _mm512_loadu_si512(wk + 96);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i * g.sx + kp]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, (__m512bh)w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, (__m512bh)w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, (__m512bh)w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xv, (__m512bh)w3);
    }
  }
  const int64_t valid = std::min(kBlockN, g.n - nb * kBlockN);
  for (int i = 0; i < MT; ++i) {
    uint16_t* yr = g.y + (row + i) * g.sy + nb * kBlockN;
    if (valid == kBlockN) {
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16 * j),
                            (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    } else {  // the last, partial block of an N that is not a multiple of 64
      alignas(64) uint16_t buf[kBlockN];
      for (int j = 0; j < 4; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 16 * j),
                           (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
      std::memcpy(yr, buf, valid * sizeof(uint16_t));
    }
  }
}

using TileFn = void (*)(const Gemm&, int64_t, int64_t, const char*, int64_t, const char*);
constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                             tile<4>, tile<5>, tile<6>};

// Block nb for the rows of one panel, split into near-equal register tiles.
void panel(const Gemm& g, int64_t r0, int64_t r1, int64_t nb, bool prefetch_next) {
  const int64_t rows = r1 - r0, tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  const int64_t bytes = g.block_bytes();
  const char* next = reinterpret_cast<const char*>(g.w) + (nb + 1) * bytes;
  const int64_t lines = prefetch_next ? (bytes / 64 / g.k2 + tiles - 1) / tiles : 0;
  int64_t row = r0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t left = r1 - row, mt = (left + (tiles - t) - 1) / (tiles - t);
    const char* share = next + t * (bytes / tiles);
    kTiles[mt](g, row, nb, share, lines, next + bytes);
    row += mt;
  }
}

}  // namespace

// The packed shape of an [n, k] weight: [blocks of 64 outputs, pairs, 64, 2] (zero-padded).
std::vector<int64_t> bf16_packed_shape(int64_t n, int64_t k) {
  return {(n + kBlockN - 1) / kBlockN, (k + 1) / 2, kBlockN, 2};
}

// w [n, k] bfloat16 packed into `out` (contiguous, of bf16_packed_shape) when given, else new.
torch::Tensor bf16_pack_weight(torch::Tensor w, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16,
              "bf16_pack_weight: a [N, K] bfloat16 weight expected, got ", w.scalar_type(),
              " of shape ", w.sizes());
  const int64_t n = w.size(0), k = w.size(1);
  const auto shape = bf16_packed_shape(n, k);
  const auto padded = at::constant_pad_nd(w, {0, shape[1] * 2 - k, 0, shape[0] * kBlockN - n});
  const auto packed = padded.view({shape[0], kBlockN, shape[1], 2}).permute({0, 2, 1, 3});
  if (!out.has_value()) return packed.contiguous();
  TORCH_CHECK(out->sizes() == c10::IntArrayRef(shape) && out->is_contiguous() &&
                  out->scalar_type() == torch::kBFloat16,
              "bf16_pack_weight: out must be a contiguous bfloat16 tensor of shape ", shape);
  out->copy_(packed);
  return *out;
}

namespace {

// A call's operands checked and laid out for the kernels: x as rows of bfloat16 pairs (rows
// padded with zeros to a multiple of `row_multiple`), y [m, n], the bias as float32.
struct Call {
  torch::Tensor x2, y, bias_f;
  std::vector<int64_t> out_shape;
  int64_t m, blocks;
  Gemm g;
};

Call prepare(const char* fn, torch::Tensor x, torch::Tensor packed,
             c10::optional<torch::Tensor> bias, int64_t n, int64_t row_multiple) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              fn, ": bfloat16 input and weight expected, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == (k + 1) / 2 && packed.size(2) == kBlockN &&
                  n > 0 && n <= packed.size(0) * kBlockN,
              fn, ": weight packed as ", packed.sizes(), " does not fit input ", x.sizes(),
              " and ", n, " outputs");
  Call c;
  const int64_t k2 = packed.size(1);
  c.blocks = packed.size(0);
  c.out_shape = x.sizes().vec();
  c.out_shape.back() = n;
  c.x2 = x.reshape({-1, k});
  c.m = c.x2.size(0);
  const int64_t pad_rows = (row_multiple - c.m % row_multiple) % row_multiple;
  if (k % 2 || pad_rows) c.x2 = at::constant_pad_nd(c.x2, {0, k % 2, 0, pad_rows});
  if (c.x2.stride(1) != 1 || c.x2.stride(0) % 2 || reinterpret_cast<uintptr_t>(c.x2.data_ptr()) % 4)
    c.x2 = c.x2.contiguous();
  c.y = torch::empty({c.m, n}, x.options());
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, fn, ": bias of ", bias->numel(), " for ", n, " outputs");
    c.bias_f = at::constant_pad_nd(bias->to(torch::kFloat32).reshape({n}),
                                   {0, c.blocks * kBlockN - n});
  }
  c.g = Gemm{reinterpret_cast<const uint32_t*>(c.x2.data_ptr()), c.x2.stride(0) / 2,
             reinterpret_cast<const uint16_t*>(packed.data_ptr()), k2,
             c.bias_f.defined() ? c.bias_f.data_ptr<float>() : nullptr,
             reinterpret_cast<uint16_t*>(c.y.data_ptr()), n, n};
  return c;
}

// A grouped call's operands: x's rows in groups, group e multiplied by packed[e] (every one
// an [n, k] weight packed by bf16_pack_weight), each group a multiple of `row_multiple` rows.
struct Groups {
  std::vector<Gemm> gemms;   // one per non-empty group, its rows of x and of y
  std::vector<int64_t> rows;  // the group's row count
  int64_t blocks = 0;
  torch::Tensor y;
};

Groups prepare_groups(const char* fn, const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                      const std::vector<int64_t>& sizes, int64_t n, int64_t row_multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                  x.size(1) % 2 == 0,
              fn, ": a contiguous [rows, K] bfloat16 input with an even K expected, got ",
              x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(packed.size() == sizes.size(), fn, ": ", packed.size(), " weights for ",
              sizes.size(), " groups");
  const int64_t k2 = x.size(1) / 2;
  Groups gs;
  int64_t total = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    TORCH_CHECK(sizes[e] >= 0 && sizes[e] % row_multiple == 0, fn, ": group ", e, " has ",
                sizes[e], " rows, not a multiple of ", row_multiple);
    const auto& w = packed[e];
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 4 &&
                    w.size(1) == k2 && w.size(2) == kBlockN && n > 0 && n <= w.size(0) * kBlockN &&
                    (e == 0 || w.size(0) == gs.blocks),
                fn, ": weight ", e, " packed as ", w.sizes(), " does not fit input ", x.sizes(),
                " and ", n, " outputs");
    gs.blocks = w.size(0);
    total += sizes[e];
  }
  TORCH_CHECK(total == x.size(0), fn, ": groups of ", total, " rows for ", x.size(0));
  gs.y = torch::empty({total, n}, x.options());
  int64_t r0 = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] > 0) {
      gs.gemms.push_back(Gemm{reinterpret_cast<const uint32_t*>(x.data_ptr()) + r0 * k2, k2,
                              reinterpret_cast<const uint16_t*>(packed[e].data_ptr()), k2, nullptr,
                              reinterpret_cast<uint16_t*>(gs.y.data_ptr()) + r0 * n, n, n});
      gs.rows.push_back(sizes[e]);
    }
    r0 += sizes[e];
  }
  return gs;
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t n) {
  const Call c = prepare("bf16_linear", x, packed, bias, n, 1);
  const int64_t m = c.m, blocks = c.blocks;
  if (m == 0) return c.y.view(c.out_shape);
  // In chunks of kChunkRows rows, each block-major: a thread runs every panel of a block before
  // the next block, so the block is read from memory once and from L2 for the other panels; the
  // last panel prefetches the next.
  for (int64_t r0 = 0; r0 < m; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - r0), panels = (rows + kPanelRows - 1) / kPanelRows;
    Gemm g = c.g;
    g.x += r0 * g.sx;
    g.y += r0 * g.sy;
    at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t nb = t / panels, p = t % panels;
        panel(g, p * kPanelRows, std::min(rows, (p + 1) * kPanelRows), nb,
              p + 1 == panels && t + 1 < end && nb + 1 < blocks);
      }
    });
  }
  return c.y.view(c.out_shape);
}

// A mixture of experts' projections in one call (any group sizes): group e of x's rows times
// expert e's weight, each (group, panel, block) task as bf16_linear runs it, so a row's result
// is the same as there. Why: an expert's group is a few rows at decode, and one call per expert
// left the threads idle between calls and the memory between weights.
torch::Tensor bf16_grouped_linear(torch::Tensor x, std::vector<torch::Tensor> packed,
                                  std::vector<int64_t> sizes, int64_t n) {
  const Groups gs = prepare_groups("bf16_grouped_linear", x, packed, sizes, n, 1);
  const int64_t blocks = gs.blocks, groups = static_cast<int64_t>(gs.gemms.size());
  std::vector<int64_t> first(groups + 1, 0);  // each group's first task
  for (int64_t e = 0; e < groups; ++e)
    first[e + 1] = first[e] + (gs.rows[e] + kPanelRows - 1) / kPanelRows * blocks;
  at::parallel_for(0, first[groups], 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      const int64_t m = gs.rows[e], panels = (m + kPanelRows - 1) / kPanelRows;
      const int64_t nb = (t - first[e]) / panels, p = (t - first[e]) % panels;
      panel(gs.gemms[e], p * kPanelRows, std::min(m, (p + 1) * kPanelRows), nb,
            p + 1 == panels && t + 1 < end && nb + 1 < blocks);
    }
  });
  return gs.y;
}

#ifdef FS_HAVE_AMX_BF16
namespace {

constexpr int kTileRows = 16;       // rows of x per A tile, and per C tile
constexpr int64_t kStepPairs = 16;  // k pairs per tile product (32 k: an A tile row's 64 bytes)
constexpr int64_t kStepBytes = kStepPairs * kBlockN * 2 * 2;  // a block's weight per product step
constexpr int64_t kAmxPrefetchSteps = 2;  // how far ahead the first row tile prefetches (to L1)

// Every tile 16 rows x 64 bytes (vec.h's configure_tiles(8)): C, 16 rows x 16 float32 sums;
// A, 16 rows x 32 bfloat16 of x; B, 16 k pairs x 16 outputs x 2. How `amx_tile` and
// `amx_pair` use the eight, see there.

constexpr int64_t kTileFloats = kTileRows * 16;  // one C tile stored: [16 rows][16 outputs]

// The 16 rows from r0 of `num` C tiles stored at c (tile j at c + j * kTileFloats, outputs
// col0 + 16 j of block nb) into y, with the bias, as bfloat16; rows from m on are not written.
void store_rows(const Gemm& g, int64_t nb, int64_t r0, int64_t m, const float* c, int64_t col0,
                int num) {
  const int64_t first = nb * kBlockN + col0;
  const int64_t valid = std::min<int64_t>(16 * num, g.n - first);
  if (valid <= 0) return;
  const int64_t rows = std::min<int64_t>(kTileRows, m - r0);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* yr = g.y + (r0 + i) * g.sy + first;
    alignas(64) uint16_t buf[kBlockN];
    uint16_t* dst = valid == 16 * num ? yr : buf;  // the last, partial block goes through buf
    for (int j = 0; j < num; ++j) {
      __m512 v = _mm512_loadu_ps(c + j * kTileFloats + i * 16);
      if (g.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(g.bias + first + 16 * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
    }
    if (dst == buf) std::memcpy(yr, buf, valid * sizeof(uint16_t));
  }
}

// C tiles 0-3: zeroed, and stored to c (tile j at c + j * kTileFloats).
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void store_sums(float* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + kTileFloats, 64);
  _tile_stored(2, c + 2 * kTileFloats, 64);
  _tile_stored(3, c + 3 * kTileFloats, 64);
}

// Asks for the block's weight one product step ahead of `wk` (past the block: the next one's).
inline void prefetch_step(const char* wk) {
  const char* ahead = wk + kAmxPrefetchSteps * kStepBytes;
  for (int64_t l = 0; l < kStepBytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
}

// Block nb for the 16 rows from r0 (of the row-padded input). Tiles 0-3: C for the block's
// four 16-output slices; 4: A; 5 and 6: B, taken in turns so that a load overlaps a product.
// `prefetch`: the first row tile of the block reads it from memory, the others from L2.
void amx_tile(const Gemm& g, int64_t nb, int64_t r0, int64_t m, bool prefetch, float* c) {
  const char* wb = reinterpret_cast<const char*>(g.w) + nb * g.block_bytes();
  const char* xr = reinterpret_cast<const char*>(g.x + r0 * g.sx);
  const int64_t x_stride = g.sx * 4;  // bytes per row of x
  zero_sums();
  for (int64_t kp = 0; kp < g.k2; kp += kStepPairs) {
    const char* wk = wb + kp * kBlockN * 4;
    if (prefetch) prefetch_step(wk);
    _tile_loadd(4, xr + kp * 4, x_stride);
    _tile_loadd(5, wk, kBlockN * 4);
    _tile_loadd(6, wk + 64, kBlockN * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wk + 128, kBlockN * 4);
    _tile_loadd(6, wk + 192, kBlockN * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  store_sums(c);
  store_rows(g, nb, r0, m, c, 0, 4);
}

// Block nb for the 32 rows from r0, in two passes of 32 outputs: each B tile loaded is used by
// both row tiles (half the loads of two `amx_tile`s). Tiles 0-1: C of rows r0.. for the pass's
// two 16-output slices, 2-3: of rows r0 + 16..; 4-5: A of each row tile; 6-7: B.
void amx_pair(const Gemm& g, int64_t nb, int64_t r0, int64_t m, bool prefetch, float* c) {
  const char* wb = reinterpret_cast<const char*>(g.w) + nb * g.block_bytes();
  const char* x0 = reinterpret_cast<const char*>(g.x + r0 * g.sx);
  const char* x1 = reinterpret_cast<const char*>(g.x + (r0 + kTileRows) * g.sx);
  const int64_t x_stride = g.sx * 4;
  for (int64_t half = 0; half < 2; ++half) {
    zero_sums();
    for (int64_t kp = 0; kp < g.k2; kp += kStepPairs) {
      const char* wk = wb + kp * kBlockN * 4;
      if (prefetch && half == 0) prefetch_step(wk);  // (the second pass reads it from L2)
      _tile_loadd(4, x0 + kp * 4, x_stride);
      _tile_loadd(5, x1 + kp * 4, x_stride);
      _tile_loadd(6, wk + half * 128, kBlockN * 4);
      _tile_loadd(7, wk + half * 128 + 64, kBlockN * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    store_sums(c);
    store_rows(g, nb, r0, m, c, half * 32, 2);
    store_rows(g, nb, r0 + kTileRows, m, c + 2 * kTileFloats, half * 32, 2);
  }
}

}  // namespace

// Whether this process may use AMX tiles: Linux hands a process the tiles' state only when it
// asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once.
bool amx_ready() {
#ifdef __linux__
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// bf16_linear on AMX tiles, for a weight whose K is a multiple of 32.
torch::Tensor bf16_linear_amx(torch::Tensor x, torch::Tensor packed,
                              c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(amx_ready(), "bf16_linear_amx: Linux refused this process the AMX tile state");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) % kStepPairs == 0,
              "bf16_linear_amx: the weight's K must be a multiple of 32, packed as ", packed.sizes());
  const Call c = prepare("bf16_linear_amx", x, packed, bias, n, kTileRows);
  const int64_t m = c.m;
  if (m == 0) return c.y.view(c.out_shape);
  const Gemm& g = c.g;
  const int64_t row_tiles = c.x2.size(0) / kTileRows;
  // Block-major as bf16_linear: each block is read from memory by its first row tile.
  at::parallel_for(0, c.blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(8);  // NOTE: per thread: the tile configuration is a thread's state
    alignas(64) float sums[4 * kTileRows * 16];
    for (int64_t nb = begin; nb < end; ++nb) {
      int64_t t = 0;
      for (; t + 2 <= row_tiles; t += 2) amx_pair(g, nb, t * kTileRows, m, t == 0, sums);
      if (t < row_tiles) amx_tile(g, nb, t * kTileRows, m, t == 0, sums);
    }
    _tile_release();
  });
  return c.y.view(c.out_shape);
}

// bf16_grouped_linear on AMX tiles: each group a multiple of 16 rows (the tiles' height: the
// caller pads them) and K a multiple of 32; the threads split every (expert, block) task of the
// layer, reading each expert's blocks as bf16_linear_amx does (a row's result is the same).
torch::Tensor bf16_grouped_linear_amx(torch::Tensor x, std::vector<torch::Tensor> packed,
                                      std::vector<int64_t> sizes, int64_t n) {
  TORCH_CHECK(amx_ready(), "bf16_grouped_linear_amx: Linux refused this process the AMX tile state");
  const Groups gs = prepare_groups("bf16_grouped_linear_amx", x, packed, sizes, n, kTileRows);
  TORCH_CHECK(x.size(1) % 32 == 0, "bf16_grouped_linear_amx: K must be a multiple of 32, got ",
              x.sizes());
  const int64_t blocks = gs.blocks;
  const int64_t tasks = static_cast<int64_t>(gs.gemms.size()) * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(8);  // NOTE: per thread, as in bf16_linear_amx
    alignas(64) float sums[4 * kTileRows * 16];
    for (int64_t task = begin; task < end; ++task) {
      const Gemm& g = gs.gemms[task / blocks];
      const int64_t nb = task % blocks, m = gs.rows[task / blocks];
      const int64_t row_tiles = m / kTileRows;
      int64_t t = 0;
      for (; t + 2 <= row_tiles; t += 2) amx_pair(g, nb, t * kTileRows, m, t == 0, sums);
      if (t < row_tiles) amx_tile(g, nb, t * kTileRows, m, t == 0, sums);
    }
    _tile_release();
  });
  return gs.y;
}
#endif  // FS_HAVE_AMX_BF16
#endif  // FS_HAVE_AVX512_BF16
