// Index writes without index temporaries (one thread): the reference ops (index_fill_, index_put_)
// first copy int32 indices to int64, which for a large selection (the first steps of a threshold
// method, a dense-ish union) is the largest temporary of the step.
//
//   zero_at:  x[idx[i]] = 0                              for every i
//   put_at:   x[idx[i] - offset] = T(values[i])          for every i (fp32 values, fp32/fp64 x:
//                                                        exact, as torch's .to(x.dtype) is)
//
// Every index is checked against [0, n) before anything is written, so an invalid index leaves x
// as it was, as the reference ops do.
//
// C ABI: hvd_sparse_zero_at_<f32|f64>_<i32|i64>(x, n, idx, count)
//        hvd_sparse_put_at_<f32|f64>_<i32|i64>(x, n, idx, count, offset, values)
// return 0, or -1 when an index falls outside [0, n).

#include <cstdint>

namespace {

template <typename I>
bool in_range(const I* idx, int64_t count, int64_t offset, int64_t n) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t at = int64_t(idx[i]) - offset;
    if (at < 0 || at >= n) return false;
  }
  return true;
}

template <typename T, typename I>
int zero_at(T* x, int64_t n, const I* idx, int64_t count) {
  if (!in_range(idx, count, 0, n)) return -1;
  for (int64_t i = 0; i < count; ++i) x[idx[i]] = T(0);
  return 0;
}

template <typename T, typename I>
int put_at(T* x, int64_t n, const I* idx, int64_t count, int64_t offset, const float* values) {
  if (!in_range(idx, count, offset, n)) return -1;
  for (int64_t i = 0; i < count; ++i) x[int64_t(idx[i]) - offset] = T(values[i]);
  return 0;
}

}  // namespace

#define HVD_SPARSE_INDEXING(T, TN, I, IN)                                                         \
  int hvd_sparse_zero_at_##TN##_##IN(T* x, int64_t n, const I* idx, int64_t count) {             \
    return zero_at(x, n, idx, count);                                                            \
  }                                                                                              \
  int hvd_sparse_put_at_##TN##_##IN(T* x, int64_t n, const I* idx, int64_t count, int64_t offset, \
                                    const float* values) {                                      \
    return put_at(x, n, idx, count, offset, values);                                             \
  }

extern "C" {
HVD_SPARSE_INDEXING(float, f32, int32_t, i32)
HVD_SPARSE_INDEXING(float, f32, int64_t, i64)
HVD_SPARSE_INDEXING(double, f64, int32_t, i32)
HVD_SPARSE_INDEXING(double, f64, int64_t, i64)
}  // extern "C"
