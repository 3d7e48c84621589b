// Decode-time attention over the KV cache for XLA's CPU backend, called through the FFI.
//
// One call per layer: write this call's keys/values into the cache (in place: the cache
// operands are aliased to the outputs) and attend, for every query row, over the slots
// 0..position of its row only. The cache is [L, B, J, S, E] and is read at layer `layer`
// where it lies: no copy of the cache per step, and no work on the slots beyond a row's
// position (a fixed-size cache is mostly empty while a row is short).
//
// Every (row, token, head) is computed on its own, in the same order whatever the number of
// tokens T in the call, so scoring K+1 tokens gives the same numbers as K+1 single steps.
// The exponential is a polynomial (no libm call), so loops vectorize; functions are
// compiled for AVX-512, AVX2 and plain x86-64 and chosen at load time (target_clones).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

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

struct Shape {
  int64_t batch, tokens, heads, kv_heads, slots, dim, layer;
  float scale;
};

// Queries of one (row b, KV head j) group: T tokens x G heads. scores is scratch [S].
SPECSAMP_CLONES
void attend_group(const Shape& s, int64_t b, int64_t j, const float* q, const int32_t* pos,
                  const float* kc, const float* vc, float* out, float* scores) {
  const int64_t g_per = s.heads / s.kv_heads, E = s.dim;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const int64_t last = std::min<int64_t>(std::max<int32_t>(pos[b * s.tokens + t], 0), s.slots - 1);
    for (int64_t g = 0; g < g_per; ++g) {
      const int64_t h = j * g_per + g;
      const float* qv = q + ((b * s.tokens + t) * s.heads + h) * E;
      float qs[256];
      for (int64_t e = 0; e < E; ++e) qs[e] = qv[e] * s.scale;
      float m = -3.4e38f;
      for (int64_t slot = 0; slot <= last; ++slot) {
        const float* kv = kc + slot * E;
        float acc[kLanes] = {0};
        int64_t e0 = 0;
        for (; e0 + kLanes <= E; e0 += kLanes)
          for (int l = 0; l < kLanes; ++l) acc[l] += qs[e0 + l] * kv[e0 + l];
        for (int l = 0; e0 + l < E; ++l) acc[l] += qs[e0 + l] * kv[e0 + l];
        float d = 0.f;
        for (int l = 0; l < kLanes; ++l) d += acc[l];
        scores[slot] = d;
        m = std::max(m, d);
      }
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
      float total = 0.f;
      for (int l = 0; l < kLanes; ++l) total += part[l];
      float* o = out + ((b * s.tokens + t) * s.heads + h) * E;
      float acc[256] = {0};
      for (int64_t sl = 0; sl <= last; ++sl) {
        const float w = scores[sl];
        const float* vv = vc + sl * E;
        for (int64_t e = 0; e < E; ++e) acc[e] += w * vv[e];
      }
      const float inv = 1.f / total;
      for (int64_t e = 0; e < E; ++e) o[e] = acc[e] * inv;
    }
  }
}

// Write new [B, T, J, E] at each token's position into cache [L, B, J, S, E], layer s.layer.
void write_cache(const Shape& s, const float* fresh, const int32_t* pos, float* cache) {
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t p = pos[b * s.tokens + t];
      if (p < 0 || p >= s.slots) continue;
      for (int64_t j = 0; j < s.kv_heads; ++j)
        std::memcpy(cache + (((s.layer * s.batch + b) * s.kv_heads + j) * s.slots + p) * s.dim,
                    fresh + ((b * s.tokens + t) * s.kv_heads + j) * s.dim, s.dim * sizeof(float));
    }
}

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                      ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> k_cache,
                      ffi::Buffer<ffi::F32> v_cache, float scale,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> k_out,
                      ffi::ResultBuffer<ffi::F32> v_out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), cd = k_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || cd.size() != 5 || qd[0] != kd[0] || qd[1] != kd[1] ||
      kd[2] != cd[2] || kd[3] != cd[4] || qd[3] != cd[4] || cd[1] != qd[0] || qd[2] % kd[2] ||
      qd[3] > 256 || positions.element_count() != qd[0] * qd[1] ||
      v_cache.element_count() != k_cache.element_count() || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument(
        "attention: expected q [B, T, H, E], k/v [B, T, J, E], caches [L, B, J, S, E], "
        "positions [B, T], E up to 256");
  Shape s{qd[0], qd[1], qd[2], kd[2], cd[3], cd[4], *layer.typed_data(), scale};
  if (s.layer < 0 || s.layer >= cd[0])
    return ffi::Error::InvalidArgument("attention: layer index out of range");
  // The caches are aliased to the outputs; should XLA have given separate buffers, start
  // from a copy (correct, only slower).
  const size_t bytes = k_cache.element_count() * sizeof(float);
  if (k_out->typed_data() != k_cache.typed_data())
    std::memcpy(k_out->typed_data(), k_cache.typed_data(), bytes);
  if (v_out->typed_data() != v_cache.typed_data())
    std::memcpy(v_out->typed_data(), v_cache.typed_data(), bytes);
  const int32_t* pos = positions.typed_data();
  write_cache(s, k.typed_data(), pos, k_out->typed_data());
  write_cache(s, v.typed_data(), pos, v_out->typed_data());

  // (row, KV head) groups, split between the caller and the pool (parallel.h).
  const float *queries = q.typed_data(), *kc = k_out->typed_data(), *vc = v_out->typed_data();
  float* o = out->typed_data();
  specsamp::parallel_for(pool, s.batch * s.kv_heads, [&](int64_t i) {
    thread_local std::vector<float> scores;  // scratch [S] per thread
    scores.resize(s.slots);
    const int64_t b = i / s.kv_heads, j = i % s.kv_heads;
    const int64_t at = ((s.layer * s.batch + b) * s.kv_heads + j) * s.slots * s.dim;
    attend_group(s, b, j, queries, pos, kc + at, vc + at, o, scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampAttend, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
