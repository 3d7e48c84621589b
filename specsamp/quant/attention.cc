// Decode-time attention over the KV cache for XLA's CPU backend, called through the FFI.
//
// One call per layer: write this call's keys/values into the cache (in place: the cache
// operands are aliased to the outputs) and attend, for every query row, over the slots
// 0..position of its row only. The cache is [L, B, J, S, E] and is read at layer `layer`
// where it lies: no copy of the cache per step, and no work on the slots beyond a row's
// position (a fixed-size cache is mostly empty while a row is short). A sliding window W
// (a per-layer operand, 0 for none) starts the read at slot position - W + 1 instead of 0;
// a soft cap c (Gemma 2) maps each scaled score s to c * tanh(s / c) before the softmax.
//
// Every (row, token, head) is computed on its own, in the same order whatever the number of
// tokens T in the call, so scoring K+1 tokens gives the same numbers as K+1 single steps.
// The exponential is a polynomial (no libm call), so loops vectorize; functions are
// compiled for AVX-512, AVX2 and plain x86-64 and chosen at load time (target_clones).
// With AVX-512 the query-key scores of 16 slots are reduced side by side (`scores_avx512`):
// the serial horizontal sum per slot was two thirds of the kernel's time. Query heads that
// share a KV head go through its keys and values together (`attend_heads`).
//
// The cache holds float32 or float16 (IEEE half, stored as uint16_t bits). At large batches
// the kernel is bound by reading the cache (further query heads on the same keys cost
// little), so float16 keys and values save time there as well as half the memory. New keys
// and values are rounded to half to nearest even (as XLA's conversion) and read back as
// exact floats: all arithmetic stays float32, in the same order for both.
//
// A token tree's scoring block (SpecsampAttendTree, an int32 table paths [B, T, P]) writes
// token t at slot start + t (start: the row's first position) while it sits at position
// start + its depth; a query at position p reads the slots before start from the cache and,
// in the place of slots start..p, the block slots start + paths[t][0..p - start] (its path
// by depth), gathered into scratch. Every slot goes through the same arithmetic in the same
// order as a chain's token at p reading its path at slots start..p, so the two agree bit
// for bit. Without the table the kernel runs as before (the second segment is empty).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu.h"
#include "half.h"
#include "parallel.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECSAMP_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define SPECSAMP_CLONES
#endif

constexpr int kLanes = 16;  // partial sums per dot product, added in a fixed order

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2];
// degree-6 Taylor polynomial (relative error ~1e-7), 0 below -87.
inline float exp_nonpositive(float x) {
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return specsamp::half_to_float(v); }

struct Shape {
  int64_t batch, tokens, heads, kv_heads, slots, dim, layer;
  float scale;
  int64_t window;  // sliding window (0: none)
  float softcap;   // 0: none
  const int32_t* paths = nullptr;  // a tree block's [B, T, P] table, or none
  int64_t path_len = 0;            // P
};

// The sum of kLanes partial sums as a tree: lane l with l + 8, then + 4, + 2, + 1.
inline float tree_sum(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Query heads attended together over their KV head's slots (see attend_heads).
constexpr int kMaxGroup = 4;

template <typename KV>  // the cache's element: float, or uint16_t (half)
struct Fast {  // vector versions of attend_heads' loops, where the CPU has them
  void (*scores)(const float* qs, const KV* k, int64_t n, float* out) = nullptr;
  // weighted[g - 1]: the weighted sums of g heads in one pass over the values
  using Weighted = void (*)(const float* w, int64_t w_stride, const KV* v, int64_t split,
                            const KV* v2, int64_t n, const float* inv, float* const* o);
  Weighted weighted[kMaxGroup] = {};
  int group = 1;  // heads per pass over the values (their sums fill the vector registers)
};

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int C, typename KV>  // one slot's 16 lane sums q . key over E = 16 * C, in order
__attribute__((target("avx512f"))) inline __m512 lane_sums(const __m512* qv, const KV* key) {
  __m512 acc = _mm512_mul_ps(qv[0], load16(key));
  for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], load16(key + 16 * c), acc);
  return acc;
}

// Scores of n <= 16 consecutive slots (keys k, [n, E]) for one query qs [E], E = 16 * C:
// per slot, 16 lane sums over E in order, then tree_sum's order. For 16 slots the trees run
// side by side (a transposing reduction of 16 vectors into one), so no slot pays a serial
// horizontal sum; a shorter block (the last) sums each slot alone, in the same order.
template <int C, typename KV>
__attribute__((target("avx512f")))
void scores_avx512(const float* qs, const KV* k, int64_t n, float* out) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qs + 16 * c);
  if (n < 16) {
    for (int64_t i = 0; i < n; ++i) {
      alignas(64) float lanes[kLanes];
      _mm512_store_ps(lanes, lane_sums<C>(qv, k + i * 16 * C));
      out[i] = tree_sum(lanes);
    }
    return;
  }
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = lane_sums<C>(qv, k + i * 16 * C);
  // lane l + lane l + 8 (128-bit chunks 0,1 + 2,3), two slots per vector
  __m512 w[8];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  // + lane l + 4 (chunk 0 + 1 of each slot), four slots per vector, a chunk each
  __m512 u[4];
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // + lane l + 2 within each chunk: chunk c holds slots 8i + c and 8i + 4 + c
  __m512 z[2];
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + lane l + 1: lane 4c + r holds slot 4r + c
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
}

// Adds slots i0 <= i < i1 (values v, slot i0's row first) into the sums a[g][i & 1]: each
// sum receives its slots in increasing order, whatever i0 (an odd i0 starts with one slot).
template <int G, int C, typename KV>
__attribute__((target("avx512f"), always_inline)) inline void weigh_slots(
    __m512 (&a)[G][2][C], const float* w, int64_t w_stride, const KV* v, int64_t i0, int64_t i1) {
  int64_t i = i0;
  if ((i & 1) && i < i1) {  // an odd slot
    for (int c = 0; c < C; ++c) {
      const __m512 vi = load16(v + 16 * c);
      for (int g = 0; g < G; ++g)
        a[g][1][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * w_stride + i]), vi, a[g][1][c]);
    }
    ++i;
  }
  for (; i + 2 <= i1; i += 2)
    for (int p = 0; p < 2; ++p)
      for (int c = 0; c < C; ++c) {
        const __m512 vi = load16(v + (i - i0 + p) * 16 * C + 16 * c);
        for (int g = 0; g < G; ++g)
          a[g][p][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * w_stride + i + p]), vi, a[g][p][c]);
      }
  if (i < i1)  // an even slot
    for (int c = 0; c < C; ++c) {
      const __m512 vi = load16(v + (i - i0) * 16 * C + 16 * c);
      for (int g = 0; g < G; ++g)
        a[g][0][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * w_stride + i]), vi, a[g][0][c]);
    }
}

// For each of G heads g: o[g] = (sum over slots i < n of w[g][i] * v_i) * inv[g], E = 16 * C,
// weights w[g] = w + g * w_stride, values v_i = v[i] for i < split and v2[i - split] after
// (a tree's path, gathered): even and odd slots in two sums (two dependency chains), added
// at the end. The heads share each load of the values; every head's sums are those it gets
// alone (G = 1), in the same order, and the same wherever the split.
template <int G, int C, typename KV>
__attribute__((target("avx512f")))
void weighted_avx512(const float* w, int64_t w_stride, const KV* v, int64_t split, const KV* v2,
                     int64_t n, const float* inv, float* const* o) {
  __m512 a[G][2][C];
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < 2; ++p)
      for (int c = 0; c < C; ++c) a[g][p][c] = _mm512_setzero_ps();
  weigh_slots<G, C>(a, w, w_stride, v, 0, split);
  if (split < n) weigh_slots<G, C>(a, w, w_stride, v2, split, n);
  for (int g = 0; g < G; ++g) {
    const __m512 scale = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(o[g] + 16 * c, _mm512_mul_ps(_mm512_add_ps(a[g][0][c], a[g][1][c]), scale));
  }
}

// Scores and weighted sums of width E = 16 * C; groups of heads as large as keep their
// 2 x C sums each within 24 of the 32 vector registers.
template <int C, typename KV>
Fast<KV> fast_for() {
  constexpr int kGroup = std::min(kMaxGroup, std::max(1, 12 / C));
  Fast<KV> f;
  f.scores = scores_avx512<C, KV>;
  f.weighted[0] = weighted_avx512<1, C, KV>;
  if constexpr (kGroup >= 2) f.weighted[1] = weighted_avx512<2, C, KV>;
  if constexpr (kGroup >= 3) f.weighted[2] = weighted_avx512<3, C, KV>;
  if constexpr (kGroup >= 4) f.weighted[3] = weighted_avx512<4, C, KV>;
  f.group = kGroup;
  return f;
}

// The AVX-512 scores and weighted sums for head width E (a multiple of 16 up to 128), or
// nulls: the portable loops, same order (also where SPECSAMP_ISA caps the kernels below
// AVX-512).
template <typename KV>
Fast<KV> pick_fast(int64_t E) {
  if (specsamp::isa() < 2 || E % 16) return {};
  switch (E / 16) {
    case 1: return fast_for<1, KV>();
    case 2: return fast_for<2, KV>();
    case 3: return fast_for<3, KV>();
    case 4: return fast_for<4, KV>();
    case 5: return fast_for<5, KV>();
    case 6: return fast_for<6, KV>();
    case 7: return fast_for<7, KV>();
    case 8: return fast_for<8, KV>();
    default: return {};
  }
}
#else
template <typename KV>
Fast<KV> pick_fast(int64_t) { return {}; }
#endif

// Softmax in place over scores[0..last] (the largest score subtracted; NaNs skipped in
// the maximum, as std::max skips its second argument's); returns 1 / the sum. Always
// inlined, so that each of attend_heads' clones compiles it for its own instruction set.
__attribute__((always_inline)) inline float softmax_in_place(float* scores, int64_t last) {
  // The largest score: per lane, then over the lanes; a maximum is the same whatever the
  // order.
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -3.4e38f;
  int64_t at = 0;
  for (; at + kLanes <= last + 1; at += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], scores[at + l]);
  for (; at <= last; ++at) lanes[0] = std::max(lanes[0], scores[at]);
  float m = lanes[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, lanes[l]);
  float part[kLanes] = {0};
  int64_t slot = 0;
  for (; slot + kLanes <= last + 1; slot += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      scores[slot + l] = exp_nonpositive(scores[slot + l] - m);
      part[l] += scores[slot + l];
    }
  for (; slot <= last; ++slot) {
    scores[slot] = exp_nonpositive(scores[slot] - m);
    part[0] += scores[slot];
  }
  return 1.f / tree_sum(part);
}

// Queries of one row b, query heads h0..h0+G-1 (G <= kMaxGroup) sharing one KV head:
// tokens t0..t1-1. kc, vc: the KV head's [S, E] blocks; scores is scratch [G, S + 16]; kb, vb
// scratch [P, E] for a tree's paths (s.paths; unused without). The heads
// go through the keys together, block of 16 slots by block (a block is read from memory
// for the first head and from the core's nearest cache for the others), and through the
// values in one pass (with `fast`, G <= fast.group; the portable loops go head by head).
// Each head's numbers are those it gets alone (G = 1), in the same order.
template <typename KV>
SPECSAMP_CLONES
void attend_heads(const Shape& s, int64_t b, int64_t h0, int64_t G, int64_t t0, int64_t t1,
                  const float* q, const int32_t* pos, const KV* kc, const KV* vc, float* out,
                  float* scores, KV* kb, KV* vb, const Fast<KV>& fast) {
  const int64_t E = s.dim, stride = s.slots + 16;
  const int64_t start = s.paths ? std::max<int32_t>(pos[b * s.tokens], 0) : 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t p = std::max<int32_t>(pos[b * s.tokens + t], 0);
    int64_t last = std::min<int64_t>(p, s.slots - 1);
    if (s.paths) last = std::min(last, start + s.path_len - 1);  // a path holds P slots
    // The first visible slot: keys at positions p - window < slot <= p.
    const int64_t first = s.window > 0 ? std::min(std::max<int64_t>(p - s.window + 1, 0), last) : 0;
    // Slots first..split-1 come from the cache, split..last (a tree's) from the path: slot
    // start + d reads block slot start + paths[t][d], gathered into row d of kb, vb.
    int64_t split = last + 1;
    if (s.paths) {
      split = std::min(std::max(first, start), last + 1);
      const int32_t* path = s.paths + (b * s.tokens + t) * s.path_len;
      for (int64_t slot = split; slot <= last; ++slot) {
        const int64_t d = slot - start, at = path[d];
        const int64_t from = std::min(start + (at >= 0 && at < s.tokens ? at : d), s.slots - 1);
        std::memcpy(kb + d * E, kc + from * E, E * sizeof(KV));
        std::memcpy(vb + d * E, vc + from * E, E * sizeof(KV));
      }
    }
    const float* qv = q + ((b * s.tokens + t) * s.heads + h0) * E;  // G heads' queries
    // The next token's queries (one row of a strided [B, T, H, E]: too far apart for the
    // hardware to fetch ahead; waiting for it was a quarter of a prefill's attention).
    if (t + 1 < t1)
      for (int64_t e = 0; e < G * E; e += 16) __builtin_prefetch(qv + s.heads * E + e);
    alignas(64) float qs[kMaxGroup][256];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t e = 0; e < E; ++e) qs[g][e] = qv[g * E + e] * s.scale;
    if (fast.scores) {
      // Slots past `last` are read but not used: a block of 16 computes each slot's score
      // on its own, so a last, partial block runs as a whole one where the cache has the
      // room (the scratch has 16 spare entries).
      for (int64_t slot = first; slot < split; slot += 16) {
        const int64_t n = slot + 16 <= s.slots ? 16 : split - slot;
        // This block's values, for the weighted sums after the softmax: fetched while the
        // scores compute, rather than on demand after them (docs/measurements.md, native
        // kernels).
        for (int64_t e = 0; e < std::min<int64_t>(16, split - slot) * E; e += 64 / sizeof(KV))
          __builtin_prefetch(vc + slot * E + e);
        for (int64_t g = 0; g < G; ++g) fast.scores(qs[g], kc + slot * E, n, scores + g * stride + slot);
      }
      // The path's slots (after the cache's, whose last block may have written past split).
      for (int64_t slot = split; slot <= last; slot += 16) {
        const int64_t n = std::min<int64_t>(16, last + 1 - slot);
        for (int64_t g = 0; g < G; ++g)
          fast.scores(qs[g], kb + (slot - start) * E, n, scores + g * stride + slot);
      }
    } else {
      for (int64_t slot = first; slot <= last; ++slot) {
        const KV* kv = slot < split ? kc + slot * E : kb + (slot - start) * E;
        for (int64_t g = 0; g < G; ++g) {
          float acc[kLanes] = {0};
          int64_t e0 = 0;
          for (; e0 + kLanes <= E; e0 += kLanes)
            for (int l = 0; l < kLanes; ++l) acc[l] += qs[g][e0 + l] * to_float(kv[e0 + l]);
          for (int l = 0; e0 + l < E; ++l) acc[l] += qs[g][e0 + l] * to_float(kv[e0 + l]);
          scores[g * stride + slot] = tree_sum(acc);
        }
      }
    }
    if (s.softcap > 0.f)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t slot = first; slot <= last; ++slot) {
          float& x = scores[g * stride + slot];
          x = std::tanh(x / s.softcap) * s.softcap;
        }
    float inv[kMaxGroup];
    float* o[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) {
      inv[g] = softmax_in_place(scores + g * stride + first, last - first);
      o[g] = out + ((b * s.tokens + t) * s.heads + h0 + g) * E;
    }
    if (fast.weighted[G - 1]) {
      const KV* path_values = s.paths ? vb + (split - start) * E : nullptr;
      fast.weighted[G - 1](scores + first, stride, vc + first * E, split - first, path_values,
                           last + 1 - first, inv, o);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {  // the portable loops: head by head
      const float* w = scores + g * stride;
      float acc[2][256] = {};  // even and odd slots from `first`, as weighted_avx512 sums them
      for (int64_t sl = first; sl <= last; ++sl) {
        const KV* vv = sl < split ? vc + sl * E : vb + (sl - start) * E;
        float* a = acc[(sl - first) & 1];
        for (int64_t e = 0; e < E; ++e) a[e] += w[sl] * to_float(vv[e]);
      }
      for (int64_t e = 0; e < E; ++e) o[g][e] = (acc[0][e] + acc[1][e]) * inv[g];
    }
  }
}

inline void store(const float* from, int64_t n, float* to) { std::memcpy(to, from, n * sizeof(float)); }
inline void store(const float* from, int64_t n, uint16_t* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = specsamp::float_to_half(from[i]);
}

// Write new [B, T, J, E] at each token's position (a tree block: at the row's first
// position + t) into cache [L, B, J, S, E], layer s.layer.
template <typename KV>
void write_cache(const Shape& s, const float* fresh, const int32_t* pos, KV* cache) {
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t p = s.paths ? pos[b * s.tokens] + t : pos[b * s.tokens + t];
      if (p < 0 || p >= s.slots) continue;
      for (int64_t j = 0; j < s.kv_heads; ++j)
        store(fresh + ((b * s.tokens + t) * s.kv_heads + j) * s.dim, s.dim,
              cache + (((s.layer * s.batch + b) * s.kv_heads + j) * s.slots + p) * s.dim);
    }
}

// Rows x KV heads below which a call's tokens are split into items of their own.
constexpr int64_t kTokenItemsBelow = 6;

// Writes this call's keys/values into caches of element KV (the aliased outputs) and
// attends.
template <typename KV>
void attend_all(ffi::ThreadPool& pool, const Shape& s, const float* queries, const float* k,
                const float* v, const int32_t* pos, KV* kc, KV* vc, float* o) {
  write_cache(s, k, pos, kc);
  write_cache(s, v, pos, vc);
  // Work items, split between the caller and the pool (parallel.h): one per (row, KV head),
  // running the query heads that share the KV head together (attend_heads), so their keys
  // and values are read once, not once per head. With few rows, one per (row, KV head,
  // token): a round scoring K + 1 tokens or a tree at batch 1 then has items for both
  // cores. (Items per (row, query head), which kept two cores busy on one row's 3 KV
  // heads, cost a fifth more at one token and up to a third more at several: each head
  // read its keys and values again; docs/measurements.md.) Each head's arithmetic is the
  // same whatever the items.
  const Fast<KV> fast = pick_fast<KV>(s.dim);
  const int64_t g_per = s.heads / s.kv_heads, kv_items = s.batch * s.kv_heads;
  const int64_t per_token = kv_items < kTokenItemsBelow ? s.tokens : 1;
  // Heads per attend_heads call: as many of the item's as the vector pass over the values
  // takes (the portable loops go through the keys together and the values head by head).
  const int64_t pass = fast.weighted[0] ? fast.group : kMaxGroup;
  specsamp::parallel_for(pool, kv_items * per_token, [&](int64_t item) {
    const int64_t bj = item / per_token, b = bj / s.kv_heads, j = bj % s.kv_heads;
    const int64_t t0 = per_token > 1 ? item % per_token : 0;
    const int64_t t1 = per_token > 1 ? t0 + 1 : s.tokens;
    thread_local std::vector<float> scores;  // scratch [kMaxGroup, S + 16] per thread
    thread_local std::vector<KV> kb, vb;      // a tree's gathered path [P, E] per thread
    scores.resize(kMaxGroup * (s.slots + 16));
    if (s.paths) kb.resize(s.path_len * s.dim), vb.resize(s.path_len * s.dim);
    const int64_t at = ((s.layer * s.batch + b) * s.kv_heads + j) * s.slots * s.dim;
    for (int64_t h = j * g_per; h < (j + 1) * g_per; h += pass)
      attend_heads(s, b, h, std::min(pass, (j + 1) * g_per - h), t0, t1, queries, pos, kc + at,
                   vc + at, o, scores.data(), kb.data(), vb.data(), fast);
  });
}

// The checks and the call shared by both targets; paths: a tree block's table or null.
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> q,
                  ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer k_cache,
                  ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> window,
                  const int32_t* paths, int64_t path_len, float scale, float softcap,
                  ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                  ffi::Result<ffi::AnyBuffer> v_out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), cd = k_cache.dimensions();
  const ffi::DataType type = k_cache.element_type();
  if (qd.size() != 4 || kd.size() != 4 || cd.size() != 5 || qd[0] != kd[0] || qd[1] != kd[1] ||
      kd[2] != cd[2] || kd[3] != cd[4] || qd[3] != cd[4] || cd[1] != qd[0] || qd[2] % kd[2] ||
      qd[3] > 256 || positions.element_count() != qd[0] * qd[1] ||
      (type != ffi::DataType::F32 && type != ffi::DataType::F16) ||
      v_cache.element_type() != type || k_out->element_type() != type ||
      v_out->element_type() != type ||
      v_cache.element_count() != k_cache.element_count() || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument(
        "attention: expected q [B, T, H, E], k/v [B, T, J, E], caches [L, B, J, S, E] both "
        "float32 or both float16, positions [B, T], E up to 256");
  Shape s{qd[0], qd[1], qd[2], kd[2], cd[3], cd[4], *layer.typed_data(), scale,
          *window.typed_data(), softcap, paths, path_len};
  if (s.layer < 0 || s.layer >= cd[0])
    return ffi::Error::InvalidArgument("attention: layer index out of range");
  // The caches are aliased to the outputs; should XLA have given separate buffers, start
  // from a copy (correct, only slower).
  const size_t bytes = k_cache.size_bytes();
  if (k_out->untyped_data() != k_cache.untyped_data())
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), bytes);
  if (v_out->untyped_data() != v_cache.untyped_data())
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), bytes);
  if (type == ffi::DataType::F32)
    attend_all(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), positions.typed_data(),
               static_cast<float*>(k_out->untyped_data()),
               static_cast<float*>(v_out->untyped_data()), out->typed_data());
  else
    attend_all(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), positions.typed_data(),
               static_cast<uint16_t*>(k_out->untyped_data()),
               static_cast<uint16_t*>(v_out->untyped_data()), out->typed_data());
  return ffi::Error::Success();
}

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                      ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer k_cache,
                      ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> window, float scale,
                      float softcap,
                      ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                      ffi::Result<ffi::AnyBuffer> v_out) {
  return Attend(pool, layer, q, k, v, positions, k_cache, v_cache, window, nullptr, 0, scale,
                softcap, out, k_out, v_out);
}

// A tree block: paths [B, T, P] int32 (see the top of this file).
ffi::Error AttendTreeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> positions,
                          ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> paths, float scale,
                          float softcap, ffi::ResultBuffer<ffi::F32> out,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = paths.dimensions();
  if (pd.size() != 3 || pd[2] < 1 || pd[0] * pd[1] != positions.element_count())
    return ffi::Error::InvalidArgument("attention: expected paths [B, T, P] with P >= 1");
  return Attend(pool, layer, q, k, v, positions, k_cache, v_cache, window, paths.typed_data(),
                pd[2], scale, softcap, out, k_out, v_out);
}

// Both targets' bindings: the operands up to the window (a tree's paths table follows),
// then the attributes and results.
auto attend_inputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

template <typename Binding>
auto attend_outputs(Binding binding) {
  return std::move(binding).template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampAttend, AttendImpl, attend_outputs(attend_inputs()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampAttendTree, AttendTreeImpl,
                              attend_outputs(attend_inputs().Arg<ffi::Buffer<ffi::S32>>()));
