// TensorFlow custom ops over the CPU kernels: the same C functions the ctypes library exports,
// compiled from the same sources (topk.cpp) into a library built against the installed
// TensorFlow (setup.py: tf.sysconfig's compile and link flags) and loaded with
// tf.load_op_library (kernels/cpu/tf_ops.py). An op runs inside TensorFlow's own executor, eager
// or in a graph, on TensorFlow's buffers: nothing is copied out of the framework.
//
// HvdSparseTopkAbs(x, k) -> indices: the k entries of largest magnitude of x (flattened) as
// ascending int32/int64 indices, with the tie rule of Backend.topk_abs_indices (topk.cpp).
// HvdSparseSegmentSumsq(x, lengths) -> (sums, depths): the float64 sums of squares of consecutive
// segments of x (flattened) and each sum's rounding depth (norms.cpp: DEFT's per-unit norms).

#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

extern "C" {
int hvd_sparse_topk_abs_f32_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f32_i64(const void* x, int64_t n, int64_t k, int64_t* out);
int hvd_sparse_topk_abs_f64_i32(const void* x, int64_t n, int64_t k, int32_t* out);
int hvd_sparse_topk_abs_f64_i64(const void* x, int64_t n, int64_t k, int64_t* out);
int64_t hvd_sparse_segment_sumsq_depth(int64_t length);
int hvd_sparse_segment_sumsq_f32(const float* x, const int64_t* lengths, int64_t count, double* sums);
int hvd_sparse_segment_sumsq_f64(const double* x, const int64_t* lengths, int64_t count, double* sums);
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

int segment_sumsq(const float* x, const int64_t* lengths, int64_t count, double* sums) {
  return hvd_sparse_segment_sumsq_f32(x, lengths, count, sums);
}
int segment_sumsq(const double* x, const int64_t* lengths, int64_t count, double* sums) {
  return hvd_sparse_segment_sumsq_f64(x, lengths, count, sums);
}

template <typename T>
class SegmentSumsqOp : public OpKernel {
 public:
  explicit SegmentSumsqOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& lengths_tensor = context->input(1);
    OP_REQUIRES(context, tensorflow::TensorShapeUtils::IsVector(lengths_tensor.shape()),
                tensorflow::errors::InvalidArgument("lengths must be a vector"));
    const int64_t count = lengths_tensor.NumElements();
    const int64_t* lengths = lengths_tensor.flat<int64_t>().data();
    int64_t total = 0;
    for (int64_t s = 0; s < count; ++s) {
      OP_REQUIRES(context, lengths[s] >= 0,
                  tensorflow::errors::InvalidArgument("segment ", s, " has a negative length"));
      total += lengths[s];
    }
    OP_REQUIRES(context, total == x.NumElements(),
                tensorflow::errors::InvalidArgument("the lengths add up to ", total, ", not to the ",
                                                    x.NumElements(), " entries of x"));
    Tensor* sums = nullptr;
    Tensor* depths = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({count}), &sums));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({count}), &depths));
    OP_REQUIRES(context, segment_sumsq(x.flat<T>().data(), lengths, count, sums->flat<double>().data()) == 0,
                tensorflow::errors::InvalidArgument("segment sums kernel refused its arguments"));
    auto depth = depths->flat<int64_t>();
    for (int64_t s = 0; s < count; ++s) depth(s) = hvd_sparse_segment_sumsq_depth(lengths[s]);
  }
};

}  // namespace

REGISTER_OP("HvdSparseSegmentSumsq")
    .Input("x: T")
    .Input("lengths: int64")
    .Output("sums: double")
    .Output("depths: int64")
    .Attr("T: {float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->Dim(c->input(1), 0)));
      c->set_output(1, c->Vector(c->Dim(c->input(1), 0)));
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HvdSparseSegmentSumsq").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        SegmentSumsqOp<float>);
REGISTER_KERNEL_BUILDER(Name("HvdSparseSegmentSumsq").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        SegmentSumsqOp<double>);

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
