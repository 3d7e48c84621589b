// Quantized matrix products for XLA's CPU backend, called through the FFI (jax.ffi).
//
//   y[r, n] = sum_c x[r, c] * W[n, c],   W[n, c] = code * scale (+ min) per block of a row
//
// x is float32 [R, C] (R = batch x (K+1) rows, small), W is N x C in its stored blocks,
// layer `layer` of a stack of L such matrices (read in place: no copy of the layer):
//   q4: codes uint8 [L, N, C/2] (GGUF nibble order), scale and min float16 [L, N, C/32]
//   q8: codes int8 [L, N, C], scale float16 or float32 [L, N, C/block]
// Each weight is decoded once to float32 and used for all R rows, so a call reads the
// stored bytes once: a decode step is bound by memory bandwidth, not by arithmetic.
// Each output y[r, n] is accumulated in the same order whatever R is, so scoring K+1
// tokens gives the same numbers as K+1 single steps.
//
// Vector code for AVX-512 and AVX2 is compiled per function (target attributes) and
// chosen at run time from the CPU's flags; other machines use the portable loop.
// Work is split by output rows between the calling thread and XLA's intra-op pool (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECSAMP_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Problem {
  const float* x;        // [R, C]
  const uint8_t* codes;  // q4: [N, C/2]; q8: int8 [N, C]
  const void* scale;     // [N, nb], float16 or float32
  const uint16_t* min;   // q4 only: float16 [N, nb]
  float* y;              // [R, N]
  int64_t rows, cols, n, block;
  bool scale_f32;
  float scale_at(int64_t i) const;
};

const float* half_table() {  // all 65536 float16 values, for the portable loops
  static const float* table = [] {
    float* t = new float[65536];
    for (uint32_t h = 0; h < 65536; ++h) t[h] = half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table;
}

float Problem::scale_at(int64_t i) const {
  return scale_f32 ? static_cast<const float*>(scale)[i]
                   : half_table()[static_cast<const uint16_t*>(scale)[i]];
}

constexpr int kMaxRows = 8;  // rows per pass over a chunk of weights (more: more passes)

// ---- portable
void q4_portable(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t nr) {
  const int64_t nb = p.cols / 32;
  float acc[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < nr; ++r) acc[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = p.scale_at(n * nb + b), m = half_table()[p.min[n * nb + b]];
      const uint8_t* q = p.codes + n * (p.cols / 2) + b * 16;
      float w[32];
      for (int j = 0; j < 16; ++j) {
        w[j] = static_cast<float>(q[j] & 0xf) * d + m;
        w[j + 16] = static_cast<float>(q[j] >> 4) * d + m;
      }
      for (int64_t r = 0; r < nr; ++r) {
        const float* xr = p.x + (r0 + r) * p.cols + b * 32;
        float s = 0.f;
        for (int j = 0; j < 32; ++j) s += w[j] * xr[j];
        acc[r] += s;
      }
    }
    for (int64_t r = 0; r < nr; ++r) p.y[(r0 + r) * p.n + n] = acc[r];
  }
}

void q8_portable(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t nr) {
  const int64_t nb = p.cols / p.block;
  const int8_t* codes = reinterpret_cast<const int8_t*>(p.codes);
  float acc[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < nr; ++r) acc[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = p.scale_at(n * nb + b);
      const int8_t* q = codes + n * p.cols + b * p.block;
      for (int64_t r = 0; r < nr; ++r) {
        const float* xr = p.x + (r0 + r) * p.cols + b * p.block;
        float s = 0.f;
        for (int64_t j = 0; j < p.block; ++j) s += (static_cast<float>(q[j]) * d) * xr[j];
        acc[r] += s;
      }
    }
    for (int64_t r = 0; r < nr; ++r) p.y[(r0 + r) * p.n + n] = acc[r];
  }
}

#ifdef SPECSAMP_X86
__attribute__((target("f16c"))) inline float scale_x86(const Problem& p, int64_t i) {
  return p.scale_f32 ? static_cast<const float*>(p.scale)[i]
                     : _cvtsh_ss(static_cast<const uint16_t*>(p.scale)[i]);
}

// ---- AVX-512: 16 lanes. NR rows at once with two accumulators each (a q4 block is two
// vectors: inputs 0..15 from the low nibbles, 16..31 from the high), all in registers.
template <int NR>
__attribute__((target("avx512f,f16c,fma")))
void q4_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / 32;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 a0[NR], a1[NR];
    for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const uint8_t* qrow = p.codes + n * (p.cols / 2);
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 d = _mm512_set1_ps(scale_x86(p, n * nb + b));
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(p.min[n * nb + b]));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + b * 16));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
      const __m512 w0 = _mm512_fmadd_ps(lo, d, m), w1 = _mm512_fmadd_ps(hi, d, m);
      const float* xb = p.x + r0 * p.cols + b * 32;
      for (int r = 0; r < NR; ++r) {
        a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * p.cols), a0[r]);
        a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * p.cols + 16), a1[r]);
      }
    }
    for (int r = 0; r < NR; ++r)
      p.y[(r0 + r) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
  }
}

template <int NR>
__attribute__((target("avx512f,f16c,fma")))
void q8_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / p.block;
  for (int64_t n = n0; n < n1; ++n) {
    __m512 a0[NR], a1[NR];
    for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 d = _mm512_set1_ps(scale_x86(p, n * nb + b));
      const uint8_t* q = p.codes + n * p.cols + b * p.block;
      const float* xb = p.x + r0 * p.cols + b * p.block;
      int64_t j = 0;
      for (; j + 32 <= p.block; j += 32) {
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)))), d);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j + 16)))), d);
        for (int r = 0; r < NR; ++r) {
          a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * p.cols + j), a0[r]);
          a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * p.cols + j + 16), a1[r]);
        }
      }
      for (; j < p.block; j += 16) {
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)))), d);
        for (int r = 0; r < NR; ++r)
          a0[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xb + r * p.cols + j), a0[r]);
      }
    }
    for (int r = 0; r < NR; ++r)
      p.y[(r0 + r) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
  }
}

// ---- AVX2: 8 lanes, one accumulator per row.
__attribute__((target("avx2,f16c,fma")))
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int NR>
__attribute__((target("avx2,f16c,fma")))
void q4_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / 32;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = _mm256_set1_ps(scale_x86(p, n * nb + b));
      const __m256 m = _mm256_set1_ps(_cvtsh_ss(p.min[n * nb + b]));
      const __m128i q = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(p.codes + n * (p.cols / 2) + b * 16));
      const __m128i lo = _mm_and_si128(q, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
      const __m256 w[4] = {
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m),
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m)};
      const float* xb = p.x + r0 * p.cols + b * 32;
      for (int r = 0; r < NR; ++r)
        for (int k = 0; k < 4; ++k)
          acc[r] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xb + r * p.cols + 8 * k), acc[r]);
    }
    for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.n + n] = hsum256(acc[r]);
  }
}

template <int NR>
__attribute__((target("avx2,f16c,fma")))
void q8_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / p.block;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 d = _mm256_set1_ps(scale_x86(p, n * nb + b));
      const uint8_t* q = p.codes + n * p.cols + b * p.block;
      const float* xb = p.x + r0 * p.cols + b * p.block;
      for (int64_t j = 0; j < p.block; j += 8) {
        const __m128i qi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j));
        const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qi)), d);
        for (int r = 0; r < NR; ++r)
          acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + r * p.cols + j), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.n + n] = hsum256(acc[r]);
  }
}

// Rows at once: up to 8 (AVX-512: 16 accumulators + weights fit in 32 registers).
#define SPECSAMP_DISPATCH(name)                                                        \
  void name##_rows(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t nr) { \
    switch (nr) {                                                                      \
      case 1: return name<1>(p, n0, n1, r0);                                           \
      case 2: return name<2>(p, n0, n1, r0);                                           \
      case 3: return name<3>(p, n0, n1, r0);                                           \
      case 4: return name<4>(p, n0, n1, r0);                                           \
      case 5: return name<5>(p, n0, n1, r0);                                           \
      case 6: return name<6>(p, n0, n1, r0);                                           \
      case 7: return name<7>(p, n0, n1, r0);                                           \
      default: return name<8>(p, n0, n1, r0);                                          \
    }                                                                                  \
  }
SPECSAMP_DISPATCH(q4_avx512)
SPECSAMP_DISPATCH(q8_avx512)
SPECSAMP_DISPATCH(q4_avx2)
SPECSAMP_DISPATCH(q8_avx2)
#endif

using Kernel = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

int isa() {  // 2: AVX-512, 1: AVX2, 0: portable (SPECSAMP_ISA=portable|avx2 caps it)
  static const int level = [] {
    int best = 0;
#ifdef SPECSAMP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
    if (best && __builtin_cpu_supports("avx512f")) best = 2;
#endif
    const char* cap = std::getenv("SPECSAMP_ISA");
    if (cap && std::strcmp(cap, "portable") == 0) best = 0;
    if (cap && std::strcmp(cap, "avx2") == 0 && best > 1) best = 1;
    return best;
  }();
  return level;
}

Kernel pick(bool q4, int64_t block) {
#ifdef SPECSAMP_X86
  const int level = isa();
  if (level == 2 && (q4 || block % 16 == 0)) return q4 ? q4_avx512_rows : q8_avx512_rows;
  if (level >= 1 && (q4 || block % 8 == 0)) return q4 ? q4_avx2_rows : q8_avx2_rows;
#endif
  return q4 ? q4_portable : q8_portable;
}

// Output rows in chunks of 64, split between the caller and the pool (parallel.h).
void run(const Problem& p, Kernel kernel, ffi::ThreadPool& pool) {
  constexpr int64_t chunk = 64;
  static const int64_t cap = [] {
    const char* v = std::getenv("SPECSAMP_KERNEL_HELPERS");
    return v ? std::atoll(v) : int64_t{63};
  }();
  specsamp::parallel_for(pool, (p.n + chunk - 1) / chunk, cap, [&p, kernel](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(p.n, n0 + chunk);
    for (int64_t r0 = 0; r0 < p.rows; r0 += kMaxRows)
      kernel(p, n0, n1, r0, std::min<int64_t>(kMaxRows, p.rows - r0));
  });
}

// Byte offset of layer `layer` in a stack [L, ...] of `bytes` bytes per layer, or -1.
int64_t layer_offset(ffi::Buffer<ffi::S32> layer, int64_t stack, int64_t bytes) {
  const int64_t i = *layer.typed_data();
  return (i < 0 || i >= stack) ? -1 : i * bytes;
}

ffi::Error Q4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                  ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scale,
                  ffi::Buffer<ffi::F16> min, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || xd[1] != 2 * cd[2] || xd[1] % 32 ||
      sd[2] * 32 != xd[1] || sd[1] != cd[1] || sd[0] != cd[0] || min.dimensions().size() != 3 ||
      min.dimensions()[1] != sd[1] || min.dimensions()[2] != sd[2] || min.dimensions()[0] != sd[0])
    return ffi::Error::InvalidArgument(
        "q4 matmul: expected x [R, C], codes [L, N, C/2], scale and min [L, N, C/32]");
  const int64_t n = cd[1], nb = sd[2], at = layer_offset(layer, cd[0], 1);
  if (at < 0) return ffi::Error::InvalidArgument("q4 matmul: layer index out of range");
  Problem p{x.typed_data(), codes.typed_data() + at * n * cd[2],
            reinterpret_cast<const uint16_t*>(scale.untyped_data()) + at * n * nb,
            reinterpret_cast<const uint16_t*>(min.untyped_data()) + at * n * nb,
            y->typed_data(), xd[0], xd[1], n, 32, false};
  run(p, pick(true, 32), pool);
  return ffi::Error::Success();
}

ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                  ffi::Buffer<ffi::S8> codes, ffi::AnyBuffer scale,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || xd[1] != cd[2] || xd[1] % sd[2] ||
      sd[1] != cd[1] || sd[0] != cd[0])
    return ffi::Error::InvalidArgument(
        "q8 matmul: expected x [R, C], codes [L, N, C], scale [L, N, nb]");
  const bool f32 = scale.element_type() == ffi::DataType::F32;
  if (!f32 && scale.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("q8 matmul: scale must be float16 or float32");
  const int64_t n = cd[1], nb = sd[2], at = layer_offset(layer, cd[0], 1);
  if (at < 0) return ffi::Error::InvalidArgument("q8 matmul: layer index out of range");
  const char* scales = static_cast<const char*>(scale.untyped_data()) + at * n * nb * (f32 ? 4 : 2);
  Problem p{x.typed_data(), reinterpret_cast<const uint8_t*>(codes.typed_data()) + at * n * cd[2],
            scales, nullptr, y->typed_data(), xd[0], xd[1], n, xd[1] / nb, f32};
  run(p, pick(false, p.block), pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampQ4Matmul, Q4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampQ8Matmul, Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int specsamp_isa() { return isa(); }
