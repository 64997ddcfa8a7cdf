// DGC's momentum correction in one pass (one thread): for gradient g (the bucket's inputs, in the
// residual's dtype), momentum u and residual r, element by element,
//   plain:    u = u * m + g;        r = r + u
//   nesterov: u = (u + g) * m;      r = (r + u) + g
// with g = 0 + input, as the reference computes it (it accumulates the inputs into zeros, which
// turns -0 into +0). The same operations in the same order and precision as the reference's
// torch ops (no fused multiply-add: the library is built with -ffp-contract=off), so the result
// is bit for bit the same.
//
// C ABI: hvd_sparse_momentum_<f32|f64>(residual, momentum, inputs, sizes, count, factor, nesterov)
// returns 0, or -1 for invalid arguments.

#include <cstdint>

namespace {

template <typename T>
int momentum(T* residual, T* u, const T* const* inputs, const int64_t* sizes, int64_t count, double factor,
             int nesterov) {
  if (count < 0 || (count > 0 && (inputs == nullptr || sizes == nullptr))) return -1;
  const T m = T(factor);
  for (int64_t t = 0; t < count; ++t) {
    const T* g_in = inputs[t];
    const int64_t n = sizes[t];
    if (nesterov) {
      for (int64_t i = 0; i < n; ++i) {
        const T g = T(0) + g_in[i];
        u[i] = (u[i] + g) * m;
        residual[i] = (residual[i] + u[i]) + g;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const T g = T(0) + g_in[i];
        u[i] = u[i] * m + g;
        residual[i] = residual[i] + u[i];
      }
    }
    residual += n;
    u += n;
  }
  return 0;
}

}  // namespace

extern "C" {

int hvd_sparse_momentum_f32(float* residual, float* u, const float* const* inputs, const int64_t* sizes,
                            int64_t count, double factor, int nesterov) {
  return momentum(residual, u, inputs, sizes, count, factor, nesterov);
}
int hvd_sparse_momentum_f64(double* residual, double* u, const double* const* inputs, const int64_t* sizes,
                            int64_t count, double factor, int nesterov) {
  return momentum(residual, u, inputs, sizes, count, factor, nesterov);
}

}  // extern "C"
