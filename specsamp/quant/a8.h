// Products with 8-bit activations ("stored-a8" weights: W4A8 / W8A8, llama.cpp's arithmetic
// for Q4_1 and Q8_0 matrices), on weights in the tile layout (amx.h, `specsamp.quant.blocks`).
//
// Why: on the float path (qkernels.cc) each further row of x costs two FMAs per 32 weights,
// so scoring K + 1 tokens or a token tree costs each further row a fifth of a step on a CPU
// without AMX: the FMA units, not the memory, bound a call of several rows. With x rounded
// to bytes, one VNNI instruction (vpdpbusd) sums 64 byte products into 16 int32 lanes:
// four times the products of an FMA, and the codes stay bytes.
//
// The numbers (every path below gives the same bits, the portable one included):
//   x's row r, block b of 32 inputs: a = max |x|, dx = a / 127, X_i = round_even(x_i * (127 / a))
//     (a = 0: dx = 0, X = 0; a not finite: dx = NaN, so the row's outputs are NaN), S = sum X_i;
//   output n: acc = 0; for each block b in order:
//     I = sum_i q_i X_i (exact, int32),
//     q4: t = fma(float(I), d[n, b], m[n, b] * S)     q8: t = float(I) * d[n, b]
//     acc = fma(t, dx, acc)
//   y[r, n] = acc.
// A row's outputs depend on that row alone, so K + 1 rows give the numbers of K + 1 single
// steps, and a batch's rows the numbers they have alone. This is a different model from the
// float path's by the rounding of x (about 1/254 of a block's largest input), as llama.cpp's
// own products are.
//
// Vector code: 16 outputs (a tile-layout group) in a vector's lanes; per block the codes
// are 4 (q4: low and high nibbles) or 8 (q8) vectors of [16 outputs x 4 inputs] bytes, and
// each row's 4 bytes are broadcast against them. vpdpbusd multiplies unsigned by signed
// bytes: q4 codes are unsigned (0..15) against signed X; q8 codes are signed against
// X + 128 (unsigned), and 128 * sum q (one product against 128s per block, shared by the
// rows) is taken off.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "half.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace specsamp::a8 {

// x's rows as bytes, prepared once per call: X [R, C] (signed), X + 128 [R, C] (unsigned,
// for q8 codes), dx and float(S) [R, C/32].
struct Rows {
  const int8_t* x;
  const uint8_t* u;
  const float* dx;
  const float* sum;
};

// One row's blocks (prepare_row picks the vector version where the CPU has AVX-512).
inline void prepare_row_portable(const float* x, int64_t cols, int8_t* q, uint8_t* u, float* dx,
                                 float* sum) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    float a = 0.f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float v = std::fabs(xb[i]);
      finite = finite && v <= std::numeric_limits<float>::max();
      a = v > a ? v : a;
    }
    int s = 0;
    const float inv = (finite && a > 0.f) ? 127.f / a : 0.f;
    for (int i = 0; i < 32; ++i) {
      float r = std::nearbyint(xb[i] * inv);  // round half to even (the default mode)
      r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
      const int v = finite ? static_cast<int>(r) : 0;
      q[32 * b + i] = static_cast<int8_t>(v);
      u[32 * b + i] = static_cast<uint8_t>(v + 128);
      s += v;
    }
    dx[b] = finite ? a / 127.f : std::numeric_limits<float>::quiet_NaN();
    sum[b] = static_cast<float>(s);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// prepare_row_portable's numbers, 32 inputs in two vectors: the same largest magnitude
// (a maximum is exact in any order), the same products x_i * (127 / a) rounded to nearest
// even, the same clamp and exact integer sum. The scalar loop, compiled for plain x86-64,
// called the C library's nearbyint for every input: a tenth of a 3-row call's time.
__attribute__((target("avx512f")))
inline void prepare_row_avx512(const float* x, int64_t cols, int8_t* q, uint8_t* u, float* dx,
                               float* sum) {
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    // finite: every |x| <= the largest float (false for inf and NaN)
    const bool finite = (_mm512_cmp_ps_mask(a0, largest, _CMP_LE_OQ) &
                         _mm512_cmp_ps_mask(a1, largest, _CMP_LE_OQ)) == 0xffff;
    float a = 0.f;
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    if (finite) {
      a = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      constexpr int kEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, inv), kEven);
      const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, inv), kEven);
      i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
      i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
    }
    const __m128i b0 = _mm512_cvtepi32_epi8(i0), b1 = _mm512_cvtepi32_epi8(i1);
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));  // v + 128 as a byte
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), b0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), b1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 32 * b), _mm_xor_si128(b0, flip));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 32 * b + 16), _mm_xor_si128(b1, flip));
    dx[b] = finite ? a / 127.f : std::numeric_limits<float>::quiet_NaN();
    sum[b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
}
#endif

// x's row of `cols` inputs (a multiple of 32) as bytes: q (X), u (X + 128), dx and float(S)
// per block; `vector`: the CPU runs AVX-512 (specsamp::isa() == 2).
inline void prepare_row(bool vector, const float* x, int64_t cols, int8_t* q, uint8_t* u,
                        float* dx, float* sum) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (vector) return prepare_row_avx512(x, cols, q, u, dx, sum);
#endif
  prepare_row_portable(x, cols, q, u, dx, sum);
}

// Where output n's code for input c of block b sits in the tile layout: byte offset within
// the group's block and, for q4, whether it is the high nibble.
inline int64_t tile_byte(bool q4, int64_t j, int64_t c, bool* high) {
  if (q4) {
    *high = c >= 16;
    const int64_t e = c & 15;
    return (e / 4) * 64 + j * 4 + e % 4;
  }
  *high = false;
  return (c / 4) * 64 + j * 4 + c % 4;
}

// Outputs n0..n1 (whole groups of 16) of rows r0..r0 + nr, any machine.
inline void product_portable(bool q4, const uint8_t* codes, const uint16_t* scale,
                             const uint16_t* minimum, int64_t cols, int64_t n, const Rows& x,
                             float* y, int64_t n0, int64_t n1, int64_t r0, int64_t nr) {
  const int64_t nb = cols / 32, per = q4 ? 256 : 512;  // code bytes of a group's block
  for (int64_t o = n0; o < n1; ++o) {
    const int64_t g = o / 16, j = o % 16;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = codes + (g * nb + b) * per;
        const int8_t* xb = x.x + r * cols + 32 * b;
        int32_t dot = 0;
        for (int64_t c = 0; c < 32; ++c) {
          bool high;
          const uint8_t byte = block[tile_byte(q4, j, c, &high)];
          const int32_t code = q4 ? (high ? byte >> 4 : byte & 0xf) : static_cast<int8_t>(byte);
          dot += code * xb[c];
        }
        const float d = half_to_float(scale[(g * nb + b) * 16 + j]);
        const float fi = static_cast<float>(dot);
        const float t = q4 ? std::fma(fi, d, half_to_float(minimum[(g * nb + b) * 16 + j]) *
                                                 x.sum[r * nb + b])
                           : fi * d;
        acc = std::fma(t, x.dx[r * nb + b], acc);
      }
      y[r * n + o] = acc;
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
inline int32_t word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// NR rows of outputs n0..n1 (whole groups of 16) on AVX-512 VNNI.
template <int NR, bool Q4>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void product(const uint8_t* codes, const uint16_t* scale, const uint16_t* minimum, int64_t cols,
             int64_t n, const Rows& x, float* y, int64_t n0, int64_t n1, int64_t r0) {
  constexpr int kVectors = Q4 ? 4 : 8;  // code vectors of a group's block
  const int64_t nb = cols / 32, per = 64 * kVectors, groups = n / 16;
  const __m512i nibble = _mm512_set1_epi8(0x0f), offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = n0 / 16; g < n1 / 16; ++g) {
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* cg = codes + g * nb * per;
    const int64_t ahead = std::min<int64_t>(g + 2, groups - 1) - g;  // groups prefetched ahead
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* cb = cg + b * per;
      for (int l = 0; l < kVectors; ++l) _mm_prefetch(reinterpret_cast<const char*>(cb + ahead * nb * per + 64 * l), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + ((g + ahead) * nb + b) * 16), _MM_HINT_T0);
      if (Q4) _mm_prefetch(reinterpret_cast<const char*>(minimum + ((g + ahead) * nb + b) * 16), _MM_HINT_T0);
      __m512i w[2 * 4];  // q4: low nibbles (inputs 0-15), high (16-31); q8: the 8 vectors
      if (Q4) {
        for (int l = 0; l < 4; ++l) {
          const __m512i v = _mm512_loadu_si512(cb + 64 * l);
          w[l] = _mm512_and_si512(v, nibble);
          w[4 + l] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
      } else {
        for (int l = 0; l < 8; ++l) w[l] = _mm512_loadu_si512(cb + 64 * l);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + (g * nb + b) * 16)));
      __m512 m = _mm512_setzero_ps();
      __m512i bias = _mm512_setzero_si512();  // q8: 128 * sum of the codes of 4 inputs
      if (Q4) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + (g * nb + b) * 16)));
      } else {
        for (int l = 0; l < 8; ++l) bias = _mm512_dpbusd_epi32(bias, offset, w[l]);
      }
      for (int r = 0; r < NR; ++r) {
        const int64_t row = r0 + r;
        __m512i dot = Q4 ? _mm512_setzero_si512() : _mm512_sub_epi32(_mm512_setzero_si512(), bias);
        if (Q4) {
          const int8_t* xb = x.x + row * cols + 32 * b;
          for (int l = 0; l < 4; ++l) dot = _mm512_dpbusd_epi32(dot, w[l], _mm512_set1_epi32(word(xb + 4 * l)));
          for (int l = 0; l < 4; ++l) dot = _mm512_dpbusd_epi32(dot, w[4 + l], _mm512_set1_epi32(word(xb + 16 + 4 * l)));
        } else {
          const uint8_t* ub = x.u + row * cols + 32 * b;
          for (int l = 0; l < 8; ++l) dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(word(ub + 4 * l)), w[l]);
        }
        const __m512 fi = _mm512_cvtepi32_ps(dot);
        const __m512 t = Q4 ? _mm512_fmadd_ps(fi, d, _mm512_mul_ps(m, _mm512_set1_ps(x.sum[row * nb + b])))
                            : _mm512_mul_ps(fi, d);
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(x.dx[row * nb + b]), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + (r0 + r) * n + 16 * g, acc[r]);
  }
}
#endif

}  // namespace specsamp::a8
