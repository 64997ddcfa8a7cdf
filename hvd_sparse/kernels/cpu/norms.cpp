// Sums of squares of consecutive segments in float64 (DEFT's per-unit norms), one pass, one
// thread. The summation order is fixed and its rounding depth known, so that the caller
// (norms.py, hvd_sparse/backends/base.py float32_norms) can tell whether the float32 norm is
// certain or must come from an exact sum: a block of kBlock entries is summed in kLanes
// interleaved lanes (vectorizable: each lane is a sequential sum, no reassociation), the lanes
// pairwise, and the blocks in order. A term thus goes through at most
// kBlock / kLanes + log2(kLanes) + blocks additions (one more where its square is rounded).
//
// C ABI: hvd_sparse_segment_sumsq_<f32|f64>(x, lengths, count, sums) writes count sums; 0 or -1.

#include <cstdint>

#include "sums.h"

namespace {

using hvd_sparse::kLanes;
using hvd_sparse::kLanesDepth;

constexpr int64_t kBlock = 2048;

template <typename T>
int segment_sumsq(const T* x, const int64_t* lengths, int64_t count, double* sums) {
  if (count < 0 || (count > 0 && (lengths == nullptr || sums == nullptr))) return -1;
  for (int64_t s = 0; s < count; ++s) {
    if (lengths[s] < 0) return -1;
    double total = 0.0;
    for (int64_t start = 0; start < lengths[s]; start += kBlock) {
      const int64_t n = lengths[s] - start < kBlock ? lengths[s] - start : kBlock;
      total += hvd_sparse::lane_sumsq(x + start, n);
    }
    sums[s] = total;
    x += lengths[s];
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t hvd_sparse_segment_sumsq_depth(int64_t length) {
  return kBlock / kLanes + kLanesDepth + (length + kBlock - 1) / kBlock;
}
int hvd_sparse_segment_sumsq_f32(const float* x, const int64_t* lengths, int64_t count, double* sums) {
  return segment_sumsq(x, lengths, count, sums);
}
int hvd_sparse_segment_sumsq_f64(const double* x, const int64_t* lengths, int64_t count, double* sums) {
  return segment_sumsq(x, lengths, count, sums);
}

}  // extern "C"

// Shifted first and second moments (Gaussian-k's mean and standard deviation), one pass, one
// thread: t1 = Σd and t2 = Σd² in float64 for d = x - x[0], in blocks of kMomentBlock entries
// (hvd_sparse::MomentSums), so a term goes through at most hvd_sparse_moments_depth(n) roundings
// (shift and square included) and the caller (hvd_sparse/backends/base.py certain_mean_std) can
// tell whether the float32 results are certain.
//
// C ABI: hvd_sparse_moments_<f32|f64>(x, n, sums) writes sums[0] = shift, sums[1] = t1,
// sums[2] = t2; 0 or -1.

namespace {

constexpr int64_t kMomentBlock = 512;

template <typename T>
int moments(const T* x, int64_t n, double* sums) {
  if (n < 1 || x == nullptr || sums == nullptr) return -1;
  hvd_sparse::MomentSums m;
  for (int64_t start = 0; start < n; start += kMomentBlock)
    m.add(x + start, n - start < kMomentBlock ? n - start : kMomentBlock);
  sums[0] = m.shift;
  sums[1] = m.sums.total(0);
  sums[2] = m.sums.total(1);
  return 0;
}

}  // namespace

extern "C" {

int64_t hvd_sparse_moments_depth(int64_t n) {
  hvd_sparse::MomentSums m;   // the depth of the blocks moments() feeds, without the data
  m.sums.longest = n < kMomentBlock ? n : kMomentBlock;
  m.sums.pieces = (n + kMomentBlock - 1) / kMomentBlock;
  return m.depth();
}
int hvd_sparse_moments_f32(const float* x, int64_t n, double* sums) { return moments(x, n, sums); }
int hvd_sparse_moments_f64(const double* x, int64_t n, double* sums) { return moments(x, n, sums); }

}  // extern "C"

// The exact sums behind mean_std, for the rare vectors whose float64 sums cannot decide the
// float32 results (hvd_sparse/backends/base.py exact_mean_std does the same in NumPy, some
// hundred times slower). An fp32 entry is ±M·2^(E'-150) with the integer M < 2^24 and E' its
// biased exponent (1 for subnormals); per E', bins[4E'..4E'+3] accumulate ΣM (signed) and, with
// M = a·2^12 + b, Σa², Σ2ab and Σb² (M² = a²·2^24 + 2ab·2^12 + b²). At most 2^25 entries per call,
// so that no bin can overflow; the caller adds the calls' bins as integers.
//
// C ABI: hvd_sparse_exact_sums_f32(x, n, bins) with room for 256 * 4 bins (zeroed here); 0, or 1
// when x holds NaN/Inf (bins then unspecified), -1 for n outside [0, 2^25].

extern "C" int hvd_sparse_exact_sums_f32(const void* x, int64_t n, int64_t* bins) {
  if (n < 0 || n > (int64_t(1) << 25)) return -1;
  for (int64_t i = 0; i < 256 * 4; ++i) bins[i] = 0;
  const uint32_t* bits = static_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits[i];
    const uint32_t biased = (u >> 23) & 0xffu;
    if (biased == 0xffu) return 1;
    const int64_t m = int64_t((u & 0x7fffffu) | (biased ? 0x800000u : 0u));
    const int64_t a = m >> 12, b = m & 0xfff;
    int64_t* bin = bins + 4 * (biased ? biased : 1);
    bin[0] += (u >> 31) ? -m : m;
    bin[1] += a * a;
    bin[2] += 2 * a * b;
    bin[3] += b * b;
  }
  return 0;
}
