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
