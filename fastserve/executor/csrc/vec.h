// Vector helpers shared by the CPU kernels (decode_attention.cpp, cpu_layers.cpp), which are
// compiled with -march=native: the paths below exist where this CPU has the instructions.
//   FS_HAVE_AVX2         AVX2 + FMA: eight float32 lanes.
//   FS_HAVE_AVX512_BF16  AVX-512 F + BF16: bfloat16 dot products and conversions, sixteen lanes
//                        (FS_NO_AVX512_BF16 builds without it, for side-by-side timing).
//   FS_HAVE_AMX_BF16     AMX tiles with bfloat16 dot products (with AVX-512 BF16 only).
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FS_HAVE_AVX2 1
#endif

#if defined(FS_HAVE_AVX2) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    !defined(FS_NO_AVX512_BF16)
#define FS_HAVE_AVX512_BF16 1
#endif

// AMX tiles (bfloat16 dot products 16 rows x 16 outputs x 32 k at a time): the matmul's decode
// path on CPUs that have them (cpu_gemm.cpp); off with the AVX-512 BF16 paths.
#if defined(FS_HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FS_HAVE_AMX_BF16 1
#endif

namespace {

using BF16 = c10::BFloat16;
using F16 = c10::Half;

#ifdef FS_HAVE_AVX2
// Eight cache values from p as float32.
template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<BF16>(const BF16* p) {  // bfloat16 is float32's top half: shift it back
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
template <>
inline __m256 load8<F16>(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

#ifdef FS_HAVE_AVX2
// exp's constants (Cephes, as in avx_mathfun), for the 8- and 16-lane versions alike.
constexpr float kExpMax = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

// exp of 8 floats (Cephes polynomial, as in avx_mathfun): ~1 ulp over the range softmax uses
// (inputs <= 0; anything below -87 underflows to ~0 and is masked by the caller anyway).
inline __m256 exp256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpMax));
  x = _mm256_max_ps(x, _mm256_set1_ps(-kExpMax));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, one));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

#ifdef FS_HAVE_AVX512_BF16
// Sixteen bfloat16 values from p as float32.
inline __m512 widen16(const BF16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x rounded to bfloat16 (to nearest even, as torch's cast) and back to float32.
inline __m512 round16(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp of 16 floats: exp256's polynomial and steps on sixteen lanes (each lane's operations, and
// so its result, are exp256's: floor is a round toward -inf, the rest the same instructions).
inline __m512 exp512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  x = _mm512_max_ps(x, _mm512_set1_ps(-kExpMax));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, one));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}
#endif

#ifdef FS_HAVE_AMX_BF16
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0 .. num - 1 as 16 rows x 64 bytes each (C: 16 x 16 float32; A: 16 x 32 bfloat16; B:
// 16 pairs x 16). NOTE: per thread: the tile configuration is a thread's state.
inline void configure_tiles(int num) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < num; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace
