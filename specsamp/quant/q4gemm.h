// Q4 products with many rows (prefill, large batches) on AVX-512, giving bit for bit the
// numbers of the row-pass kernel (q4_avx512 in qkernels.cc), faster where inputs are few
// enough (up to 1,024: `pick` in qkernels.cc says where it is used).
//
// The row-pass kernel decodes each block of 32 weights again for every pass of at most 6
// rows: a third of its vector instructions. Here 32 outputs are decoded once per work item
// (60 rows) into a buffer, transposed (16 outputs in a vector's lanes, one vector per
// input), and each row's inputs are broadcast against it: the inner loop is loads and FMAs.
//
// The same numbers: the row-pass kernel sums output n of row r as 32 partial sums S_l over
// inputs l, l + 32, l + 64, ... (lane l of its low- and high-nibble accumulators), each a
// chain of FMAs from zero in block order, then adds V_l = S_l + S_l+16 and the V_l in the
// tree of reduce16. Here each S_l is a chain of its own (lanes: 16 outputs at once) and the
// same additions follow. tests/test_quant.py checks the two paths bit for bit.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specsamp {

// Sum of a vector's 16 lanes in a fixed tree: (l + l+8), then + l+4, + l+2, + l+1. Both
// paths end with it (written out: _mm512_reduce_add_ps's order is the compiler's choice).
__attribute__((target("avx512f"))) inline float reduce16(__m512 v) {
  const __m256 t3 = _mm256_add_ps(
      _mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// wt[(l * nb + b) * nv + v][lane] = weight (output n0 + 16 v + lane, input 32 b + l), for
// nv vectors of 16 outputs: code * scale + min by one FMA, as the row-pass kernel's table.
__attribute__((target("avx512f,f16c,fma")))
inline void q4_decode_transposed(const uint8_t* codes, const uint16_t* scale, const uint16_t* minimum,
                                 int64_t cols, int64_t n0, int nv, float* wt) {
  const int64_t nb = cols / 32, half = cols / 2;
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(half)));
  const __m512i nibble = _mm512_set1_epi32(0xf);
  for (int v = 0; v < nv; ++v) {
    const int64_t n = n0 + 16 * v;
    for (int64_t b = 0; b < nb; ++b) {
      alignas(64) float ds[16], ms[16];  // the 16 outputs' scale and minimum of block b
      for (int o = 0; o < 16; ++o) {
        ds[o] = _cvtsh_ss(scale[(n + o) * nb + b]);
        ms[o] = _cvtsh_ss(minimum[(n + o) * nb + b]);
      }
      const __m512 d = _mm512_load_ps(ds), m = _mm512_load_ps(ms);
      const uint8_t* base = codes + n * half + b * 16;
      for (int j4 = 0; j4 < 4; ++j4) {  // 4 code bytes of each of the 16 outputs at once
        const __m512i g = _mm512_i32gather_epi32(rows, base + 4 * j4, 1);
        for (int t = 0; t < 4; ++t) {
          const int64_t j = 4 * j4 + t;
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(g, 8 * t), nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(g, 8 * t + 4), nibble);
          _mm512_store_ps(wt + ((j * nb + b) * nv + v) * 16,
                          _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
          _mm512_store_ps(wt + (((j + 16) * nb + b) * nv + v) * 16,
                          _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
        }
      }
    }
  }
}

// acc = S_l for R rows and NV vectors of outputs: a chain of FMAs from zero over the blocks.
template <int NV, int R>
__attribute__((target("avx512f,fma"), always_inline))
inline void q4_chain(const float* wt, const float* x, int64_t cols, int l, __m512 (&acc)[R][NV]) {
  const int64_t nb = cols / 32;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* w = wt + l * nb * NV * 16;
  const float* xl = x + l;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_load_ps(w + (b * NV + v) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xl[r * cols + 32 * b]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(wv[v], xb, acc[r][v]);
    }
  }
}

// y[r, 16 v + lane] for R rows and NV vectors of outputs from the decoded chunk wt.
// Residues 0-15 first, then 16-31: a row's inputs 32 b + l for l < 16 share cache lines,
// so each half's lines (6 rows x 32 blocks at most: 12 KB) stay in L1 while their 16
// chains run. V_l = S_l + S_l+16 is kept in memory between the halves.
template <int NV, int R>
__attribute__((target("avx512f,fma")))
void q4_gemm_rows(const float* x, int64_t cols, const float* wt, float* y, int64_t ldy) {
  __m512 V[16][R][NV];
  for (int l = 0; l < 32; ++l) {
    __m512 s[R][NV];
    q4_chain<NV, R>(wt, x, cols, l, s);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v)
        V[l & 15][r][v] = l < 16 ? s[r][v] : _mm512_add_ps(V[l & 15][r][v], s[r][v]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      __m512 u[8], w4[4], z[2];
      for (int i = 0; i < 8; ++i) u[i] = _mm512_add_ps(V[i][r][v], V[i + 8][r][v]);
      for (int i = 0; i < 4; ++i) w4[i] = _mm512_add_ps(u[i], u[i + 4]);
      for (int i = 0; i < 2; ++i) z[i] = _mm512_add_ps(w4[i], w4[i + 2]);
      _mm512_storeu_ps(y + r * ldy + 16 * v, _mm512_add_ps(z[0], z[1]));
    }
}

}  // namespace specsamp
