// Float64 sums with a known rounding depth, shared by norms.cpp (the standalone reads) and
// accumulate.cpp (the same sums taken in the accumulating pass).
//
// The callers (hvd_sparse/backends/base.py: float32_norms, certain_mean_std) turn such a sum and
// the most roundings any of its terms went through into the exactly rounded float32 result, or
// fall back to an exact sum where the bound cannot decide; so any order will do as long as its
// depth is known. Here: a piece of at most a few thousand entries is summed in kLanes
// interleaved lanes (vectorizable: each lane a sequential sum, no reassociation), the lanes
// pairwise; piece sums are added kFanout at a time, those sums kFanout at a time, the rest in
// order (FanoutSum).

#ifndef HVD_SPARSE_SUMS_H
#define HVD_SPARSE_SUMS_H

#include <cstdint>

namespace hvd_sparse {

constexpr int64_t kLanes = 8;
constexpr int64_t kLanesDepth = 3;   // log2(kLanes): the pairwise reduction of the lanes
constexpr int64_t kFanout = 64;

// Σx² of n entries (n small) in kLanes lanes.
template <typename T>
inline double lane_sumsq(const T* x, int64_t n) {
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

// Σd and Σd² for d = x - shift over n entries (n small) in kLanes lanes.
template <typename T>
inline void lane_moments(const T* x, int64_t n, double shift, double* s1, double* s2) {
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

// K running sums fed one piece sum at a time: pieces kFanout at a time, those kFanout at a time,
// then in order. depth(): the most roundings a term went through, from the longest piece summed
// in lanes to the total, plus `extra` (the shift and the square of moments).
template <int K>
struct FanoutSum {
  double level1[K] = {}, level2[K] = {}, level3[K] = {};
  int64_t pieces = 0, longest = 0;

  void add(const double* piece_sums, int64_t piece_length) {
    for (int c = 0; c < K; ++c) level1[c] += piece_sums[c];
    if (piece_length > longest) longest = piece_length;
    if (++pieces % kFanout == 0) {
      for (int c = 0; c < K; ++c) {
        level2[c] += level1[c];
        level1[c] = 0;
      }
      if (pieces % (kFanout * kFanout) == 0)
        for (int c = 0; c < K; ++c) {
          level3[c] += level2[c];
          level2[c] = 0;
        }
    }
  }
  double total(int c) const { return level3[c] + level2[c] + level1[c]; }
  int64_t depth(int64_t extra) const {
    return (longest + kLanes - 1) / kLanes + kLanesDepth + 2 * kFanout + pieces / (kFanout * kFanout) + 2
           + extra;
  }
};

// Gaussian-k's shifted moments of a vector fed piece by piece, in order; the shift is the
// vector's first entry.
struct MomentSums {
  double shift = 0;
  FanoutSum<2> sums;

  template <typename T>
  void add(const T* x, int64_t n) {
    if (n <= 0) return;
    if (sums.pieces == 0) shift = double(x[0]);
    double piece[2];
    lane_moments(x, n, shift, &piece[0], &piece[1]);
    sums.add(piece, n);
  }
  int64_t depth() const { return sums.depth(6); }   // the shift, the square, and margin
};

// A sum of squares fed piece by piece (one DEFT unit).
struct SquareSums {
  FanoutSum<1> sums;

  template <typename T>
  void add(const T* x, int64_t n) {
    if (n <= 0) return;
    const double piece = lane_sumsq(x, n);
    sums.add(&piece, n);
  }
  int64_t depth() const { return sums.depth(1); }   // the square
};

}  // namespace hvd_sparse

#endif  // HVD_SPARSE_SUMS_H
