// DGC's selection in one call: the reference composition of backend ops
// (hvd_sparse/backends/base.py, Backend.sampled_threshold_select) without a return to Python
// between its steps, each of which costs a per-tensor step more in dispatch than in arithmetic,
// over every segment of a vector at once (a bucket packing many tensors selects per tensor).
//
// In each segment, on its own:
// * the threshold is the `top`-th largest magnitude of seg[start::stride] (NaN when the sample
//   holds a NaN, which ranks above every magnitude);
// * the adaptation band runs as the reference does: select |x| >= threshold (accumulate.cpp's
//   selection, the threshold rounded to x's type as NumPy rounds it); more than upper·k chosen:
//   the exact top-k among them (topk.cpp; resample) and stop, or threshold ×= upper; fewer than
//   lower·k: threshold ×= lower; else stop; at most `iterations` times (DGC passes none for an
//   unsampled tensor). The first k chosen (ascending) are kept.
//
// C ABI: hvd_sparse_sampled_threshold_select(x, dtype, n, plan, segments, upper, lower, resample,
// room, index_bits, thresholds): plan holds 7 int64 per segment (offset, size, k, start, stride,
// top, iterations), the segments' sizes summing to at most n. Writes each segment's chosen
// indices, ascending and offset by its offset, one segment after the other in plan order, at the
// front of room (room for n indices of index_bits) and returns how many in all (at most the sum
// of the k); each segment's final threshold (before rounding) in thresholds[segment]; -1 for
// invalid arguments, -2 when memory ran out.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

extern "C" {
int hvd_sparse_topk_abs_f32_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f32_i64(const void* x, int64_t n, int64_t k, int64_t* out);
int hvd_sparse_topk_abs_f64_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f64_i64(const void* x, int64_t n, int64_t k, int64_t* out);
int64_t hvd_sparse_select_at_least(const void* x, int dtype, int64_t lo, int64_t hi, double threshold,
                                   void* out, int index_bits, const double* probes, int num_probes,
                                   int64_t row_len, int64_t every, int64_t sample_end, int64_t* counts);
}

namespace {

constexpr int F32 = 2, F64 = 3;   // the dtype codes of accumulate.cpp

inline int topk(const float* x, int64_t n, int64_t k, int32_t* out) { return hvd_sparse_topk_abs_f32_i32(x, n, k, out); }
inline int topk(const float* x, int64_t n, int64_t k, int64_t* out) { return hvd_sparse_topk_abs_f32_i64(x, n, k, out); }
inline int topk(const double* x, int64_t n, int64_t k, int32_t* out) { return hvd_sparse_topk_abs_f64_i32(x, n, k, out); }
inline int topk(const double* x, int64_t n, int64_t k, int64_t* out) { return hvd_sparse_topk_abs_f64_i64(x, n, k, out); }

// t rounded to R as NumPy's R(t) rounds it: to nearest, ties to even, beyond R's range to Inf
// (written out for float: a double outside float's range has no defined conversion in C++).
template <typename R>
double rounded(double t) {
  if (std::is_same<R, double>::value || std::isnan(t)) return t;
  const double top = double(FLT_MAX), midpoint = top + std::ldexp(1.0, 103);   // half an ulp above
  const double size = std::fabs(t);
  if (size >= midpoint) return std::copysign(std::numeric_limits<double>::infinity(), t);
  if (size > top) return std::copysign(top, t);
  return double(float(t));
}

// |x| >= threshold (rounded to R) over the whole of x, ascending into room: how many.
template <typename R, typename I>
int64_t select(const R* x, int64_t n, double threshold, I* room) {
  if (std::isnan(threshold)) return 0;   // nothing passes >= NaN
  return hvd_sparse_select_at_least(x, std::is_same<R, float>::value ? F32 : F64, 0, n, rounded<R>(threshold),
                                    room, std::is_same<I, int32_t>::value ? 32 : 64, nullptr, 0, 0, 1, 0,
                                    nullptr);
}

// The smallest of the `top` largest magnitudes of x[start::stride]; NaN when the sample holds one.
template <typename R>
double sample_threshold(const R* x, int64_t n, int64_t start, int64_t stride, int64_t top) {
  using U = std::conditional_t<sizeof(R) == 4, uint32_t, uint64_t>;
  const U mask = std::numeric_limits<U>::max() >> 1;
  U inf_key;
  const R inf = std::numeric_limits<R>::infinity();
  std::memcpy(&inf_key, &inf, sizeof(R));
  std::vector<U> keys;
  keys.reserve(size_t((n - start + stride - 1) / stride));
  for (int64_t i = start; i < n; i += stride) {
    U bits;
    std::memcpy(&bits, x + i, sizeof(R));
    const U key = bits & mask;   // |x| as an integer: -0 == +0, ordered as the magnitudes
    if (key > inf_key) return std::numeric_limits<double>::quiet_NaN();
    keys.push_back(key);
  }
  std::nth_element(keys.begin(), keys.begin() + (top - 1), keys.end(), std::greater<U>());
  R magnitude;
  std::memcpy(&magnitude, &keys[size_t(top - 1)], sizeof(R));
  return double(magnitude);
}

// The exact top-k of x[room[0..count)] by magnitude, kept ascending at the front of room.
template <typename R, typename I>
int resample(const R* x, I* room, int64_t count, int64_t k) {
  std::vector<R> values(static_cast<size_t>(count));
  for (int64_t j = 0; j < count; ++j) values[size_t(j)] = x[room[j]];
  std::vector<I> chosen(static_cast<size_t>(k));
  const int status = topk(values.data(), count, k, chosen.data());
  if (status != 0) return status;
  for (int64_t j = 0; j < k; ++j) room[j] = room[chosen[size_t(j)]];   // chosen[j] >= j: in place
  return 0;
}

template <typename R, typename I>
int64_t run(const R* x, int64_t n, int64_t k, int64_t start, int64_t stride, int64_t top, double upper,
            double lower, int64_t iterations, bool resampling, I* room, double* threshold_out) {
  double threshold = sample_threshold(x, n, start, stride, top);
  int64_t count = select(x, n, threshold, room);
  for (int64_t it = 0; it < iterations; ++it) {
    if (count > k) {
      if (double(count) <= upper * double(k)) break;
      if (resampling) {
        const int status = resample(x, room, count, k);
        if (status != 0) return status;
        count = k;
        break;
      }
      threshold *= upper;
    } else if (double(count) < lower * double(k)) {
      threshold *= lower;
    } else {
      break;
    }
    count = select(x, n, threshold, room);
  }
  *threshold_out = threshold;
  return std::min(count, k);
}

// Every segment of plan in turn (offset, size, k, start, stride, top, iterations each), its
// indices appended to room: how many in all, or a negative status.
template <typename R, typename I>
int64_t run_segments(const R* x, const int64_t* plan, int64_t segments, double upper, double lower,
                     bool resampling, I* room, double* thresholds) {
  int64_t written = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t* p = plan + 7 * s;
    I* out = room + written;
    const int64_t kept = run<R, I>(x + p[0], p[1], p[2], p[3], p[4], p[5], upper, lower, p[6], resampling,
                                   out, thresholds + s);
    if (kept < 0) return kept;
    for (int64_t j = 0; j < kept; ++j) out[j] += static_cast<I>(p[0]);
    written += kept;
  }
  return written;
}

// Whether one segment's (offset, size, k, start, stride, top, iterations) fits a vector of n.
bool valid_segment(const int64_t* p, int64_t n) {
  const int64_t offset = p[0], size = p[1], k = p[2], start = p[3], stride = p[4], top = p[5];
  return offset >= 0 && size >= 1 && offset <= n - size && k >= 1 && k <= size && stride >= 1 && start >= 0
         && (stride == 1 || start < stride) && start < size && top >= 1
         && top <= (size - start + stride - 1) / stride && p[6] >= 0;
}

}  // namespace

extern "C" {

int64_t hvd_sparse_sampled_threshold_select(const void* x, int dtype, int64_t n, const int64_t* plan,
                                            int64_t segments, double upper, double lower, int resample,
                                            void* room, int index_bits, double* thresholds) {
  if (n < 1 || segments < 0 || x == nullptr || plan == nullptr || room == nullptr || thresholds == nullptr
      || (index_bits == 32 && n > INT32_MAX))
    return -1;
  int64_t total = 0;
  for (int64_t s = 0; s < segments; ++s) {
    if (!valid_segment(plan + 7 * s, n)) return -1;
    total += plan[7 * s + 1];
    if (total > n) return -1;   // room holds n indices
  }
  auto go = [&](auto value_tag, auto index_tag) -> int64_t {
    using R = decltype(value_tag);
    using I = decltype(index_tag);
    return run_segments<R, I>(static_cast<const R*>(x), plan, segments, upper, lower, resample != 0,
                              static_cast<I*>(room), thresholds);
  };
  try {
    const bool wide = index_bits == 64;
    if (index_bits != 32 && !wide) return -1;
    if (dtype == F32) return wide ? go(float{}, int64_t{}) : go(float{}, int32_t{});
    if (dtype == F64) return wide ? go(double{}, int64_t{}) : go(double{}, int32_t{});
    return -1;
  } catch (const std::bad_alloc&) {
    return -2;
  }
}

}  // extern "C"
