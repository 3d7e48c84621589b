// Row reductions of the sampling path for XLA's CPU backend, called through the FFI.
//
// Each kernel computes, bit for bit, what its XLA twin computes:
//   specsamp_tree_sum   specsamp.reductions.tree_sum over the last axis (the row zero-padded
//                       to a power of two, then halves added until one entry is left)
//   specsamp_sample     specsamp.decoding.sampling._sample_row: the inverse-CDF draw with the
//                       row's uniform number u, block sums of 256 entries (tree sums), their
//                       running sum (reductions.cumsum's Hillis-Steele order), the block, then
//                       the entry within it
//   specsamp_residual_sample  sampling.draw(sampling.residual(s q, p), u): the residual
//                       (s q - p)+ over its tree sum (s q itself where that sum is not
//                       positive), drawn from as specsamp_sample draws, without the
//                       residual's row leaving the kernel; s, one factor per row (block
//                       verification's P; 1 for the per-token rule, where s q is q)
//   specsamp_residual_mass  sampling.residual_mass(q, p, s): the tree sums of (s_m q_{m+1} -
//                       p_{m+1})+ for m < M, rows 1..M of q [..., Rq, V] and p [..., Rp, V]
//                       read where they lie (no sliced copies)
//   specsamp_top_value  the k-th largest entry of each row, lax.top_k(x, k)[0][..., k - 1]
//                       (the top-k filter's threshold), in lax.top_k's total order
//   specsamp_nucleus_cut  sampling._nucleus_tiers: the largest probabilities (lax.top_k's
//                       values), their running sum (reductions.cumsum), and the least one
//                       whose mass before it is below top_p (sampling._smallest_kept), in
//                       tiers of 256, 4,096 and all entries
// The same float32 operations in the same order give the same bits, so whether a program
// runs these kernels or the XLA operations never changes a probability or a draw; the
// kernels only cost less. XLA:CPU runs a tree sum over a vocabulary as a padded copy and a
// dozen small loops, and the draw's running sums as fused loops that recompute their inputs
// at every level (docs/measurements.md). Only adds, one multiply, one subtraction and
// comparisons are involved, so no contraction into fused multiply-adds can change a bit
// (this file is built for plain x86-64: no FMA instructions; the XLA twins keep the
// product and the difference apart, `sampling._scaled`).
//
// Rows are independent (a row's result never depends on the others or on their count) and
// are split between threads (parallel.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;  // sampling._BLOCK

// reductions.tree_sum of x[0..n) (n >= 1); buf is scratch.
float tree_sum(const float* x, int64_t n, std::vector<float>& buf) {
  if (n == 1) return x[0];
  int64_t width = 1;
  while (width < n) width <<= 1;
  int64_t half = width / 2;  // n > half: width is the least power of two >= n
  buf.resize(half);
  float* b = buf.data();
  for (int64_t i = 0; i < n - half; ++i) b[i] = x[i] + x[i + half];
  for (int64_t i = n - half; i < half; ++i) b[i] = x[i] + 0.0f;  // the zero padding (-0 + 0 = +0)
  for (int64_t h = half / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) b[i] = b[i] + b[i + h];
  return b[0];
}

// reductions.cumsum of x[0..n) in place: log2(n) rounds, entry i adding entry i - shift of
// the round before (zero below shift); tmp is scratch.
void cumsum(float* x, int64_t n, std::vector<float>& tmp) {
  tmp.resize(n);
  float* y = tmp.data();
  for (int64_t shift = 1; shift < n; shift *= 2) {
    for (int64_t i = 0; i < shift; ++i) y[i] = x[i] + 0.0f;
    for (int64_t i = shift; i < n; ++i) y[i] = x[i] + x[i - shift];
    std::copy(y, y + n, x);
  }
}

// sampling._first_above: the first i with running[i] > t among entries with a positive
// increment; else the last entry with a positive increment; -1 if there is none.
int64_t first_above(const float* running, const float* increment, int64_t n, float t) {
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (increment[i] > 0.0f) {
      if (running[i] > t) return i;
      last = i;
    }
  }
  return last;
}

struct Scratch {
  std::vector<float> sums, mass, row, increments, tmp, buf, dist, scaled;
  std::vector<int32_t> keys;
};

int32_t sample_row(const float* p, int64_t v, float u, Scratch& s) {
  const int64_t nb = (v + kBlock - 1) / kBlock;
  s.sums.resize(nb);
  s.row.assign(kBlock, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n = std::min(kBlock, v - b * kBlock);
    if (n == kBlock) {
      s.sums[b] = tree_sum(p + b * kBlock, kBlock, s.buf);
    } else {  // the last block, zero-padded as jnp.pad does
      std::fill(s.row.begin(), s.row.end(), 0.0f);
      std::copy(p + b * kBlock, p + b * kBlock + n, s.row.begin());
      s.sums[b] = tree_sum(s.row.data(), kBlock, s.buf);
    }
  }
  s.mass.assign(s.sums.begin(), s.sums.end());
  cumsum(s.mass.data(), nb, s.tmp);
  const float t = u * s.mass[nb - 1];
  const int64_t b = first_above(s.mass.data(), s.sums.data(), nb, t);
  const float before = b > 0 ? s.mass[b - 1] : 0.0f;
  const int64_t at = std::clamp<int64_t>(b, 0, nb - 1);  // dynamic_index_in_dim clamps
  const int64_t n = std::min(kBlock, v - at * kBlock);
  std::fill(s.row.begin(), s.row.end(), 0.0f);
  std::copy(p + at * kBlock, p + at * kBlock + n, s.row.begin());
  s.increments.assign(s.row.begin(), s.row.end());
  cumsum(s.row.data(), kBlock, s.tmp);
  const int64_t j = first_above(s.row.data(), s.increments.data(), kBlock, t - before);
  return static_cast<int32_t>(b * kBlock + j);
}

// sampling.draw(sampling.residual(q, p), u) for one row: (q - p)+ (std::max keeps the
// difference where it is not below 0, as jnp.maximum does), its tree sum, each entry over
// it (IEEE division, as XLA's without fast math); q itself where the sum is not positive.
// With a factor s != 1 on q, s q is a row of its own (the fallback draws from it).
int32_t residual_row(const float* q, const float* p, int64_t v, float u, float scale, Scratch& s) {
  if (scale != 1.0f) {
    s.scaled.resize(v);
    for (int64_t i = 0; i < v; ++i) s.scaled[i] = scale * q[i];
    q = s.scaled.data();
  }
  s.dist.resize(v);
  float* d = s.dist.data();
  for (int64_t i = 0; i < v; ++i) d[i] = std::max(q[i] - p[i], 0.0f);
  const float total = tree_sum(d, v, s.buf);
  if (!(total > 0.0f)) return sample_row(q, v, u, s);
  for (int64_t i = 0; i < v; ++i) d[i] = d[i] / total;
  return sample_row(d, v, u, s);
}

// sampling.residual_mass for one row: the tree sum of (s q - p)+.
float residual_mass_row(const float* q, const float* p, int64_t v, float scale, Scratch& s) {
  s.dist.resize(v);
  float* d = s.dist.data();
  for (int64_t i = 0; i < v; ++i) d[i] = std::max(scale * q[i] - p[i], 0.0f);
  return tree_sum(d, v, s.buf);
}

// lax.top_k orders floats by IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +inf <
// +NaN): a float's bits as an int32 whose magnitude bits are flipped when negative compare
// in that order as integers. The map is its own inverse.
inline int32_t order_key(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b ^ ((b >> 31) & 0x7fffffff);
}

inline float from_order_key(int32_t key) {
  const int32_t b = key ^ ((key >> 31) & 0x7fffffff);
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// lax.top_k(x, k)[0] for x[0..n) (1 <= k <= n): the k largest in total order, descending,
// into out. A min-heap of the k largest keys so far, entered only by keys above its least;
// 16 entries at a time are first tested by their largest key, which leaves the heap alone
// for most of a peaked row. Only values come out, so which of equal ones is kept does not
// matter.
void top_values(const float* x, int64_t n, int64_t k, std::vector<int32_t>& heap, float* out) {
  constexpr int64_t kChunk = 16;
  heap.resize(k);
  for (int64_t i = 0; i < k; ++i) heap[i] = order_key(x[i]);
  std::make_heap(heap.begin(), heap.end(), std::greater<int32_t>());
  auto enter = [&](int32_t key) {
    if (key > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<int32_t>());
      heap.back() = key;
      std::push_heap(heap.begin(), heap.end(), std::greater<int32_t>());
    }
  };
  int64_t i = k;
  for (; i + kChunk <= n; i += kChunk) {
    int32_t keys[kChunk];
    int32_t most = order_key(x[i]);
    for (int64_t j = 0; j < kChunk; ++j) {
      keys[j] = order_key(x[i + j]);
      most = std::max(most, keys[j]);
    }
    if (most > heap.front())
      for (int64_t j = 0; j < kChunk; ++j) enter(keys[j]);
  }
  for (; i < n; ++i) enter(order_key(x[i]));
  std::sort_heap(heap.begin(), heap.end(), std::greater<int32_t>());  // descending
  for (int64_t j = 0; j < k; ++j) out[j] = from_order_key(heap[j]);
}

// sampling._nucleus_tiers for one row: the `first` largest probabilities and their running
// sum; where that does not reach top_p, the `second` largest, the running sum of those
// past the first added to the first's total; then the whole row sorted. A tier that reaches
// top_p (or holds the whole row) gives the cut: the least entry whose mass before it is
// below top_p (a NaN among them gives NaN, as XLA's min does). Per row, where XLA moves
// every row of the call to the next tier together: a row covered by a tier has the same
// cut in every later one (the masses past it are its total plus sums of non-negative
// entries, never below top_p).
float nucleus_cut_row(const float* p, int64_t v, int64_t first, int64_t second, float top_p, Scratch& s) {
  const int64_t f = std::min(first, v);
  const int64_t tiers[3] = {f, std::min(second, v), v};
  for (const int64_t k : tiers) {
    s.row.resize(k);
    s.mass.resize(k);
    top_values(p, v, k, s.keys, s.row.data());
    std::copy(s.row.begin(), s.row.end(), s.mass.begin());
    cumsum(s.mass.data(), f, s.tmp);
    if (k > f) {
      cumsum(s.mass.data() + f, k - f, s.tmp);
      const float total = s.mass[f - 1];
      for (int64_t i = f; i < k; ++i) s.mass[i] = total + s.mass[i];
    }
    if (!(s.mass[k - 1] >= top_p) && k < v) continue;
    float cut = INFINITY;
    for (int64_t i = 0; i < k; ++i) {
      const float before = i > 0 ? s.mass[i - 1] : 0.0f;
      if (before < top_p) {
        if (s.row[i] != s.row[i]) return NAN;
        cut = std::min(cut, s.row[i]);
      }
    }
    return cut;
  }
  return NAN;  // not reached: the last tier holds the whole row
}

// x [..., N] -> (rows, N), checking that `out` holds one value per row.
bool row_shape(ffi::Buffer<ffi::F32>& x, int64_t out_size, int64_t* rows, int64_t* n) {
  const auto d = x.dimensions();
  if (d.size() < 1 || d.back() < 1) return false;
  *n = d.back();
  *rows = static_cast<int64_t>(x.element_count()) / *n;
  return *rows == out_size;
}

ffi::Error TreeSumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  int64_t rows, n;
  if (!row_shape(x, static_cast<int64_t>(out->element_count()), &rows, &n))
    return ffi::Error::InvalidArgument("tree_sum: expected x float32 [..., N >= 1], out float32 [...]");
  const float* xs = x.typed_data();
  float* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    thread_local std::vector<float> buf;
    ys[r] = tree_sum(xs + r * n, n, buf);
  });
  return ffi::Error::Success();
}

ffi::Error SampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> u,
                      ffi::ResultBuffer<ffi::S32> out) {
  int64_t rows, v;
  if (!row_shape(probs, static_cast<int64_t>(u.element_count()), &rows, &v) ||
      static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("sample: expected probs float32 [..., V >= 1], u float32 [...], "
                                       "out int32 [...]");
  const float* ps = probs.typed_data();
  const float* us = u.typed_data();
  int32_t* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    thread_local Scratch scratch;
    ys[r] = sample_row(ps + r * v, v, us[r], scratch);
  });
  return ffi::Error::Success();
}

ffi::Error ResidualSampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> p,
                              ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> scale,
                              ffi::ResultBuffer<ffi::S32> out) {
  int64_t rows, v;
  if (!row_shape(q, static_cast<int64_t>(u.element_count()), &rows, &v) ||
      p.element_count() != q.element_count() || static_cast<int64_t>(scale.element_count()) != rows ||
      static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("residual_sample: expected q and p float32 [..., V >= 1], "
                                       "u and scale float32 [...], out int32 [...]");
  const float* qs = q.typed_data();
  const float* ps = p.typed_data();
  const float* us = u.typed_data();
  const float* ss = scale.typed_data();
  int32_t* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    thread_local Scratch scratch;
    ys[r] = residual_row(qs + r * v, ps + r * v, v, us[r], ss[r], scratch);
  });
  return ffi::Error::Success();
}

ffi::Error ResidualMassImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> p,
                            ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto dq = q.dimensions(), dp = p.dimensions(), ds = scale.dimensions();
  const bool ranks = dq.size() >= 2 && dp.size() == dq.size() && ds.size() == dq.size() - 1;
  const int64_t v = ranks ? dq.back() : 0, m = ranks ? ds.back() : 0;
  const int64_t rq = ranks ? dq[dq.size() - 2] : 0, rp = ranks ? dp[dp.size() - 2] : 0;
  const int64_t lead = m > 0 ? static_cast<int64_t>(scale.element_count()) / m : 0;
  if (!ranks || v < 1 || m < 1 || dp.back() != v || rq < m + 1 || rp < m + 1 ||
      static_cast<int64_t>(q.element_count()) != lead * rq * v ||
      static_cast<int64_t>(p.element_count()) != lead * rp * v ||
      out->element_count() != scale.element_count())
    return ffi::Error::InvalidArgument("residual_mass: expected q float32 [..., Rq, V], p float32 "
                                       "[..., Rp, V], scale float32 [..., M] with Rq, Rp > M >= 1");
  const float* qs = q.typed_data();
  const float* ps = p.typed_data();
  const float* ss = scale.typed_data();
  float* ys = out->typed_data();
  specsamp::parallel_for(pool, lead * m, [&](int64_t r) {
    thread_local Scratch scratch;
    const int64_t b = r / m, i = r % m + 1;  // row i of q and p, after the first
    ys[r] = residual_mass_row(qs + (b * rq + i) * v, ps + (b * rp + i) * v, v, ss[r], scratch);
  });
  return ffi::Error::Success();
}

ffi::Error TopValueImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out,
                        int32_t k) {
  int64_t rows, n;
  if (!row_shape(x, static_cast<int64_t>(out->element_count()), &rows, &n) || k < 1 || k > n)
    return ffi::Error::InvalidArgument("top_value: expected x float32 [..., N], out float32 [...], "
                                       "1 <= k <= N");
  const float* xs = x.typed_data();
  float* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    thread_local Scratch scratch;
    scratch.row.resize(k);
    top_values(xs + r * n, n, k, scratch.keys, scratch.row.data());
    ys[r] = scratch.row[k - 1];
  });
  return ffi::Error::Success();
}

ffi::Error NucleusCutImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::ResultBuffer<ffi::F32> out,
                          int32_t first, int32_t second, float top_p) {
  int64_t rows, v;
  if (!row_shape(probs, static_cast<int64_t>(out->element_count()), &rows, &v) || first < 1 || second < first)
    return ffi::Error::InvalidArgument("nucleus_cut: expected probs float32 [..., V], out float32 [...], "
                                       "1 <= first <= second");
  const float* ps = probs.typed_data();
  float* ys = out->typed_data();
  specsamp::parallel_for(pool, rows, [&](int64_t r) {
    thread_local Scratch scratch;
    ys[r] = nucleus_cut_row(ps + r * v, v, first, second, top_p, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampTopValue, TopValueImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampNucleusCut, NucleusCutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("first")
                                  .Attr<int32_t>("second")
                                  .Attr<float>("top_p"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampResidualSample, ResidualSampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampResidualMass, ResidualMassImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampTreeSum, TreeSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecsampSample, SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
