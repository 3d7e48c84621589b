// Quantized products on AMX (Intel's tile unit: 16 x 64-byte tiles, int8 products summed
// into int32), for weights in the tile layout (`specsamp.quant.blocks`, layout "tiles").
//
// Why: on the AVX-512 path every row of x costs two FMAs per 32 weights, so scoring K + 1
// tokens costs each further row a share of a step, and at one row the decoding of the codes
// (not the memory) bounds the step. A tile product takes 16 outputs x 32 inputs x up to 16
// rows in one instruction, so further rows cost almost nothing, and the codes go to the tile
// unit as bytes, with no conversion to float.
//
// The numbers: x's rows stay float32 in meaning. Each row r is written as s_r * X_r with
// s_r a power of two and X_r integers below 2^22 in magnitude (the only rounding:
// X = round(x / s_r), an absolute error of at most 2^-22 of the row's largest |x|, where
// float32 itself holds that input to within 2^-24 of it), and X as three signed bytes
// X = l0 + 2^8 l1 + 2^16 l2 (limbs; q4 calls of 8 rows or more write X as two pairs
// instead, the same numbers: `Scheme`). Not four limbs (X below 2^30, exact far below
// float32's rounding): they cost a third more tile traffic per row, and moving tiles bounds
// calls of many rows (figures: docs/measurements.md, native kernels).
// The tile unit sums code x limb over a block
// of 32 inputs exactly (int32); per block and output the limbs' sums are combined into
// the exact integer sum_i X_i q_i and rounded once to float (`accumulate`), the float
// accumulator takes scale * that, and s_r multiplies at the end:
//   y[r, n] = s_r * sum_b d[n, b] fl(sum_{i in b} X[r, i] q[n, i])  (+ sum_b m[n, b] S[r, b], Q4_1)
// where S[r, b] is the float sum of x's inputs in block b. Every row is computed alone
// (its own s_r, its own accumulators, the same order), so K + 1 rows give the numbers of
// K + 1 single steps, as on the other paths.
//
// Tile layout (a permutation of the GGUF bytes, the same size): for each group g of 16
// output rows and block b of 32 inputs, the bytes a tile row needs are contiguous.
//   q4: codes [N/16, nb, 4, 16, 4] bytes: [g, b, k, j, i] = GGUF byte 4 k + i of output
//       16 g + j's block b (low nibble: input 4 k + i, high: input 16 + 4 k + i), so the
//       low nibbles of the 256 bytes are the tile's first 4 rows and the high ones the last
//       4; scale and min [N/16, nb, 16] float16.
//   q8: codes [N/16, nb, 8, 16, 4] int8 (input 4 k + i of output 16 g + j): the tile itself;
//       scale [N/16, nb, 16] float16.
//
// The tile instructions are written as inline assembly with memory operands declared (the
// compiler's own AMX intrinsics do not tell it that a tile load reads memory); assembling
// them needs binutils 2.36 or later. Building with -DSPECSAMP_NO_AMX leaves the path out.

#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(SPECSAMP_NO_AMX)
#define SPECSAMP_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace specsamp::amx {

// Whether the CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use the tile
// data (asked once; Linux grants it per process).
inline bool available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

#define SPECSAMP_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)) : "memory")
#define SPECSAMP_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory")
#define SPECSAMP_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
// c += a (signed bytes) x b (unsigned / signed bytes)
#define SPECSAMP_TILE_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define SPECSAMP_TILE_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// How x's rows go to the tile unit. Three limbs: each row as 3 tile rows of 32 inputs
// (X = l0 + 2^8 l1 + 2^16 l2), 5 rows a tile, any weights. Pairs (q4 only): each row as 2
// tile rows of 64 bytes, [a (32 inputs), b (32 inputs)] with the codes tile holding the
// block's codes q and then 16 q (q <= 15: still a byte), so one product sums
// (a + 16 b) q over the block; X = P0 + 2^12 P1 with P = a + 16 b, 8 rows a tile. Both
// compute the same integer sum_i X_i q_i of a block exactly and round it once to float, so
// they give the same bits; pairs move a third fewer tile rows per row of x and take 16 rows
// a pass instead of 10, but unpack twice the codes per pass: so pairs from 8 rows on, where
// the tile traffic saved outweighs the unpacking (`pairs_for`; figures:
// docs/measurements.md, native kernels).
template <bool Pairs>
struct Scheme {
  static constexpr int kTileRows = Pairs ? 2 : 3;  // tile rows per row of x
  static constexpr int kRows = Pairs ? 8 : 5;      // rows of x per tile (of 16 tile rows)
  static constexpr int kMaxRows = 2 * kRows;       // rows of x per pass: two tiles
  static constexpr int kWidth = Pairs ? 64 : 32;   // bytes per tile row of x
  static constexpr int kCodeRows = Pairs ? 16 : 8;  // rows of the codes tile
};
constexpr int kPairsFrom = 8;  // q4 calls of this many rows or more take pairs

inline bool pairs_for(bool q4, int64_t rows) { return q4 && rows >= kPairsFrom; }

// Tiles 0, 1: sums [rows, 16 outputs] int32; 2, 3: x [rows, kWidth bytes]; 4: codes
// [kCodeRows rows of 4 inputs, 16 outputs x 4]. `m0`, `m1`: the tile rows of tiles 0 / 2
// and 1 / 3.
template <bool Pairs>
inline void configure(int m0, int m1) {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    const int m = t ? m1 : m0;
    cfg.rows[t] = m, cfg.colsb[t] = 64;
    cfg.rows[2 + t] = m, cfg.colsb[2 + t] = Scheme<Pairs>::kWidth;
  }
  cfg.rows[4] = Scheme<Pairs>::kCodeRows, cfg.colsb[4] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

inline void release() { __asm__ volatile("tilerelease" ::); }

constexpr int kPrefetchBlocks = 8;
constexpr int kAhead = 4;  // q4 blocks unpacked ahead of their tile load

// x [rows, cols] for the tiles: x [passes][nb][16][kWidth] (tile p holds rows
// kRows p .. kRows (p + 1) - 1, tile row kTileRows r' + l = limb or pair l of its row r';
// the rest unused), sums [rows][nb], scale [rows].
struct Limbs {
  const int8_t* limbs;
  const float* sums;
  const float* scale;
};

template <bool Pairs>
__attribute__((target("avx512f,avx512bw")))
inline void prepare_row(const float* x, int64_t cols, int8_t* limbs, int64_t r, float* sums,
                        float* scale) {
  using S = Scheme<Pairs>;
  const int64_t nb = cols / 32;
  __m512 mx = _mm512_setzero_ps(), finite = _mm512_setzero_ps();  // (x * 0: nan if x is not)
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    finite = _mm512_fmadd_ps(v, _mm512_setzero_ps(), finite);
  }
  alignas(64) float lanes[16], checks[16];
  _mm512_store_ps(lanes, mx);
  _mm512_store_ps(checks, finite);
  float top = 0, check = 0;
  for (int i = 0; i < 16; ++i) top = std::max(top, lanes[i]), check += checks[i];
  int e = 0;
  if (top > 0 && std::isfinite(top)) std::frexp(top, &e);  // top < 2^e
  const int k = 22 - e;                                      // |x| 2^k < 2^22
  // A row with an inf or nan gives nan outputs (as the float path would give inf or nan).
  scale[r] = std::isnan(check) ? check : std::ldexp(1.0f, -k);
  const __m512 shift = _mm512_set1_ps(static_cast<float>(k));
  int8_t* base = limbs + (r / S::kRows) * nb * 16 * S::kWidth + (r % S::kRows) * S::kTileRows * S::kWidth;
  const __m512i eight = _mm512_set1_epi32(8), least = _mm512_set1_epi32(-128),
                most = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s = _mm512_setzero_ps();
    int8_t* rows = base + b * 16 * S::kWidth;
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_loadu_ps(x + b * 32 + h * 16);
      s = _mm512_add_ps(s, v);
      __m512i big = _mm512_cvtps_epi32(_mm512_scalef_ps(v, shift));  // exact: x 2^k, rounded
      auto put = [&](int8_t* at, __m512i bytes) __attribute__((target("avx512f,avx512bw"))) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + h * 16), _mm512_cvtepi32_epi8(bytes));
      };
      if constexpr (Pairs) {
        // P0: X's low 12 bits, signed, in [-2048, 2047]; P1 = (X - P0) / 2^12 in
        // [-1024, 1024]. Each P = a + 16 b: b = (P + 8) >> 4 kept to a byte, a = P - 16 b
        // in [-8, 15].
        const __m512i p0 = _mm512_srai_epi32(_mm512_slli_epi32(big, 20), 20);
        const __m512i part[2] = {p0, _mm512_srai_epi32(_mm512_sub_epi32(big, p0), 12)};
        for (int l = 0; l < 2; ++l) {
          const __m512i hi = _mm512_min_epi32(
              _mm512_max_epi32(_mm512_srai_epi32(_mm512_add_epi32(part[l], eight), 4), least), most);
          put(rows + l * 64, _mm512_sub_epi32(part[l], _mm512_slli_epi32(hi, 4)));
          put(rows + l * 64 + 32, hi);
        }
      } else {
        for (int l = 0; l < S::kTileRows; ++l) {
          const __m512i limb = _mm512_srai_epi32(_mm512_slli_epi32(big, 24), 24);  // in [-128, 127]
          put(rows + l * 32, limb);
          big = _mm512_srai_epi32(_mm512_sub_epi32(big, limb), 8);
        }
      }
    }
    sums[r * nb + b] = _mm512_reduce_add_ps(s);
  }
}

// A tile's stored sums into the rows' accumulators, times the block's scales. Three limbs:
// per row lo = C0 + 2^8 C1, exact in int32 (and in float for q4: |C| <= 32 x 15 x 128, so
// |lo| < 2^24; q8's are rounded to float32, as its float sums would be), then
// 2^16 C2 + lo rounded once. Pairs: 2^12 C1 + C0 rounded once (|C| <= 32 x 15 x 2^11 <
// 2^20, exact in float). For q4 both are sum_i X_i q_i rounded once.
template <int Count, bool Pairs>
__attribute__((target("avx512f,fma")))
inline void accumulate(const int32_t (*sums)[16], __m512 d, __m512* acc) {
  for (int r = 0; r < Count; ++r) {
    __m512 block;
    if constexpr (Pairs) {
      block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[2 * r + 1])),
                              _mm512_set1_ps(4096.0f),
                              _mm512_cvtepi32_ps(_mm512_load_si512(sums[2 * r])));
    } else {
      const __m512i lo = _mm512_add_epi32(_mm512_load_si512(sums[3 * r]),
                                          _mm512_slli_epi32(_mm512_load_si512(sums[3 * r + 1]), 8));
      const __m512i hi = _mm512_load_si512(sums[3 * r + 2]);
      block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0f),
                              _mm512_cvtepi32_ps(lo));
    }
    acc[r] = _mm512_fmadd_ps(block, d, acc[r]);
  }
}

// Outputs of groups g0..g1 (16 each) for rows r0..r0+R-1 (R <= kMaxRows) of a q4 (bits 4)
// or q8 matrix in the tile layout, x prepared by prepare_row<Pairs>; y [*, n] float32.
//
// Software-pipelined: a tile load does not take bytes from stores still in flight, nor a
// vector load sums from a tile store; it waits until the store has left the core, and in
// one chain per block those waits added up. So q4 codes are unpacked (nibbles to bytes)
// kAhead blocks ahead of their tile load, and the sums of block b are scaled into the
// accumulators after block b + 1 went to the tile unit.
template <int R, bool Q4, bool Pairs>
__attribute__((target("avx512f,avx512bw,f16c,fma")))
void product(const uint8_t* codes, const uint16_t* scale, const uint16_t* minimum, int64_t cols,
             int64_t n, const Limbs& in, int64_t r0, float* y, int64_t g0, int64_t g1) {
  using S = Scheme<Pairs>;
  static_assert(R >= 1 && R <= S::kMaxRows && (Q4 || !Pairs));
  constexpr bool two = R > S::kRows;  // the pass's further rows in a second tile of x and sums
  constexpr int R0 = two ? S::kRows : R, R1 = two ? R - S::kRows : 0;
  const int64_t nb = cols / 32;
  constexpr int64_t kGroupBytes = Q4 ? 256 : 512, kTileBytes = 16 * S::kWidth;
  // q4: blocks unpacked kAhead blocks (in group order) before their tile load, in a ring
  alignas(64) uint8_t unpacked[2 * kAhead][64 * S::kCodeRows];
  alignas(64) int32_t sums[2][2][16][16];  // [block parity][tile]
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const int8_t* a = in.limbs + (r0 / S::kRows) * nb * kTileBytes;  // this pass's first tile
  const int64_t steps = (g1 - g0) * nb;  // (group, block) in order; codes are contiguous
  const uint8_t* first = codes + g0 * nb * kGroupBytes;
  auto unpack = [&](int64_t t) __attribute__((target("avx512f,avx512bw"))) {
    const uint8_t* src = first + t * kGroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBlocks * kGroupBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBlocks * kGroupBytes + 128), _MM_HINT_T0);
    uint8_t* out = unpacked[t % (2 * kAhead)];
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(src + 64 * i);
      _mm512_store_si512(out + 64 * i, _mm512_and_si512(v, low));
      _mm512_store_si512(out + 256 + 64 * i, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      if constexpr (Pairs) {  // 16 q: the low nibbles moved up, the high ones in place
        _mm512_store_si512(out + 512 + 64 * i, _mm512_and_si512(_mm512_slli_epi16(v, 4), high));
        _mm512_store_si512(out + 768 + 64 * i, _mm512_and_si512(v, high));
      }
    }
  };
  if constexpr (Q4)
    for (int64_t t = 0; t < std::min<int64_t>(kAhead, steps); ++t) unpack(t);
  configure<Pairs>(S::kTileRows * R0, S::kTileRows * (two ? R1 : R0));
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R], accm[R];
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
    auto scale_in = [&](int64_t b) __attribute__((target("avx512f,f16c,fma"))) {
      // block b's stored sums, times its scales
      const int64_t at = g * nb + b;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at * 16)));
      accumulate<R0, Pairs>(sums[b & 1][0], d, acc);
      if constexpr (two) accumulate<R1, Pairs>(sums[b & 1][1], d, acc + S::kRows);
      if constexpr (Q4) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + at * 16)));
        for (int r = 0; r < R; ++r)
          accm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(in.sums[(r0 + r) * nb + b]), accm[r]);
      }
    };
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t t = (g - g0) * nb + b;
      if constexpr (Q4) {
        SPECSAMP_TILE_LOAD(4, unpacked[t % (2 * kAhead)], 64);
      } else {
        const uint8_t* src = codes + (g * nb + b) * kGroupBytes;
        for (int64_t off = 0; off < kGroupBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBlocks * kGroupBytes + off), _MM_HINT_T0);
        SPECSAMP_TILE_LOAD(4, src, 64);
      }
      SPECSAMP_TILE_LOAD(2, a + b * kTileBytes, S::kWidth);
      SPECSAMP_TILE_ZERO(0);
      if constexpr (Q4) SPECSAMP_TILE_DPBSUD(0, 2, 4);
      else SPECSAMP_TILE_DPBSSD(0, 2, 4);
      SPECSAMP_TILE_STORE(0, sums[b & 1][0], 64);
      if constexpr (two) {
        SPECSAMP_TILE_LOAD(3, a + (nb + b) * kTileBytes, S::kWidth);
        SPECSAMP_TILE_ZERO(1);
        if constexpr (Q4) SPECSAMP_TILE_DPBSUD(1, 3, 4);
        else SPECSAMP_TILE_DPBSSD(1, 3, 4);
        SPECSAMP_TILE_STORE(1, sums[b & 1][1], 64);
      }
      if constexpr (Q4)
        if (t + kAhead < steps) unpack(t + kAhead);
      if (b > 0) scale_in(b - 1);
    }
    scale_in(nb - 1);
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(y + (r0 + r) * n + g * 16,
                       _mm512_fmadd_ps(acc[r], _mm512_set1_ps(in.scale[r0 + r]), accm[r]));
  }
  release();
}

}  // namespace specsamp::amx
#endif
