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

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 2048;

template <typename T>
double block_sum(const T* x, int64_t n) {   // n <= kBlock
  double lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const double v = double(x[i + l]);
      lane[l] += v * v;
    }
  for (int64_t l = 0; i < n; ++i, ++l) {
    const double v = double(x[i]);
    lane[l] += v * v;
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

template <typename T>
int segment_sumsq(const T* x, const int64_t* lengths, int64_t count, double* sums) {
  if (count < 0 || (count > 0 && (lengths == nullptr || sums == nullptr))) return -1;
  for (int64_t s = 0; s < count; ++s) {
    if (lengths[s] < 0) return -1;
    double total = 0.0;
    for (int64_t start = 0; start < lengths[s]; start += kBlock) {
      const int64_t n = lengths[s] - start < kBlock ? lengths[s] - start : kBlock;
      total += block_sum(x + start, n);
    }
    sums[s] = total;
    x += lengths[s];
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t hvd_sparse_segment_sumsq_depth(int64_t length) {
  int64_t lanes_depth = 0;
  for (int64_t width = kLanes; width > 1; width /= 2) ++lanes_depth;
  return kBlock / kLanes + lanes_depth + (length + kBlock - 1) / kBlock;
}
int hvd_sparse_segment_sumsq_f32(const float* x, const int64_t* lengths, int64_t count, double* sums) {
  return segment_sumsq(x, lengths, count, sums);
}
int hvd_sparse_segment_sumsq_f64(const double* x, const int64_t* lengths, int64_t count, double* sums) {
  return segment_sumsq(x, lengths, count, sums);
}

}  // extern "C"

// Shifted first and second moments (Gaussian-k's mean and standard deviation), one pass, one
// thread: t1 = Σd and t2 = Σd² in float64 for d = x - x[0]. A block of kMomentBlock entries is
// summed in kLanes interleaved lanes, the lanes pairwise; blocks are summed kFanout at a time,
// those sums kFanout at a time, and the rest in order, so a term goes through at most
// hvd_sparse_moments_depth(n) roundings (shift and square included) and the caller
// (hvd_sparse/backends/base.py certain_mean_std) can tell whether the float32 results are certain.
//
// C ABI: hvd_sparse_moments_<f32|f64>(x, n, sums) writes sums[0] = shift, sums[1] = t1,
// sums[2] = t2; 0 or -1.

namespace {

constexpr int64_t kMomentBlock = 512;
constexpr int64_t kFanout = 64;

template <typename T>
void block_moments(const T* x, int64_t n, double shift, double* s1, double* s2) {   // n <= kMomentBlock
  double a[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  double b[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const double d = double(x[i + l]) - shift;
      a[l] += d;
      b[l] += d * d;
    }
  for (int64_t l = 0; i < n; ++i, ++l) {
    const double d = double(x[i]) - shift;
    a[l] += d;
    b[l] += d * d;
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) {
      a[l] += a[l + width];
      b[l] += b[l + width];
    }
  *s1 = a[0];
  *s2 = b[0];
}

template <typename T>
int moments(const T* x, int64_t n, double* sums) {
  if (n < 1 || x == nullptr || sums == nullptr) return -1;
  const double shift = double(x[0]);
  double level1[2] = {0, 0}, level2[2] = {0, 0}, level3[2] = {0, 0};
  int64_t blocks = 0;
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const int64_t m = n - start < kMomentBlock ? n - start : kMomentBlock;
    double s1, s2;
    block_moments(x + start, m, shift, &s1, &s2);
    level1[0] += s1;
    level1[1] += s2;
    if (++blocks % kFanout == 0) {
      level2[0] += level1[0];
      level2[1] += level1[1];
      level1[0] = level1[1] = 0;
      if (blocks % (kFanout * kFanout) == 0) {
        level3[0] += level2[0];
        level3[1] += level2[1];
        level2[0] = level2[1] = 0;
      }
    }
  }
  sums[0] = shift;
  sums[1] = level3[0] + level2[0] + level1[0];
  sums[2] = level3[1] + level2[1] + level1[1];
  return 0;
}

}  // namespace

extern "C" {

int64_t hvd_sparse_moments_depth(int64_t n) {
  return kMomentBlock / kLanes + 3 + 2 * kFanout + n / (kMomentBlock * kFanout * kFanout) + 8;
}
int hvd_sparse_moments_f32(const float* x, int64_t n, double* sums) { return moments(x, n, sums); }
int hvd_sparse_moments_f64(const double* x, int64_t n, double* sums) { return moments(x, n, sums); }

}  // extern "C"
