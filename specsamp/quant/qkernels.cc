// Quantized matrix products for XLA's CPU backend, called through the FFI (jax.ffi).
//
//   y[r, n] = sum_c x[r, c] * W[n, c],   W[n, c] = code * scale (+ min) per block of a row
//
// x is float32 [R, C] (R = batch x (K+1) rows in a decode step, thousands in a prefill),
// W is N x C in its stored blocks, layer `layer` of a stack of L such matrices (read in
// place: no copy of the layer):
//   q4: codes uint8 [L, N, C/2] (GGUF nibble order), scale and min float16 [L, N, C/32]
//   q8: codes int8 [L, N, C], scale float16 or float32 [L, N, C/block]
// Each weight is decoded once to float32 and used for all R rows, so a call reads the
// stored bytes once: one row is bound by memory bandwidth, several by the FMA units.
// One call may take several matrices of the same input (q, k, v; gate, up).
// Each output y[r, n] is accumulated in the same order whatever R is, so scoring K+1
// tokens gives the same numbers as K+1 single steps.
//
// Vector code for AVX-512 and AVX2 is compiled per function (target attributes) and
// chosen at run time from the CPU's flags; other machines use the portable loop.
// Work is split by blocks of input rows and chunks of output rows between the calling
// thread and helper threads (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu.h"
#include "half.h"
#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "q4gemm.h"
#define SPECSAMP_X86 1
#endif
#include "amx.h"
#include "a8.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* x;        // [R, C]
  const uint8_t* codes;  // q4: [N, C/2]; q8: int8 [N, C]
  const void* scale;     // [N, nb], float16 or float32
  const uint16_t* min;   // q4 only: float16 [N, nb]
  float* y;              // [R, N]
  int64_t rows, cols, n, block;
  bool scale_f32;
  bool tiles;            // codes, scale, min in the tile layout (amx.h), for the AMX path
  bool pairs = false;    // tiles: x's rows went to the tile unit as pairs, not limbs (amx.h)
  const specsamp::a8::Rows* a8 = nullptr;  // tiles: x's rows as bytes, 8-bit activations (a8.h)
#ifdef SPECSAMP_AMX
  const specsamp::amx::Limbs* limbs = nullptr;  // tiles: x's rows as limbs (amx.h)
#endif
  float scale_at(int64_t i) const;
};

const float* half_table() {  // all 65536 float16 values, for the portable loops
  static const float* table = [] {
    float* t = new float[65536];
    for (uint32_t h = 0; h < 65536; ++h) t[h] = specsamp::half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table;
}

float Problem::scale_at(int64_t i) const {
  return scale_f32 ? static_cast<const float*>(scale)[i]
                   : half_table()[static_cast<const uint16_t*>(scale)[i]];
}

constexpr int kMaxRows = 12;  // rows per pass over a chunk of weights at most

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

constexpr int64_t kMaxBlocks = 512;  // blocks per matrix row the vector paths take (C <= 16384)

// One row's float16 scales (or minimums) as float32, 16 at a time.
__attribute__((target("avx512f,f16c,fma")))
inline void halves_to_floats(const uint16_t* h, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm512_store_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  for (; i < count; ++i) out[i] = _cvtsh_ss(h[i]);
}

// Software prefetch of the weights `kPrefetchRows` output rows ahead of the one being
// summed (codes, scales, minimums), into L1. A pass over few rows is bound by how fast the
// weights arrive, and the hardware prefetchers alone leave each core well below the
// machine's streaming bandwidth. 16 rows ahead: nearer gains less of that, farther gains
// less too (the last rows prefetch the matrix's last rows again); docs/measurements.md,
// native kernels.
constexpr int64_t kPrefetchRows = 16;

inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* c = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
  _mm_prefetch(c + bytes - 1, _MM_HINT_T0);
}

// ---- AVX-512: 16 lanes. NR rows at once with two accumulators each (a q4 block is two
// vectors: inputs 0..15 from the low nibbles, 16..31 from the high), for NO output rows at
// once (NO = 2 when a pass has 4 or more rows: each input vector loaded feeds both outputs;
// 2 x 6 rows of accumulators fill the registers), all in registers.
// The block's 16 possible weights code * scale + min, one FMA, then two lookups
// (vpermps reads the low 4 bits of each index: the low nibble as is, the high one after a
// shift), instead of converting 32 codes to float: fewer floating-point operations per
// block, which is what bounds the kernel once several rows share the decoded weights.
// The values are exactly the per-weight fmadd(code, scale, min) of the other paths, and
// each output's sums run in the same order whatever NO and NR are.
template <int NO, int NR>
__attribute__((target("avx512f,f16c,fma")))
void q4_avx512_tile(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / 32;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float d[NO][kMaxBlocks + 16], m[NO][kMaxBlocks + 16];
  for (int64_t n = n0; n < n1; n += NO) {  // n1 - n0 a multiple of NO
    const int64_t ahead = std::max(n, std::min(n + kPrefetchRows, p.n - NO));
    prefetch_bytes(p.codes + ahead * (p.cols / 2), NO * (p.cols / 2));
    prefetch_bytes(static_cast<const uint16_t*>(p.scale) + ahead * nb, NO * nb * 2);
    prefetch_bytes(p.min + ahead * nb, NO * nb * 2);
    __m512 a0[NO][NR], a1[NO][NR];
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < NR; ++r) a0[o][r] = a1[o][r] = _mm512_setzero_ps();
    for (int o = 0; o < NO; ++o) {
      halves_to_floats(static_cast<const uint16_t*>(p.scale) + (n + o) * nb, nb, d[o]);
      halves_to_floats(p.min + (n + o) * nb, nb, m[o]);
    }
    const float* xr = p.x + r0 * p.cols;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w0[NO], w1[NO];
      for (int o = 0; o < NO; ++o) {
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[o][b]), _mm512_set1_ps(m[o][b]));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.codes + (n + o) * (p.cols / 2) + b * 16)));
        w0[o] = _mm512_permutexvar_ps(q, table);
        w1[o] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
      }
      const float* xb = xr + b * 32;
      for (int r = 0; r < NR; ++r) {
        const __m512 x0 = _mm512_loadu_ps(xb + r * p.cols), x1 = _mm512_loadu_ps(xb + r * p.cols + 16);
        for (int o = 0; o < NO; ++o) {
          a0[o][r] = _mm512_fmadd_ps(w0[o], x0, a0[o][r]);
          a1[o][r] = _mm512_fmadd_ps(w1[o], x1, a1[o][r]);
        }
      }
    }
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < NR; ++r)
        p.y[(r0 + r) * p.n + n + o] = specsamp::reduce16(_mm512_add_ps(a0[o][r], a1[o][r]));
  }
}

// Output rows n0..n1 in pairs where the pass has rows enough for each loaded input vector
// feeding two outputs to pay (4 or more: docs/measurements.md, native kernels), an odd last
// one alone.
template <int NR>
void q4_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t paired = NR >= 4 ? n0 + (n1 - n0) / 2 * 2 : n0;
  if (paired > n0) q4_avx512_tile<2, NR>(p, n0, paired, r0);
  if (paired < n1) q4_avx512_tile<1, NR>(p, paired, n1, r0);
}

// q8 takes one output row per pass: pairs need more registers than its decode leaves, and
// spilling them loses more than the shared input loads gain (docs/measurements.md, native
// kernels).
template <int NR>
__attribute__((target("avx512f,f16c,fma")))
void q8_avx512(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  const int64_t nb = p.cols / p.block;
  alignas(64) float ds[kMaxBlocks + 16];
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t ahead = std::min(n + kPrefetchRows, p.n - 1), scale_bytes = p.scale_f32 ? 4 : 2;
    prefetch_bytes(p.codes + ahead * p.cols, p.cols);
    prefetch_bytes(static_cast<const char*>(p.scale) + ahead * nb * scale_bytes, nb * scale_bytes);
    __m512 a0[NR], a1[NR];
    for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const float* drow = ds;
    if (p.scale_f32)
      drow = static_cast<const float*>(p.scale) + n * nb;
    else
      halves_to_floats(static_cast<const uint16_t*>(p.scale) + n * nb, nb, ds);
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 d = _mm512_set1_ps(drow[b]);
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
      p.y[(r0 + r) * p.n + n] = specsamp::reduce16(_mm512_add_ps(a0[r], a1[r]));
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

// Rows at once: with AVX-512 up to 6 for q4 (2 output rows x 6 rows x 2 accumulators + the
// blocks' weights fit in 32 registers) and 12 for q8 (one output row), 8 with AVX2 (16
// registers); `pick` says which.
#define SPECSAMP_DISPATCH(name, most)                                                  \
  void name##_rows(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t nr) { \
    switch (std::min<int64_t>(nr, most)) {                                             \
      case 1: return name<1>(p, n0, n1, r0);                                           \
      case 2: return name<2>(p, n0, n1, r0);                                           \
      case 3: return name<3>(p, n0, n1, r0);                                           \
      case 4: return name<4>(p, n0, n1, r0);                                           \
      case 5: return name<5>(p, n0, n1, r0);                                           \
      case 6: return name<6>(p, n0, n1, r0);                                           \
      case 7: return name<7>(p, n0, n1, r0);                                           \
      case 8: return name<8>(p, n0, n1, r0);                                           \
      case 9: return name<(most >= 9 ? 9 : most)>(p, n0, n1, r0);                          \
      case 10: return name<(most >= 10 ? 10 : most)>(p, n0, n1, r0);                        \
      case 11: return name<(most >= 11 ? 11 : most)>(p, n0, n1, r0);                        \
      case 12: return name<(most >= 12 ? 12 : most)>(p, n0, n1, r0);                        \
      case 13: return name<(most >= 13 ? 13 : most)>(p, n0, n1, r0);                        \
      case 14: return name<(most >= 14 ? 14 : most)>(p, n0, n1, r0);                        \
      case 15: return name<(most >= 15 ? 15 : most)>(p, n0, n1, r0);                        \
      default: return name<most>(p, n0, n1, r0);                                       \
    }                                                                                  \
  }
SPECSAMP_DISPATCH(q4_avx512, 6)
SPECSAMP_DISPATCH(q8_avx512, 12)
SPECSAMP_DISPATCH(q4_avx2, 8)
SPECSAMP_DISPATCH(q8_avx2, 8)

// 8-bit activations (a8.h), weights in the tile layout: 8 rows a pass.
template <int NR>
void a8_q4(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  specsamp::a8::product<NR, true>(p.codes, static_cast<const uint16_t*>(p.scale), p.min, p.cols,
                                  p.n, *p.a8, p.y, n0, n1, r0);
}
template <int NR>
void a8_q8(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  specsamp::a8::product<NR, false>(p.codes, static_cast<const uint16_t*>(p.scale), p.min, p.cols,
                                   p.n, *p.a8, p.y, n0, n1, r0);
}
SPECSAMP_DISPATCH(a8_q4, 8)
SPECSAMP_DISPATCH(a8_q8, 8)

#ifdef SPECSAMP_AMX
// Weights in the tile layout (amx.h): outputs n0..n1 are whole groups of 16, x's rows in
// two tiles a pass (10 rows as limbs, 16 as pairs), prepared once per call in p.limbs.
template <int NR, bool Q4, bool Pairs>
void amx_tile(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  specsamp::amx::product<NR, Q4, Pairs>(p.codes, static_cast<const uint16_t*>(p.scale), p.min,
                                        p.cols, p.n, *p.limbs, r0, p.y, n0 / 16, n1 / 16);
}
template <int NR>
void amx_q4(const Problem& p, int64_t n0, int64_t n1, int64_t r0) { amx_tile<NR, true, false>(p, n0, n1, r0); }
template <int NR>
void amx_q4_pairs(const Problem& p, int64_t n0, int64_t n1, int64_t r0) { amx_tile<NR, true, true>(p, n0, n1, r0); }
template <int NR>
void amx_q8(const Problem& p, int64_t n0, int64_t n1, int64_t r0) { amx_tile<NR, false, false>(p, n0, n1, r0); }
SPECSAMP_DISPATCH(amx_q4, 10)
SPECSAMP_DISPATCH(amx_q4_pairs, 16)
SPECSAMP_DISPATCH(amx_q8, 10)
#endif

// Rows r0..r1 of outputs n0..n1 (at most 64, a multiple of 16) on the many-row path
// (q4gemm.h): each 32 outputs decoded once, then passes of 6 rows.
template <int NV>
void q4_gemm_part(const Problem& p, const float* wt, int64_t n0, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += 6) {
    const float* x = p.x + r * p.cols;
    float* y = p.y + r * p.n + n0;
    switch (std::min<int64_t>(6, r1 - r)) {
      case 1: specsamp::q4_gemm_rows<NV, 1>(x, p.cols, wt, y, p.n); break;
      case 2: specsamp::q4_gemm_rows<NV, 2>(x, p.cols, wt, y, p.n); break;
      case 3: specsamp::q4_gemm_rows<NV, 3>(x, p.cols, wt, y, p.n); break;
      case 4: specsamp::q4_gemm_rows<NV, 4>(x, p.cols, wt, y, p.n); break;
      case 5: specsamp::q4_gemm_rows<NV, 5>(x, p.cols, wt, y, p.n); break;
      default: specsamp::q4_gemm_rows<NV, 6>(x, p.cols, wt, y, p.n); break;
    }
  }
}

void q4_gemm(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t r1) {
  struct alignas(64) Lanes { float v[16]; };  // (std::vector drops __m512's alignment)
  thread_local std::vector<Lanes> wt;           // 32 outputs decoded, [32 * nb * 2]
  wt.resize(p.cols * 2);
  float* w = wt.data()->v;
  for (int64_t n = n0; n < n1; n += 32) {
    const int nv = n1 - n >= 32 ? 2 : 1;
    specsamp::q4_decode_transposed(p.codes, static_cast<const uint16_t*>(p.scale), p.min, p.cols,
                                   n, nv, w);
    if (nv == 2) q4_gemm_part<2>(p, w, n, r0, r1);
    else q4_gemm_part<1>(p, w, n, r0, r1);
  }
}
#endif

using Kernel = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

void a8_portable(const Problem& p, int64_t n0, int64_t n1, int64_t r0, int64_t nr) {
  specsamp::a8::product_portable(p.min != nullptr, p.codes, static_cast<const uint16_t*>(p.scale),
                                 p.min, p.cols, p.n, *p.a8, p.y, n0, n1, r0, nr);
}

using Gemm = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

struct Choice {
  Kernel kernel;
  int64_t rows;           // rows per pass the kernel takes
  Gemm gemm = nullptr;    // the many-row path for this matrix, where it takes it
  int64_t row_block = 60;  // rows of an item: whole passes that start where x's tiles do
};

Choice pick(bool q4, bool tiles, bool pairs, bool a8, int64_t block, int64_t cols, int64_t n,
            int64_t rows) {
  if (a8) {  // 8-bit activations: VNNI where the CPU has it, else the portable loop
#ifdef SPECSAMP_X86
    if (specsamp::vnni()) return {q4 ? a8_q4_rows : a8_q8_rows, 8, nullptr, 64};
#endif
    return {a8_portable, kMaxRows, nullptr, 64};
  }
#ifdef SPECSAMP_AMX
  using specsamp::amx::Scheme;
  if (tiles && pairs)
    return {amx_q4_pairs_rows, Scheme<true>::kMaxRows, nullptr, 4 * Scheme<true>::kMaxRows};
  if (tiles) return {q4 ? amx_q4_rows : amx_q8_rows, Scheme<false>::kMaxRows};
#else
  (void)tiles, (void)pairs;  // `problem` refuses the tile layout in a build without the tile path
#endif
  // A pass's rows of x should stay in L1 (~40 KB) while the pass sweeps its weight rows:
  // `fit` rows of `cols` inputs. AVX-512 q4 passes take 6 rows for 2 output rows at once
  // rather than 12 rows for one (docs/measurements.md, native kernels).
  const int64_t fit = std::max<int64_t>(1, 10240 / cols);
#ifdef SPECSAMP_X86
  const int level = specsamp::isa();
  // The many-row path (q4gemm.h) from 24 rows, for up to 1,024 inputs, where decoding each
  // block once for all rows gains over the row passes; with more inputs its rows' inputs no
  // longer stay in L1. Q4 only: Q8_0's decoding gathers twice the bytes
  // (docs/measurements.md, native kernels).
  const bool gemm = q4 && n % 16 == 0 && cols <= 1024 && rows >= 24;
  if (level == 2 && (q4 || block % 16 == 0) && cols / block <= kMaxBlocks)
    return {q4 ? q4_avx512_rows : q8_avx512_rows, std::min<int64_t>(q4 ? 6 : 12, fit),
            gemm ? q4_gemm : nullptr};
  if (level >= 1 && (q4 || block % 8 == 0))
    return {q4 ? q4_avx2_rows : q8_avx2_rows, std::min<int64_t>(8, fit)};
#endif
  return {q4 ? q4_portable : q8_portable, kMaxRows};
}

// Work items: (block of input rows, chunk of output rows) of all of a call's matrices,
// input-row-block major, split between the caller and the helpers (parallel.h). With many
// input rows (prefill: thousands) an item's block of x stays in the core's cache while it
// sweeps the weights; the other order re-read all of x from memory for every weight chunk.
#ifdef SPECSAMP_AMX
// x's rows for the tile unit (amx.h: as limbs, or as pairs), once per call, the tiles
// split between the threads. The buffers are the calling thread's, reused by its next calls.
template <bool Pairs>
specsamp::amx::Limbs prepare_limbs(const Problem& first, ffi::ThreadPool& pool) {
  using S = specsamp::amx::Scheme<Pairs>;
  const int64_t rows = first.rows, cols = first.cols, nb = cols / 32;
  const int64_t passes = (rows + S::kRows - 1) / S::kRows;
  thread_local std::vector<int8_t> limbs;
  thread_local std::vector<float> sums, scale;
  // (not zeroed: a tile loads only the limb rows of rows that exist, all written below)
  limbs.resize(passes * nb * 16 * S::kWidth);
  sums.resize(rows * nb);
  scale.resize(rows);
  // (pointers, not the names: a helper thread's `limbs` would be its own thread_local)
  int8_t* const l = limbs.data();
  float *const s = sums.data(), *const sc = scale.data();
  specsamp::parallel_for(pool, passes, [&](int64_t pass) {
    const int64_t end = std::min(rows, (pass + 1) * S::kRows);
    for (int64_t r = pass * S::kRows; r < end; ++r)
      specsamp::amx::prepare_row<Pairs>(first.x + r * cols, cols, l, r, s, sc);
  });
  return {l, s, sc};
}
#endif

void run(const std::vector<Problem>& problems, ffi::ThreadPool& pool) {
  // Output rows per item: 128 for calls of a few rows (decode steps at small batch), where
  // an item is a stream of weights and a longer one keeps each core's prefetching going
  // (docs/measurements.md, native kernels), 64 otherwise.
  const int64_t chunk = problems.front().rows < 8 ? 128 : 64;
  std::vector<std::pair<int64_t, Choice>> firsts;  // (first chunk, kernel) per matrix
  int64_t chunks = 0;
  for (const Problem& p : problems) {
    firsts.emplace_back(chunks, pick(p.min != nullptr, p.tiles, p.pairs, p.a8 != nullptr, p.block,
                                     p.cols, p.n, p.rows));
    chunks += (p.n + chunk - 1) / chunk;
  }
  // whole passes of 12, 10, 6, 5, 4, 3, 2 or 1 rows (tiles: passes of 10 that start at
  // multiples of 5, or of 16 at multiples of 8, as x's tiles do). A call's matrices share
  // it: tile calls are all q4 or all q8, with the same rows.
  const int64_t row_block = firsts.front().second.row_block;
  const int64_t rows = problems.front().rows, blocks = (rows + row_block - 1) / row_block;
  specsamp::parallel_for(pool, blocks * chunks, [&](int64_t item) {
    const int64_t c = item % chunks, rb = item / chunks;
    size_t m = firsts.size() - 1;
    while (firsts[m].first > c) --m;
    const Problem& p = problems[m];
    const Kernel kernel = firsts[m].second.kernel;
    const int64_t pass = firsts[m].second.rows;
    const int64_t n0 = (c - firsts[m].first) * chunk, n1 = std::min(p.n, n0 + chunk);
    const int64_t r_end = std::min(rows, (rb + 1) * row_block);
    if (firsts[m].second.gemm) return firsts[m].second.gemm(p, n0, n1, rb * row_block, r_end);
    for (int64_t r0 = rb * row_block; r0 < r_end; r0 += pass)
      kernel(p, n0, n1, r0, std::min<int64_t>(pass, r_end - r0));
  });
}

// Byte offset of layer `layer` in a stack [L, ...] of `bytes` bytes per layer, or -1.
int64_t layer_offset(ffi::Buffer<ffi::S32> layer, int64_t stack, int64_t bytes) {
  const int64_t i = *layer.typed_data();
  return (i < 0 || i >= stack) ? -1 : i * bytes;
}

// One matrix of a call: its operands from `args` at `at` (q4: codes, scale, min; q8:
// codes, scale), its output `ret`.
ffi::Error problem(int bits, bool tiles, bool a8, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                   const ffi::RemainingArgs& args, size_t at, ffi::Result<ffi::AnyBuffer> ret,
                   Problem* p) {
  auto codes_or = args.get<ffi::AnyBuffer>(at), scale_or = args.get<ffi::AnyBuffer>(at + 1),
       min_or = args.get<ffi::AnyBuffer>(bits == 4 ? at + 2 : at + 1);
  for (auto* v : {&codes_or, &scale_or, &min_or})
    if (v->has_error()) return v->error();
  const ffi::AnyBuffer codes = codes_or.value(), scale = scale_or.value(), min = min_or.value();
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  const bool f32 = scale.element_type() == ffi::DataType::F32;
  if (bits == 4) {
    const auto md = min.dimensions();
    if (codes.element_type() != ffi::DataType::U8 || scale.element_type() != ffi::DataType::F16 ||
        min.element_type() != ffi::DataType::F16 || xd.size() != 2 || cd.size() != 3 ||
        sd.size() != 3 || md.size() != 3 || xd[1] != 2 * cd[2] || xd[1] % 32 ||
        sd[2] * 32 != xd[1] || sd[1] != cd[1] || sd[0] != cd[0] || md[0] != sd[0] ||
        md[1] != sd[1] || md[2] != sd[2])
      return ffi::Error::InvalidArgument(
          "q4 matmul: expected x [R, C], codes uint8 [L, N, C/2], scale and min float16 "
          "[L, N, C/32]");
  } else if (codes.element_type() != ffi::DataType::S8 ||
             (!f32 && scale.element_type() != ffi::DataType::F16) || xd.size() != 2 ||
             cd.size() != 3 || sd.size() != 3 || xd[1] != cd[2] || xd[1] % sd[2] ||
             sd[1] != cd[1] || sd[0] != cd[0]) {
    return ffi::Error::InvalidArgument(
        "q8 matmul: expected x [R, C], codes int8 [L, N, C], scale float16/32 [L, N, nb]");
  }
  const auto yd = ret->dimensions();
  if (ret->element_type() != ffi::DataType::F32 || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != cd[1])
    return ffi::Error::InvalidArgument("quantized matmul: expected y float32 [R, N]");
  if (tiles && !((a8 || specsamp::amx_enabled()) && cd[1] % 16 == 0 && xd[1] / sd[2] == 32 && !f32))
    return ffi::Error::InvalidArgument(
        "quantized matmul: the tile layout needs AMX or 8-bit activations, 16 outputs a group, "
        "blocks of 32 and float16 scales");
  if (a8 && !tiles)
    return ffi::Error::InvalidArgument("quantized matmul: 8-bit activations need the tile layout");
  const int64_t n = cd[1], nb = sd[2], i = layer_offset(layer, cd[0], 1);
  if (i < 0) return ffi::Error::InvalidArgument("quantized matmul: layer index out of range");
  *p = Problem{x.typed_data(),
               static_cast<const uint8_t*>(codes.untyped_data()) + i * n * cd[2],
               static_cast<const char*>(scale.untyped_data()) + i * n * nb * (f32 ? 4 : 2),
               bits == 4 ? static_cast<const uint16_t*>(min.untyped_data()) + i * n * nb : nullptr,
               static_cast<float*>(ret->untyped_data()), xd[0], xd[1], n, xd[1] / nb, f32, tiles};
  return ffi::Error::Success();
}

// x's rows as bytes for 8-bit activations (a8.h), the rows split between the threads. The
// buffers are the calling thread's, reused by its next calls.
specsamp::a8::Rows prepare_bytes(const Problem& first, ffi::ThreadPool& pool) {
  const int64_t rows = first.rows, cols = first.cols, nb = cols / 32;
  thread_local std::vector<int8_t> x;
  thread_local std::vector<uint8_t> u;
  thread_local std::vector<float> dx, sums;
  x.resize(rows * cols), u.resize(rows * cols), dx.resize(rows * nb), sums.resize(rows * nb);
  // (pointers, not the names: a helper thread's vectors would be its own thread_local)
  int8_t* const xs = x.data();
  uint8_t* const us = u.data();
  float *const d = dx.data(), *const s = sums.data();
  const bool vector = specsamp::isa() == 2;
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    specsamp::a8::prepare_row(vector, first.x + r * cols, cols, xs + r * cols, us + r * cols,
                              d + r * nb, s + r * nb);
  });
  return {xs, us, d, s};
}

// y_m = x @ W_m.T for each matrix m of the call (all read at layer `layer` of their stacks):
// several products of one input (q, k, v; gate, up) in one call, one split of the work.
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t bits,
                      int32_t tiles, int32_t act8) {
  const size_t per = bits == 4 ? 3 : bits == 8 ? 2 : 0;
  if (per == 0 || args.size() != per * rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument(
        "quantized matmul: bits must be 4 or 8, with 3 (q4) or 2 (q8) operands per output");
  std::vector<Problem> problems(rets.size());
  for (size_t m = 0; m < rets.size(); ++m) {
    auto ret = rets.get<ffi::AnyBuffer>(m);
    if (ret.has_error()) return ret.error();
    if (auto e = problem(bits, tiles != 0, act8 != 0, layer, x, args, m * per, ret.value(), &problems[m]);
        e.failure())
      return e;
  }
  // 8-bit activations: x's rows as bytes, once for all of the call's matrices.
  specsamp::a8::Rows bytes{};
  if (act8) {
    bytes = prepare_bytes(problems.front(), pool);
    for (Problem& p : problems) p.a8 = &bytes;
  }
#ifdef SPECSAMP_AMX
  // Weights in the tile layout (all of a call's or none), float activations: x's rows as
  // limbs, once for all of the call's matrices.
  specsamp::amx::Limbs limbs{};
  if (tiles && !act8) {
    const Problem& first = problems.front();
    const bool pairs = specsamp::amx::pairs_for(bits == 4, first.rows);  // x prepared once, one way
    limbs = pairs ? prepare_limbs<true>(first, pool) : prepare_limbs<false>(first, pool);
    for (Problem& p : problems) p.limbs = &limbs, p.pairs = pairs;
  }
#endif
  run(problems, pool);
  return ffi::Error::Success();
}

// ---- argmax over a row of logits (greedy tokens): the first index of the largest value,
// V - 1 for a row holding a NaN; on rows without one, what
// `specsamp.models.argmax.first_argmax` computes in XLA with three passes (max, compare,
// min) where this is one.
int32_t argmax_portable(const float* x, int64_t v) {
  int64_t best = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(x[i])) return static_cast<int32_t>(v - 1);
    if (x[i] > x[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

#ifdef SPECSAMP_X86
__attribute__((target("avx512f")))
int32_t argmax_avx512(const float* x, int64_t v) {  // v >= 16
  __m512 best = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= v; i += 16) {  // per lane: the first index of its largest value
    const __m512 xv = _mm512_loadu_ps(x + i);
    idx = _mm512_add_epi32(idx, step);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 up = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, xv);
    at = _mm512_mask_mov_epi32(at, up, idx);
  }
  if (nan) return static_cast<int32_t>(v - 1);
  alignas(64) float values[16];
  alignas(64) int32_t where[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(where, at);
  int32_t found = where[0];
  float top = values[0];
  for (int l = 1; l < 16; ++l)
    if (values[l] > top || (values[l] == top && where[l] < found)) top = values[l], found = where[l];
  for (; i < v; ++i) {  // the tail, after every vector's index
    if (std::isnan(x[i])) return static_cast<int32_t>(v - 1);
    if (x[i] > top) top = x[i], found = static_cast<int32_t>(i);
  }
  return found;
}
#endif

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1 || out->dimensions().size() != 1 || out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("argmax: expected x float32 [R, V >= 1], out int32 [R]");
  const int64_t rows = d[0], v = d[1];
  const float* xs = x.typed_data();
  int32_t* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
#ifdef SPECSAMP_X86
    if (specsamp::isa() == 2 && v >= 16) {
      ys[r] = argmax_avx512(xs + r * v, v);
      return;
    }
#endif
    ys[r] = argmax_portable(xs + r * v, v);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampQMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("tiles")
                                  .Attr<int32_t>("act8"));

extern "C" int specsamp_isa() { return specsamp::isa(); }
extern "C" int specsamp_amx() { return specsamp::amx_enabled() ? 1 : 0; }
extern "C" int specsamp_vnni() { return specsamp::vnni() ? 1 : 0; }

bool specsamp::amx_available() {
#ifdef SPECSAMP_AMX
  return specsamp::amx::available();
#else
  return false;
#endif
}
