// TensorFlow custom ops over the CPU kernels: the same C functions the ctypes library exports,
// compiled from the same sources (topk.cpp) into a library built against the installed
// TensorFlow (setup.py: tf.sysconfig's compile and link flags) and loaded with
// tf.load_op_library (kernels/cpu/tf_ops.py). An op runs inside TensorFlow's own executor, eager
// or in a graph, on TensorFlow's buffers: nothing is copied out of the framework.
//
// HvdSparseTopkAbs(x, k) -> indices: the k entries of largest magnitude of x (flattened) as
// ascending int32/int64 indices, with the tie rule of Backend.topk_abs_indices (topk.cpp).

#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

extern "C" {
int hvd_sparse_topk_abs_f32_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f32_i64(const void* x, int64_t n, int64_t k, int64_t* out);
int hvd_sparse_topk_abs_f64_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f64_i64(const void* x, int64_t n, int64_t k, int64_t* out);
}

namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

template <typename T, typename I> struct TopkFunction;
template <> struct TopkFunction<float, int32_t> {
  static constexpr auto call = hvd_sparse_topk_abs_f32_i32;
};
template <> struct TopkFunction<float, int64_t> {
  static constexpr auto call = hvd_sparse_topk_abs_f32_i64;
};
template <> struct TopkFunction<double, int32_t> {
  static constexpr auto call = hvd_sparse_topk_abs_f64_i32;
};
template <> struct TopkFunction<double, int64_t> {
  static constexpr auto call = hvd_sparse_topk_abs_f64_i64;
};

template <typename T, typename I>
class TopkAbsOp : public OpKernel {
 public:
  explicit TopkAbsOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& k_tensor = context->input(1);
    OP_REQUIRES(context, tensorflow::TensorShapeUtils::IsScalar(k_tensor.shape()),
                tensorflow::errors::InvalidArgument("k must be a scalar"));
    const int64_t n = x.NumElements();
    const int64_t k = k_tensor.scalar<int64_t>()();
    OP_REQUIRES(context, 0 <= k && k <= n,
                tensorflow::errors::InvalidArgument("k = ", k, " outside [0, ", n, "]"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({k}), &out));
    const int status = TopkFunction<T, I>::call(x.data(), n, k, out->flat<I>().data());
    OP_REQUIRES(context, status != -2,
                tensorflow::errors::ResourceExhausted("top-k kernel: out of memory selecting ", k,
                                                      " of ", n, " entries"));
    OP_REQUIRES(context, status == 0,
                tensorflow::errors::InvalidArgument("top-k kernel refused its arguments, status ",
                                                    status));
  }
};

}  // namespace

REGISTER_OP("HvdSparseTopkAbs")
    .Input("x: T")
    .Input("k: int64")
    .Output("indices: Tidx")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return tensorflow::OkStatus();
    });

#define HVD_SPARSE_REGISTER_TOPK(T, I)                                                \
  REGISTER_KERNEL_BUILDER(Name("HvdSparseTopkAbs")                                    \
                              .Device(DEVICE_CPU)                                     \
                              .TypeConstraint<T>("T")                                 \
                              .TypeConstraint<I>("Tidx"),                             \
                          TopkAbsOp<T, I>)

HVD_SPARSE_REGISTER_TOPK(float, int32_t);
HVD_SPARSE_REGISTER_TOPK(float, int64_t);
HVD_SPARSE_REGISTER_TOPK(double, int32_t);
HVD_SPARSE_REGISTER_TOPK(double, int64_t);
