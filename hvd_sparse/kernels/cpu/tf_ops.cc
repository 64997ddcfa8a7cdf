// TensorFlow custom ops over the CPU kernels: the same C functions the ctypes library exports,
// compiled from the same sources (topk.cpp) into a library built against the installed
// TensorFlow (setup.py: tf.sysconfig's compile and link flags) and loaded with
// tf.load_op_library (hvd_sparse/kernels/cpu/tf_ops.py). An op runs inside TensorFlow's own executor, eager
// or in a graph, on TensorFlow's buffers: nothing is copied out of the framework.
//
// HvdSparseTopkAbs(x, k) -> indices: the k entries of largest magnitude of x (flattened) as
// ascending int32/int64 indices, with the tie rule of Backend.topk_abs_indices (topk.cpp).
// HvdSparseTopkAbsSegments(x, segments) -> indices: the same selection in each of several
// segments of x (flattened), given as (start, size, k) triples, each segment's indices ascending
// and offset by its start, concatenated in the order given (DEFT's per-unit top-k: one op call
// where one call per unit cost more in TensorFlow's eager dispatch than the selection).
// HvdSparseSegmentSumsq(x, lengths) -> (sums, depths): the float64 sums of squares of consecutive
// segments of x (flattened) and each sum's rounding depth (norms.cpp: DEFT's per-unit norms).
// HvdSparseAccumulateSelect(residual, velocity, inputs, ...) -> (accumulated, velocity, indices,
// counts, finite): error feedback's accumulation of the inputs (optionally through the momentum
// correction's velocity) and the threshold selection in one pass (accumulate.cpp).
// HvdSparseSelectAtLeast(x, bounds, threshold, probes) -> (indices, counts): that selection alone,
// on a vector already accumulated, read once (DGC's threshold passes, hard threshold).
// HvdSparseSampledThresholdSelect(x, plan, band) -> (indices, thresholds): DGC's selection in one
// call (sampled.cpp), in each segment of x: the threshold from a strided sample, its adaptation
// passes, the exact top-k of an over-full selection.
// HvdSparseSetAt(x, idx, values) -> x with x[idx] = values (zeros when values is empty).
// HvdSparseScatterSplit(idx, values) -> parts: the dense vector with values at idx (duplicates
// summed in order, from zeros, as tf.scatter_nd sums them) cut into pieces of the given sizes,
// each written once: no dense vector of the whole bucket. A piece of 64 KB or more comes from
// Recycler, a cache of such buffers freed by earlier steps (below).
//
// The last two update their first inputs in place when in_place is set: the outputs are those
// inputs, written. TensorFlow's tensors are otherwise immutable, and a new tensor the size of a
// model every step costs its page faults (a fresh allocation that large is mapped anew on every
// call), which on a virtual machine took longer than the arithmetic. The caller sets in_place
// only for a tensor it owns: one these ops or the backend made, which nothing else reads
// (hvd_sparse/backends/tf_backend.py); without it they write a copy.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <type_traits>
#include <vector>

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
int hvd_sparse_all_finite(const void* data, int64_t n, int dtype);
int64_t hvd_sparse_accumulate_select(void* residual, int residual_dtype, const void* const* inputs,
                                     const int* dtypes, const int64_t* sizes, int num_inputs,
                                     int clear, int64_t lo, int64_t hi, double threshold, void* out,
                                     int index_bits, const double* probes, int num_probes,
                                     int64_t row_len, int64_t every, int64_t sample_end,
                                     int64_t* counts);
int64_t hvd_sparse_momentum_accumulate_select(void* residual, int residual_dtype, const void* const* inputs,
                                              const int* dtypes, const int64_t* sizes, int num_inputs,
                                              int clear, void* momentum, double factor, int nesterov,
                                              int check, int64_t lo, int64_t hi, double threshold, void* out,
                                              int index_bits, const double* probes, int num_probes,
                                              int64_t row_len, int64_t every, int64_t sample_end,
                                              int64_t* counts);
int64_t hvd_sparse_select_at_least(const void* x, int dtype, int64_t lo, int64_t hi, double threshold,
                                   void* out, int index_bits, const double* probes, int num_probes,
                                   int64_t row_len, int64_t every, int64_t sample_end, int64_t* counts);
int64_t hvd_sparse_sampled_threshold_select(const void* x, int dtype, int64_t n, const int64_t* plan,
                                            int64_t segments, double upper, double lower, int resample,
                                            void* room, int index_bits, double* thresholds);
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

// The k of largest magnitude of n entries at data into out (topk.cpp), or the op's error.
template <typename T, typename I>
void SelectTopk(OpKernelContext* context, const T* data, int64_t n, int64_t k, I* out) {
  const int status = TopkFunction<T, I>::call(data, n, k, out);
  OP_REQUIRES(context, status != -2,
              tensorflow::errors::ResourceExhausted("top-k kernel: out of memory selecting ", k,
                                                    " of ", n, " entries"));
  OP_REQUIRES(context, status == 0,
              tensorflow::errors::InvalidArgument("top-k kernel refused its arguments, status ",
                                                  status));
}

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
    SelectTopk<T, I>(context, x.flat<T>().data(), n, k, out->flat<I>().data());
  }
};

template <typename T, typename I>
class TopkAbsSegmentsOp : public OpKernel {
 public:
  explicit TopkAbsSegmentsOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& segments = context->input(1);
    OP_REQUIRES(context, segments.dims() == 1 && segments.NumElements() % 3 == 0,
                tensorflow::errors::InvalidArgument("segments must be a vector of (start, size, k) "
                                                    "triples"));
    const int64_t n = x.NumElements();
    const int64_t count = segments.NumElements() / 3;
    const int64_t* triple = segments.flat<int64_t>().data();
    int64_t total = 0;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t start = triple[3 * s], size = triple[3 * s + 1], k = triple[3 * s + 2];
      OP_REQUIRES(context, 0 <= start && 0 <= size && size <= n - start && 0 <= k && k <= size,
                  tensorflow::errors::InvalidArgument("segment ", s, " (start ", start, ", size ",
                                                      size, ", k ", k, ") outside [0, ", n, "]"));
      total += k;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &out));
    I* written = out->flat<I>().data();
    const T* data = x.flat<T>().data();
    for (int64_t s = 0; s < count; ++s) {
      const int64_t start = triple[3 * s], size = triple[3 * s + 1], k = triple[3 * s + 2];
      SelectTopk<T, I>(context, data + start, size, k, written);
      if (!context->status().ok()) return;
      for (int64_t i = 0; i < k; ++i) written[i] += static_cast<I>(start);
      written += k;
    }
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

// The memory of large outputs, kept when TensorFlow frees them and handed out again for the same
// size. glibc maps large allocations afresh (all from 32 MB; from 128 KB until a freed one raises
// its threshold) and returns memory at the heap's top when enough is free, so a buffer allocated
// every step may take a page fault per 4 KB on its first write, every step: on this project's
// virtual machines 67 ms for 100 MB against 4.4 ms to write it again. Dense Horovod pays that for
// its own outputs too; a sparse step need not. At most kCacheBytes stay cached (beyond, freed as
// usual); the cache lives as long as the process, like TensorFlow's own BFC allocator's pool.
class Recycler : public tensorflow::Allocator {
 public:
  static constexpr size_t kLarge = size_t(64) << 10;
  static constexpr size_t kCacheBytes = size_t(2) << 30;

  std::string Name() override { return "hvd_sparse_recycler"; }

  void* AllocateRaw(size_t alignment, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    void* p = nullptr;
    auto cached = free_.find(bytes);
    if (cached != free_.end()) {
      p = cached->second;
      free_.erase(cached);
      cached_bytes_ -= bytes;
    } else if (posix_memalign(&p, std::max<size_t>(alignment, 64), bytes) != 0) {
      return nullptr;
    }
    sizes_[p] = bytes;
    return p;
  }

  void DeallocateRaw(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    const size_t bytes = it->second;
    sizes_.erase(it);
    if (cached_bytes_ + bytes <= kCacheBytes) {
      free_.emplace(bytes, p);
      cached_bytes_ += bytes;
    } else {
      std::free(p);
    }
  }

  static Recycler* get() {
    static Recycler* instance = new Recycler();   // never destroyed: tensors may outlive statics
    return instance;
  }

 private:
  std::mutex mu_;
  std::unordered_multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> sizes_;
  size_t cached_bytes_ = 0;
};

// Output `index` of `elements` entries of T: from Recycler when it is large.
template <typename T>
tensorflow::Status large_or_usual_output(OpKernelContext* context, int index, int64_t elements, Tensor** out) {
  if (sizeof(T) * size_t(elements) < Recycler::kLarge) {
    return context->allocate_output(index, TensorShape({elements}), out);
  }
  Tensor recycled(Recycler::get(), tensorflow::DataTypeToEnum<T>::value, TensorShape({elements}));
  if (!recycled.IsInitialized()) return tensorflow::errors::ResourceExhausted("no memory for an output");
  context->set_output(index, recycled);
  *out = context->mutable_output(index);
  return tensorflow::OkStatus();
}

// accumulate.cpp's dtype codes; -1 for a type it has no kernel for.
int dtype_code(tensorflow::DataType type) {
  switch (type) {
    case tensorflow::DT_HALF: return 0;
    case tensorflow::DT_BFLOAT16: return 1;
    case tensorflow::DT_FLOAT: return 2;
    case tensorflow::DT_DOUBLE: return 3;
    default: return -1;
  }
}

// The tensor an in-place op writes: input `index` itself with in_place, else a copy of it as a
// new output. Either way it becomes output `index`; nullptr after a failed allocation.
Tensor* writable(OpKernelContext* context, int index, bool in_place) {
  const Tensor& input = context->input(index);
  if (in_place) {
    context->set_output(index, input);
    return context->mutable_output(index);
  }
  Tensor* out = nullptr;
  if (!context->allocate_output(index, input.shape(), &out).ok()) return nullptr;
  std::memcpy(const_cast<char*>(out->tensor_data().data()), input.tensor_data().data(),
              input.tensor_data().size());
  return out;
}

void* data_of(const Tensor* t) { return const_cast<char*>(t->tensor_data().data()); }

// Output `index`: the first `selected` indices a selecting kernel (`what`) wrote into room, once
// its status is checked (-2: out of memory; other negatives: arguments it refused).
template <typename I>
void OutputSelected(OpKernelContext* context, int index, const char* what, int64_t selected,
                    const Tensor& room) {
  OP_REQUIRES(context, selected != -2,
              tensorflow::errors::ResourceExhausted(what, " kernel: out of memory"));
  OP_REQUIRES(context, selected >= 0,
              tensorflow::errors::InvalidArgument(what, " kernel refused its arguments, status ", selected));
  Tensor* indices = nullptr;
  OP_REQUIRES_OK(context, context->allocate_output(index, TensorShape({selected}), &indices));
  std::memcpy(data_of(indices), data_of(&room), sizeof(I) * selected);
}

// Inputs: residual (R), velocity (R; empty without the momentum correction), the inputs (Tin),
// bounds (int64: lo, hi, row_len, every, sample_end), threshold, probes and factor (double; the
// threshold and probes already rounded to R). Outputs: the accumulated residual, the velocity,
// the ascending indices in [lo, hi) with |a| >= threshold, the probes' raw counts over the
// sampled rows, and whether the inputs were finite (with check; when not, nothing is written).
template <typename R, typename I>
class AccumulateSelectOp : public OpKernel {
 public:
  explicit AccumulateSelectOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("check", &check_));
    OP_REQUIRES_OK(context, context->GetAttr("nesterov", &nesterov_));
    OP_REQUIRES_OK(context, context->GetAttr("in_place", &in_place_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& residual_in = context->input(0);
    const Tensor& velocity_in = context->input(1);
    tensorflow::OpInputList inputs;
    OP_REQUIRES_OK(context, context->input_list("inputs", &inputs));
    const Tensor *bounds_in, *threshold_in, *probes_in, *factor_in;   // after the list: by name
    OP_REQUIRES_OK(context, context->input("bounds", &bounds_in));
    OP_REQUIRES_OK(context, context->input("threshold", &threshold_in));
    OP_REQUIRES_OK(context, context->input("probes", &probes_in));
    OP_REQUIRES_OK(context, context->input("factor", &factor_in));
    const Tensor& bounds = *bounds_in;
    const Tensor& probes = *probes_in;
    const int64_t n = residual_in.NumElements();
    OP_REQUIRES(context, bounds.NumElements() == 5 && probes.NumElements() <= 8,
                tensorflow::errors::InvalidArgument("bounds needs 5 entries and probes at most 8"));
    const auto b = bounds.flat<int64_t>();
    const int64_t lo = b(0), hi = b(1);
    OP_REQUIRES(context, 0 <= lo && lo <= hi && hi <= n,
                tensorflow::errors::InvalidArgument("[", lo, ", ", hi, ") outside the residual's ", n));
    const bool momentum = velocity_in.NumElements() > 0;
    OP_REQUIRES(context, !momentum || velocity_in.NumElements() == n,
                tensorflow::errors::InvalidArgument("the velocity must be as long as the residual"));
    std::vector<const void*> pointers;
    std::vector<int> dtypes;
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (const Tensor& t : inputs) {
      pointers.push_back(t.tensor_data().data());
      dtypes.push_back(dtype_code(t.dtype()));
      sizes.push_back(t.NumElements());
      total += t.NumElements();
    }
    OP_REQUIRES(context, total == n,
                tensorflow::errors::InvalidArgument("the inputs hold ", total, " entries, the residual ", n));
    const int count = static_cast<int>(pointers.size());
    if (check_) {   // before anything is written or any output set
      for (int k = 0; k < count; ++k) {
        if (hvd_sparse_all_finite(pointers[k], sizes[k], dtypes[k]) != 1) return NotFinite(context, probes);
      }
    }
    Tensor* residual = writable(context, 0, in_place_);
    Tensor* velocity = writable(context, 1, in_place_);
    OP_REQUIRES(context, residual != nullptr && velocity != nullptr,
                tensorflow::errors::ResourceExhausted("no memory for the accumulated vector"));
    Tensor room;
    OP_REQUIRES_OK(context, context->allocate_temp(tensorflow::DataTypeToEnum<I>::value,
                                                   TensorShape({hi - lo}), &room));
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({probes.NumElements()}), &counts));
    const int num_probes = static_cast<int>(probes.NumElements());
    const double threshold = threshold_in->scalar<double>()();
    const int code = std::is_same<R, float>::value ? 2 : 3;
    const int bits = std::is_same<I, int32_t>::value ? 32 : 64;
    int64_t selected;
    if (momentum) {
      selected = hvd_sparse_momentum_accumulate_select(
          data_of(residual), code, pointers.data(), dtypes.data(), sizes.data(), count, 0,
          data_of(velocity), factor_in->scalar<double>()(), nesterov_, 0, lo, hi,
          threshold, data_of(&room), bits, probes.flat<double>().data(), num_probes, b(2), b(3), b(4),
          counts->flat<int64_t>().data());
    } else {
      selected = hvd_sparse_accumulate_select(
          data_of(residual), code, pointers.data(), dtypes.data(), sizes.data(), count, 0, lo, hi,
          threshold, data_of(&room), bits, probes.flat<double>().data(), num_probes, b(2), b(3), b(4),
          counts->flat<int64_t>().data());
    }
    OutputSelected<I>(context, 2, "accumulate", selected, room);
    if (!context->status().ok()) return;
    Tensor* finite = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(4, TensorShape({}), &finite));
    finite->scalar<bool>()() = true;
  }

 private:
  // Nothing written: the residual and the velocity as they came, no indices, zero counts.
  void NotFinite(OpKernelContext* context, const Tensor& probes) {
    context->set_output(0, context->input(0));
    context->set_output(1, context->input(1));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({0}), &out));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({probes.NumElements()}), &out));
    for (int64_t p = 0; p < probes.NumElements(); ++p) out->flat<int64_t>()(p) = 0;
    OP_REQUIRES_OK(context, context->allocate_output(4, TensorShape({}), &out));
    out->scalar<bool>()() = false;
  }

  bool check_ = false, nesterov_ = false, in_place_ = false;
};

// Inputs: x (R, read flat), bounds (int64: lo, hi, row_len, every, sample_end), threshold and
// probes (double, already rounded to R). Outputs: the ascending indices in [lo, hi) with
// |x| >= threshold and the probes' raw counts over the sampled rows. Nothing is written.
template <typename R, typename I>
class SelectAtLeastOp : public OpKernel {
 public:
  explicit SelectAtLeastOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& bounds = context->input(1);
    const Tensor& probes = context->input(3);
    OP_REQUIRES(context, bounds.NumElements() == 5 && probes.NumElements() <= 8,
                tensorflow::errors::InvalidArgument("bounds needs 5 entries and probes at most 8"));
    const auto b = bounds.flat<int64_t>();
    const int64_t lo = b(0), hi = b(1);
    OP_REQUIRES(context, 0 <= lo && lo <= hi && hi <= x.NumElements(),
                tensorflow::errors::InvalidArgument("[", lo, ", ", hi, ") outside x's ", x.NumElements()));
    Tensor room;
    OP_REQUIRES_OK(context, context->allocate_temp(tensorflow::DataTypeToEnum<I>::value,
                                                   TensorShape({hi - lo}), &room));
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({probes.NumElements()}), &counts));
    const int64_t selected = hvd_sparse_select_at_least(
        x.tensor_data().data(), std::is_same<R, float>::value ? 2 : 3, lo, hi,
        context->input(2).scalar<double>()(), data_of(&room), std::is_same<I, int32_t>::value ? 32 : 64,
        probes.flat<double>().data(), static_cast<int>(probes.NumElements()), b(2), b(3), b(4),
        counts->flat<int64_t>().data());
    OutputSelected<I>(context, 0, "select", selected, room);
  }
};

// DGC's selection (sampled.cpp): plan = 7 int64 per segment (offset, size, k, start, stride,
// top, iterations), band = (upper, lower); a threshold per segment.
template <typename R, typename I>
class SampledThresholdSelectOp : public OpKernel {
 public:
  explicit SampledThresholdSelectOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("resample", &resample_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& plan = context->input(1);
    const Tensor& band = context->input(2);
    OP_REQUIRES(context, plan.NumElements() % 7 == 0 && band.NumElements() == 2,
                tensorflow::errors::InvalidArgument("plan needs 7 entries per segment and band 2"));
    const auto b = band.flat<double>();
    const int64_t segments = plan.NumElements() / 7;
    Tensor room;
    OP_REQUIRES_OK(context, context->allocate_temp(tensorflow::DataTypeToEnum<I>::value,
                                                   TensorShape({x.NumElements()}), &room));
    Tensor* thresholds = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({segments}), &thresholds));
    const int64_t selected = hvd_sparse_sampled_threshold_select(
        x.tensor_data().data(), std::is_same<R, float>::value ? 2 : 3, x.NumElements(),
        plan.flat<int64_t>().data(), segments, b(0), b(1), resample_ ? 1 : 0, data_of(&room),
        std::is_same<I, int32_t>::value ? 32 : 64, thresholds->flat<double>().data());
    OutputSelected<I>(context, 0, "sampled threshold", selected, room);
  }

 private:
  bool resample_ = false;
};

// x with x[idx[j]] = values[j] (zero for every j when values is empty), in place with in_place.
template <typename T, typename I>
class SetAtOp : public OpKernel {
 public:
  explicit SetAtOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("in_place", &in_place_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const auto idx = context->input(1).flat<I>();
    const Tensor& values = context->input(2);
    const int64_t n = x.NumElements(), k = idx.size();
    OP_REQUIRES(context, values.NumElements() == 0 || values.NumElements() == k,
                tensorflow::errors::InvalidArgument("values must be empty or one per index"));
    for (int64_t j = 0; j < k; ++j) {
      OP_REQUIRES(context, 0 <= idx(j) && idx(j) < n,
                  tensorflow::errors::InvalidArgument("index ", idx(j), " outside [0, ", n, ")"));
    }
    Tensor* out = writable(context, 0, in_place_);
    OP_REQUIRES(context, out != nullptr, tensorflow::errors::ResourceExhausted("no memory for a copy"));
    T* y = static_cast<T*>(data_of(out));
    if (values.NumElements() == 0) {
      for (int64_t j = 0; j < k; ++j) y[idx(j)] = T(0);
    } else {
      const auto v = values.flat<T>();
      for (int64_t j = 0; j < k; ++j) y[idx(j)] = v(j);
    }
  }

 private:
  bool in_place_ = false;
};

template <typename T, typename I>
class ScatterSplitOp : public OpKernel {
 public:
  explicit ScatterSplitOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("sizes", &sizes_));
  }

  void Compute(OpKernelContext* context) override {
    const auto idx = context->input(0).flat<I>();
    const auto values = context->input(1).flat<T>();
    OP_REQUIRES(context, idx.size() == values.size(),
                tensorflow::errors::InvalidArgument("one value per index needed"));
    std::vector<int64_t> starts{0};
    std::vector<T*> pieces;
    for (size_t p = 0; p < sizes_.size(); ++p) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(context, large_or_usual_output<T>(context, static_cast<int>(p), sizes_[p], &out));
      std::memset(data_of(out), 0, sizeof(T) * sizes_[p]);
      pieces.push_back(static_cast<T*>(data_of(out)));
      starts.push_back(starts.back() + sizes_[p]);
    }
    for (int64_t j = 0; j < idx.size(); ++j) {
      const int64_t at = idx(j);
      OP_REQUIRES(context, 0 <= at && at < starts.back(),
                  tensorflow::errors::InvalidArgument("index ", at, " outside [0, ", starts.back(), ")"));
      const size_t p = std::upper_bound(starts.begin(), starts.end(), at) - starts.begin() - 1;
      pieces[p][at - starts[p]] += values(j);
    }
  }

 private:
  std::vector<int64_t> sizes_;
};

}  // namespace

// Registers KERNEL<value type, index type> for an op whose value attr (T or R) is fp32 or fp64
// and whose Tidx is int32 or int64: the four kernels every selecting op has.
#define HVD_SPARSE_REGISTER_ONE(OP, ATTR, KERNEL, V, I)                                           \
  REGISTER_KERNEL_BUILDER(                                                                       \
      Name(OP).Device(DEVICE_CPU).TypeConstraint<V>(ATTR).TypeConstraint<I>("Tidx"), KERNEL<V, I>)
#define HVD_SPARSE_REGISTER_BY_TYPES(OP, ATTR, KERNEL)         \
  HVD_SPARSE_REGISTER_ONE(OP, ATTR, KERNEL, float, int32_t);   \
  HVD_SPARSE_REGISTER_ONE(OP, ATTR, KERNEL, float, int64_t);   \
  HVD_SPARSE_REGISTER_ONE(OP, ATTR, KERNEL, double, int32_t);  \
  HVD_SPARSE_REGISTER_ONE(OP, ATTR, KERNEL, double, int64_t)

// The shape of a selecting op's outputs: vectors whose length the data decides.
tensorflow::Status VectorsOfUnknownLength(tensorflow::shape_inference::InferenceContext* c) {
  for (int p = 0; p < c->num_outputs(); ++p) c->set_output(p, c->Vector(c->UnknownDim()));
  return tensorflow::OkStatus();
}

REGISTER_OP("HvdSparseScatterSplit")
    .Input("idx: Tidx")
    .Input("values: T")
    .Output("parts: N * T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64}")
    .Attr("N: int >= 1")
    .Attr("sizes: list(int)")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      std::vector<int64_t> sizes;
      TF_RETURN_IF_ERROR(c->GetAttr("sizes", &sizes));
      for (int p = 0; p < c->num_outputs(); ++p) c->set_output(p, c->Vector(sizes[p]));
      return tensorflow::OkStatus();
    });

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseScatterSplit", "T", ScatterSplitOp);

REGISTER_OP("HvdSparseAccumulateSelect")
    .Input("residual: R")
    .Input("velocity: R")
    .Input("inputs: Tin")
    .Input("bounds: int64")
    .Input("threshold: double")
    .Input("probes: double")
    .Input("factor: double")
    .Output("accumulated: R")
    .Output("velocity_out: R")
    .Output("indices: Tidx")
    .Output("counts: int64")
    .Output("finite: bool")
    .Attr("R: {float, double}")
    .Attr("Tin: list({half, bfloat16, float, double})")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("check: bool = false")
    .Attr("nesterov: bool = false")
    .Attr("in_place: bool = false")
    .SetIsStateful()   // it may write its inputs: never folded, merged or pruned
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Scalar());
      return tensorflow::OkStatus();
    });

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseAccumulateSelect", "R", AccumulateSelectOp);

REGISTER_OP("HvdSparseSelectAtLeast")
    .Input("x: R")
    .Input("bounds: int64")
    .Input("threshold: double")
    .Input("probes: double")
    .Output("indices: Tidx")
    .Output("counts: int64")
    .Attr("R: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .SetShapeFn(VectorsOfUnknownLength);

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseSelectAtLeast", "R", SelectAtLeastOp);

REGISTER_OP("HvdSparseSampledThresholdSelect")
    .Input("x: R")
    .Input("plan: int64")
    .Input("band: double")
    .Output("indices: Tidx")
    .Output("thresholds: double")
    .Attr("R: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("resample: bool")
    .SetShapeFn(VectorsOfUnknownLength);

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseSampledThresholdSelect", "R", SampledThresholdSelectOp);

REGISTER_OP("HvdSparseSetAt")
    .Input("x: T")
    .Input("idx: Tidx")
    .Input("values: T")
    .Output("y: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64}")
    .Attr("in_place: bool = false")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return tensorflow::OkStatus();
    });

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseSetAt", "T", SetAtOp);

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
    .SetShapeFn(VectorsOfUnknownLength);

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseTopkAbs", "T", TopkAbsOp);

REGISTER_OP("HvdSparseTopkAbsSegments")
    .Input("x: T")
    .Input("segments: int64")
    .Output("indices: Tidx")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .SetShapeFn(VectorsOfUnknownLength);

HVD_SPARSE_REGISTER_BY_TYPES("HvdSparseTopkAbsSegments", "T", TopkAbsSegmentsOp);
