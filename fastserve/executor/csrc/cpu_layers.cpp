// Two small steps of every layer on CPU, one call each instead of several torch ops:
// - add + RMSNorm (torch: about eight elementwise ops, each a pass over memory and a dispatch):
//   measured on 2 cores, bfloat16, 768 wide, 2x faster at 32 rows, 4x at 4096;
// - the KV store (torch: index_copy_ over a byte view, ~60 us at 32 tokens): 7x faster.
//
// The norm keeps the plain layer's roundings (fastserve/model/layers.py): the same products and
// sums, each rounded to the model's dtype where the tensor ops round it (float32 math inside,
// as torch's CPU kernels for half types); built with -ffp-contract=off, so that no a*b + c is
// fused into a multiply-add the tensor ops do not make. Only its sum's order differs: the
// result is bit for bit torch's in bfloat16, within a last place in float16 and float32.
// With AVX-512 BF16, bfloat16 SiLU-and-mul and rotary too (below; elsewhere torch's ops); and
// float32 rotary on every CPU.
#include "aten_api.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// Rows per parallel chunk: a decode batch's few rows stay on the calling thread.
constexpr int64_t kGrainRows = 16;

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename Fn>
void with_model_type(torch::ScalarType dt, const char* op, Fn&& fn) {
  if (dt == torch::kFloat32) fn(float{});
  else if (dt == torch::kBFloat16) fn(BF16{});
  else if (dt == torch::kHalf) fn(F16{});
  else TORCH_CHECK(false, op, ": float32, bfloat16 or float16 expected, got ", dt);
}

#ifdef FS_HAVE_AVX512_BF16
void rms_norm_row_bf16(const BF16* xr, const BF16* rr, const BF16* w, BF16* o, BF16* ro,
                       float* xf, int64_t hidden, float eps);
#endif

template <typename T>
void rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* res_out, int64_t rows,
                   int64_t hidden, int64_t sx, int64_t sr, float eps) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * sx;
#ifdef FS_HAVE_AVX512_BF16
      if constexpr (std::is_same_v<T, BF16>) {
        rms_norm_row_bf16(xr, res == nullptr ? nullptr : res + r * sr, w, out + r * hidden,
                          res_out == nullptr ? nullptr : res_out + r * hidden, xf.data(), hidden,
                          eps);
        continue;
      }
#endif
      float ss = 0.f;
      if (res != nullptr) {  // residual + x, rounded to the model dtype (kept as the new residual)
        const T* rr = res + r * sr;
        T* ro = res_out + r * hidden;
        for (int64_t j = 0; j < hidden; ++j) {
          const T s = round_to<T>(static_cast<float>(rr[j]) + static_cast<float>(xr[j]));
          ro[j] = s;
          xf[j] = static_cast<float>(s);
        }
      } else {
        for (int64_t j = 0; j < hidden; ++j) xf[j] = static_cast<float>(xr[j]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < hidden; ++j) ss += xf[j] * xf[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t j = 0; j < hidden; ++j) {  // weight * (x * rsqrt(var + eps)).to(dtype)
        const float y = static_cast<float>(round_to<T>(xf[j] * inv));
        o[j] = round_to<T>(static_cast<float>(w[j]) * y);
      }
    }
  });
}

template <typename Src, typename Dst>
void store_rows(const Src* src, Dst* cache, const int64_t* slots, int64_t tokens, int64_t heads,
                int64_t dim, int64_t s0, int64_t s1, int64_t num_slots) {
  at::parallel_for(0, tokens, 4 * kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const Src* in = src + t * s0 + h * s1;
        Dst* o = cache + (h * num_slots + slot) * dim;
        if constexpr (std::is_same_v<Src, Dst>)
        std::memcpy(o, in, dim * sizeof(Dst));
      else
        for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<Dst>(static_cast<float>(in[j]));
      }
    }
  });
}

// float32 rotary: each product and sum one float32 operation, as the tensor ops compute them
// (no multiply-add is fused: -ffp-contract=off), so the result is torch's bit for bit; one
// pass over q or k in place of torch's four products, two sums and a concatenation. The
// compiler vectorises the inner loop.
void rotary_f32_rows(const float* x, const float* cos, const float* sin, float* out,
                     int64_t tokens, int64_t heads, int64_t half, int64_t sx0, int64_t sx1,
                     int64_t sc) {
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * sc;
      const float* s = sin + t * sc;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = x + t * sx0 + h * sx1;
        const float* x2 = x1 + half;
        float* o = out + (t * heads + h) * 2 * half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = x1[j], b2 = x2[j];
          o[j] = a * c[j] - b2 * s[j];
          o[half + j] = b2 * c[j] + a * s[j];
        }
      }
    }
  });
}

#ifdef FS_HAVE_AVX512_BF16
// bfloat16 SiLU-and-mul and rotary, sixteen lanes at a time, for CPUs with AVX-512 BF16 (where
// bfloat16 models run). As scalar loops they were no faster than torch's vectorised ops; as
// these, one pass each. Every product and sum is rounded to bfloat16 where torch rounds it
// (`_mm512_cvtneps_pbh`: to nearest even, as torch's cast); silu's exp is a Cephes polynomial
// (~1 ulp in float32, as torch's), so its bfloat16 result is torch's but at rare ties.
inline void store16(BF16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// One row of add + RMSNorm (rms_norm_rows' scalar body, the same roundings), sixteen lanes at
// a time: the scalar casts were 4x slower on a 4096-token prefill's rows (768 wide).
void rms_norm_row_bf16(const BF16* xr, const BF16* rr, const BF16* w, BF16* o, BF16* ro,
                       float* xf, int64_t hidden, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= hidden; j += 16) {
    __m512 s = widen16(xr + j);
    if (rr != nullptr) {  // residual + x, rounded (kept as the new residual)
      s = round16(_mm512_add_ps(widen16(rr + j), s));
      store16(ro + j, s);
    }
    _mm512_storeu_ps(xf + j, s);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(s, s));
  }
  float ss = _mm512_reduce_add_ps(acc);
  for (; j < hidden; ++j) {
    float s = static_cast<float>(xr[j]);
    if (rr != nullptr) {
      const BF16 sum = static_cast<BF16>(static_cast<float>(rr[j]) + s);
      ro[j] = sum;
      s = static_cast<float>(sum);
    }
    xf[j] = s;
    ss += s * s;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  j = 0;
  for (; j + 16 <= hidden; j += 16)  // weight * (x * rsqrt(var + eps)).to(dtype)
    store16(o + j, _mm512_mul_ps(widen16(w + j), round16(_mm512_mul_ps(_mm512_loadu_ps(xf + j), iv))));
  for (; j < hidden; ++j) {
    const float y = static_cast<float>(static_cast<BF16>(xf[j] * inv));
    o[j] = static_cast<BF16>(static_cast<float>(w[j]) * y);
  }
}

void silu_mul_bf16(const BF16* x, BF16* out, int64_t rows, int64_t inter, int64_t sx) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const BF16* g = x + r * sx;
      const BF16* u = g + inter;
      BF16* o = out + r * inter;
      int64_t j = 0;
      for (; j + 16 <= inter; j += 16) {
        const __m512 gf = widen16(g + j);
        const __m512 act = round16(_mm512_div_ps(gf, _mm512_add_ps(one, exp512(_mm512_sub_ps(
                                                          _mm512_setzero_ps(), gf)))));
        store16(o + j, _mm512_mul_ps(act, widen16(u + j)));
      }
      for (; j < inter; ++j) {
        const float gf = static_cast<float>(g[j]);
        const float act = static_cast<float>(static_cast<BF16>(gf / (1.f + std::exp(-gf))));
        o[j] = static_cast<BF16>(act * static_cast<float>(u[j]));
      }
    }
  });
}

// half % 16 == 0 (head_dim 32, 64, 128, ...).
void rotary_bf16(const BF16* x, const BF16* cos, const BF16* sin, BF16* out, int64_t tokens,
                 int64_t heads, int64_t half, int64_t sx0, int64_t sx1, int64_t sc) {
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const BF16* x1 = x + t * sx0 + h * sx1;
        BF16* o = out + (t * heads + h) * 2 * half;
        for (int64_t j = 0; j < half; j += 16) {
          const __m512 a = widen16(x1 + j), b = widen16(x1 + half + j);
          const __m512 c = widen16(cos + t * sc + j), s = widen16(sin + t * sc + j);
          store16(o + j, _mm512_sub_ps(round16(_mm512_mul_ps(a, c)), round16(_mm512_mul_ps(b, s))));
          store16(o + half + j,
                  _mm512_add_ps(round16(_mm512_mul_ps(b, c)), round16(_mm512_mul_ps(a, s))));
        }
      }
    }
  });
}
#endif

}  // namespace

// x, residual: [num_tokens, hidden] (unit last stride); weight [hidden]. Returns
// [norm(x + residual), x + residual] or, without a residual, [norm(x)].
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                    torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x [num_tokens, hidden], unit stride");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "rms_norm: a contiguous weight of x's dtype expected");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto out = torch::empty({rows, hidden}, x.options());
  torch::Tensor res_out;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must match x");
    res_out = torch::empty({rows, hidden}, x.options());
  }
  with_model_type(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr,
                     weight.data_ptr<T>(), out.data_ptr<T>(),
                     residual ? res_out.data_ptr<T>() : nullptr, rows, hidden, x.stride(0),
                     residual ? residual->stride(0) : 0, static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, res_out};
  return {out};
}

// k, v: [num_tokens, num_kv_heads, head_dim] (unit last stride) of the model's dtype, stored
// (converted) at slot_mapping [num_tokens] (int64; -1: nowhere) of k/v_cache
// [num_kv_heads, num_slots, head_dim] (contiguous; float32, bfloat16 or float16).
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "store_kv: int64 slot mapping expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: caches must be contiguous");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t num_slots = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (auto* pair : {&k, &v}) {
    const torch::Tensor& src = *pair;
    torch::Tensor& cache = pair == &k ? k_cache : v_cache;
    TORCH_CHECK(src.stride(2) == 1 && src.size(0) == slot_mapping.size(0),
                "store_kv: k/v [num_tokens, num_kv_heads, head_dim], unit stride");
    with_model_type(src.scalar_type(), "store_kv", [&](auto stag) {
      using S = decltype(stag);
      with_model_type(cache.scalar_type(), "store_kv", [&](auto dtag) {
        using D = decltype(dtag);
        store_rows<S, D>(src.data_ptr<S>(), cache.data_ptr<D>(), slots, tokens, heads, dim,
                         src.stride(0), src.stride(1), num_slots);
      });
    });
  }
}

// x: [num_tokens, num_heads, head_dim] float32 (unit last stride, head_dim even); cos, sin:
// [num_tokens, 1, head_dim / 2] float32 (unit last stride). Returns the rotated x, contiguous:
// apply_rotary's result bit for bit.
torch::Tensor rotary_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 &&
                  x.size(2) % 2 == 0,
              "rotary_f32: float32 x [num_tokens, num_heads, even head_dim], unit stride");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.size(0) == tokens && sin.size(0) == tokens && cos.size(-1) == half &&
                  sin.size(-1) == half && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                  cos.stride(0) == sin.stride(0),
              "rotary_f32: cos and sin [num_tokens, 1, head_dim / 2] float32, unit stride");
  auto out = torch::empty(x.sizes(), x.options());
  rotary_f32_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  out.data_ptr<float>(), tokens, heads, half, x.stride(0), x.stride(1),
                  cos.stride(0));
  return out;
}

#ifdef FS_HAVE_AVX512_BF16
// x: [num_tokens, 2 * inter] = [gate | up], bfloat16, unit last stride -> silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) % 2 == 0,
              "silu_and_mul: bfloat16 x [num_tokens, 2 * inter], unit stride");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  silu_mul_bf16(x.data_ptr<BF16>(), out.data_ptr<BF16>(), rows, inter, x.stride(0));
  return out;
}

// x: [num_tokens, num_heads, head_dim] bfloat16 (unit last stride); cos, sin:
// [num_tokens, 1, head_dim / 2] bfloat16 (unit last stride). Returns the rotated x, contiguous.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 &&
                  x.size(2) % 32 == 0,
              "rotary: bfloat16 x [num_tokens, num_heads, head_dim % 32 == 0], unit stride");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.size(0) == tokens && cos.size(-1) == half && cos.stride(-1) == 1 &&
                  sin.stride(-1) == 1 && cos.stride(0) == sin.stride(0),
              "rotary: cos and sin [num_tokens, 1, head_dim / 2] of x's dtype");
  auto out = torch::empty(x.sizes(), x.options());
  rotary_bf16(x.data_ptr<BF16>(), cos.data_ptr<BF16>(), sin.data_ptr<BF16>(), out.data_ptr<BF16>(),
              tokens, heads, half, x.stride(0), x.stride(1), cos.stride(0));
  return out;
}
#endif
