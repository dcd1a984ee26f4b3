// bfloat16 linear layers, y = x W^T (+ b), on a CPU with AVX-512 BF16 (no AMX).
//
// Why our own: oneDNN's bf16 matmul with a packed weight reached 16-21 GB/s of weight reads at
// decode batches on a 2-core Zen 4, where a plain sum over memory reaches 28-36 GB/s; a decode
// step of the small preset streams 219 MB of weights, so the matmuls set the step's time.
// Measured side by side on the small preset's 49 matmuls (2 cores, medians,
// benchmarks/cpu_matmul.py): 1.8x oneDNN at 1-16 rows, 1.35x at 32, 1.07x at 256 (compute-bound
// there, ~85% of the `vdpbf16ps` peak), 1.0x at 2048 and 0.91x at 4096 (the input no longer
// stays in cache; cpu_linear.py sends such calls elsewhere). Where the CPU has AMX, oneDNN's
// tiles are left to do it (cpu_linear.py).
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "vec.h"

#ifdef FS_HAVE_AVX512_BF16
namespace {

constexpr int64_t kBlockN = 64;     // outputs per packed block
constexpr int kMaxTileRows = 6;     // rows per register tile
constexpr int64_t kPanelRows = 48;  // rows per parallel task
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

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t n) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              "bf16_linear: bfloat16 input and weight expected, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == (k + 1) / 2 && packed.size(2) == kBlockN &&
                  n > 0 && n <= packed.size(0) * kBlockN,
              "bf16_linear: weight packed as ", packed.sizes(), " does not fit input ", x.sizes(),
              " and ", n, " outputs");
  const int64_t k2 = packed.size(1), blocks = packed.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  torch::Tensor x2 = x.reshape({-1, k});
  if (k % 2) x2 = at::constant_pad_nd(x2, {0, 1});  // a zero pair's second half
  if (x2.stride(1) != 1 || x2.stride(0) % 2 || reinterpret_cast<uintptr_t>(x2.data_ptr()) % 4)
    x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  auto y = torch::empty({m, n}, x.options());
  torch::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bf16_linear: bias of ", bias->numel(), " for ", n, " outputs");
    bias_f = at::constant_pad_nd(bias->to(torch::kFloat32).reshape({n}), {0, blocks * kBlockN - n});
  }
  if (m == 0) return y.view(out_shape);
  const Gemm g{reinterpret_cast<const uint32_t*>(x2.data_ptr()), x2.stride(0) / 2,
               reinterpret_cast<const uint16_t*>(packed.data_ptr()), k2,
               bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
               reinterpret_cast<uint16_t*>(y.data_ptr()), n, n};
  const int64_t panels = (m + kPanelRows - 1) / kPanelRows;
  // Block-major: a thread runs every panel of a block before the next block, so the block is
  // read from memory once and from L2 for the other panels; the last panel prefetches the next.
  at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t nb = t / panels, p = t % panels;
      panel(g, p * kPanelRows, std::min(m, (p + 1) * kPanelRows), nb,
            p + 1 == panels && t + 1 < end && nb + 1 < blocks);
    }
  });
  return y.view(out_shape);
}
#endif  // FS_HAVE_AVX512_BF16
