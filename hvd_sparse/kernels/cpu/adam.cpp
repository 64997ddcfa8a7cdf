// The Adam path's dense steps in one pass (one thread): Adam's moments of an averaged gradient a
// and the update they give, element by element in T (the reference Backend.adam_update):
//   m = m * b1 + a * (1 - b1)
//   v = v * b2 + (a * a) * (1 - b2)
//   out = (m * c1) / (sqrt(v * c2) + eps)
// each operation rounded to T in that order (the library is built with -ffp-contract=off), so the
// result is the reference's bit for bit. The constants arrive as doubles and are rounded to T, as
// the reference rounds the Python floats it multiplies by.
//
// C ABI: hvd_sparse_adam_update_<f32|f64>(average, m, v, out, n, constants) with constants =
// {b1, 1 - b1, b2, 1 - b2, c1, c2, eps}; out may be average. Returns 0, or -1 for invalid
// arguments.

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
int adam_update(const T* average, T* m, T* v, T* out, int64_t n, const double* constants) {
    if (n < 0 || (n > 0 && (average == nullptr || m == nullptr || v == nullptr || out == nullptr))
        || constants == nullptr)
        return -1;
    const T b1 = T(constants[0]), g1 = T(constants[1]), b2 = T(constants[2]), g2 = T(constants[3]);
    const T c1 = T(constants[4]), c2 = T(constants[5]), eps = T(constants[6]);
    for (int64_t i = 0; i < n; ++i) {
        const T a = average[i];
        const T first = m[i] * b1 + a * g1;
        const T second = v[i] * b2 + (a * a) * g2;
        m[i] = first;
        v[i] = second;
        out[i] = (first * c1) / (std::sqrt(second * c2) + eps);
    }
    return 0;
}

}  // namespace

extern "C" {

int hvd_sparse_adam_update_f32(const float* average, float* m, float* v, float* out, int64_t n,
                               const double* constants) {
    return adam_update(average, m, v, out, n, constants);
}
int hvd_sparse_adam_update_f64(const double* average, double* m, double* v, double* out, int64_t n,
                               const double* constants) {
    return adam_update(average, m, v, out, n, constants);
}

}  // extern "C"
