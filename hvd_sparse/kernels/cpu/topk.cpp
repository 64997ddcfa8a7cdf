// Exact top-k by magnitude (one thread, no full-size temporaries).
//
// The rule every backend shares (hvd_sparse/backends/base.py, topk_abs_indices): magnitudes are
// ordered as |x| with -0 == +0, every NaN equal to every other NaN and above +Inf; of the entries
// tied at the k-th largest magnitude, those of the lowest indices are taken; the result is the
// ascending list of the k chosen indices.
//
// Magnitudes are compared as integer keys: the float's bits with the sign cleared, capped at the
// key just above +Inf (so every NaN gets that one key). Two ways to the k-th largest key T:
//
// * sampled bracket (k a small share of n): the keys of up to 1024 evenly spaced runs of 64
//   (fewer under 256K entries, so that the sample is at most a quarter of the input; under 16
//   runs, i.e. 4096 entries, the radix select runs) give two keys lo <= hi, taken from a heap of
//   the sample's largest keys, such that, with a wide margin, fewer than k entries lie above hi
//   and at least k at or above lo. One pass then writes the indices above hi straight into the
//   output (ascending) and keeps the few entries in [lo, hi] as candidates; T is the right
//   candidate's key (nth_element), the chosen candidates are merged into the output. The pass
//   tests 64 entries at a time with a vectorizable compare and looks at single entries only in
//   blocks that hold a candidate. If the bracket missed (too many above hi, too few above lo,
//   too many candidates) the radix select below runs instead: the result never depends on the
//   sample.
// * radix select: histograms of 11-bit digits of the key, most significant first, each counting
//   only entries whose higher digits match T's (3 passes for fp32, 6 for fp64), then one pass
//   that emits the indices with key > T and the first (lowest-index) ties with key == T.
//
// C ABI (loaded with ctypes): hvd_sparse_topk_abs_<f32|f64>_<i32|i64>(x, n, k, out) writes the k
// indices into out and returns 0, or -1 for invalid arguments, -2 when memory ran out.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <new>
#include <vector>

namespace {

template <typename U> struct KeyTraits;
template <> struct KeyTraits<uint32_t> {
  using Signed = int32_t;
  static constexpr uint32_t mask = 0x7fffffffu;
  static constexpr uint32_t nan_key = 0x7f800001u;
  static constexpr int bits = 31;
};
template <> struct KeyTraits<uint64_t> {
  using Signed = int64_t;
  static constexpr uint64_t mask = 0x7fffffffffffffffull;
  static constexpr uint64_t nan_key = 0x7ff0000000000001ull;
  static constexpr int bits = 63;
};

template <typename U>
inline U key_of(U bits) {
  U key = bits & KeyTraits<U>::mask;
  return key > KeyTraits<U>::nan_key ? KeyTraits<U>::nan_key : key;
}

constexpr int64_t kBlock = 64;          // entries tested together in the bracket pass ...
constexpr int64_t kSubBlock = 16;       // ... and again in parts where a block holds a candidate
constexpr int64_t kSampleRuns = 1024;   // runs of the sample at most, evenly spaced
constexpr int64_t kRunLength = 64;      // contiguous entries per run
constexpr int64_t kSampleShare = 4;     // a run samples at most 1/4 of its stretch
constexpr int64_t kMinRuns = 16;        // fewer runs: radix select
constexpr int kDigit = 11;

// Radix select: T (the k-th largest key) and how many entries with key == T to take.
template <typename U>
void radix_threshold(const U* x, int64_t n, int64_t k, U* threshold, int64_t* ties) {
  constexpr int total = KeyTraits<U>::bits;
  std::vector<int64_t> hist(int64_t(1) << kDigit);
  U prefix = 0;
  int known = 0;
  int64_t remaining = k;   // entries still to take at or below the prefix found so far
  while (known < total) {
    const int digit = std::min(kDigit, total - known);
    const int shift = total - known - digit;
    const U digit_mask = (U(1) << digit) - 1;
    std::fill(hist.begin(), hist.begin() + (int64_t(1) << digit), 0);
    for (int64_t i = 0; i < n; ++i) {
      const U key = key_of(x[i]);
      // key >> (shift + digit) is the part already fixed; shift + digit <= total < width of U.
      if ((key >> (shift + digit)) == prefix) ++hist[(key >> shift) & digit_mask];
    }
    int64_t bin = int64_t(digit_mask);
    for (; bin > 0; --bin) {
      if (hist[bin] >= remaining) break;
      remaining -= hist[bin];
    }
    prefix = (prefix << digit) | U(bin);
    known += digit;
  }
  *threshold = prefix;
  *ties = remaining;
}

template <typename U, typename I>
void emit_at_least(const U* x, int64_t n, U threshold, int64_t ties, I* out) {
  int64_t w = 0;
  for (int64_t i = 0; i < n; ++i) {
    const U key = key_of(x[i]);
    if (key > threshold || (key == threshold && ties-- > 0)) out[w++] = I(i);
  }
}

// The `count` largest keys of the sample, descending. A min-heap of them: the sample's keys are
// mostly far below the heap's least and cost one compare each (a selection over the whole
// sample reorders all of it, twice, for the two ranks the bracket needs).
template <typename U>
std::vector<U> largest_keys(const std::vector<U>& sample, int64_t count) {
  std::vector<U> heap(sample.begin(), sample.begin() + count);
  std::make_heap(heap.begin(), heap.end(), std::greater<U>());   // front: the least kept
  for (size_t i = size_t(count); i < sample.size(); ++i) {
    if (sample[i] <= heap.front()) continue;
    std::pop_heap(heap.begin(), heap.end(), std::greater<U>());
    heap.back() = sample[i];
    std::push_heap(heap.begin(), heap.end(), std::greater<U>());
  }
  std::sort_heap(heap.begin(), heap.end(), std::greater<U>());   // descending
  return heap;
}

// The sampled bracket (see the file's comment). Returns false when the bracket missed.
template <typename U, typename I>
bool bracket_select(const U* x, int64_t n, int64_t k, I* out) {
  using S = typename KeyTraits<U>::Signed;
  const int64_t runs = std::min(kSampleRuns, n / (kRunLength * kSampleShare));
  if (runs < kMinRuns) return false;   // too short to sample: radix
  const int64_t stride = n / runs;     // >= kRunLength * kSampleShare
  std::vector<U> sample;
  sample.reserve(runs * kRunLength);
  for (int64_t run = 0; run < runs; ++run) {
    const U* start = x + run * stride + (stride - kRunLength) / 2;
    for (int64_t j = 0; j < kRunLength; ++j) sample.push_back(key_of(start[j]));
  }
  const double s = double(sample.size());
  const double expected = double(k) * s / double(n);
  const double margin = 6.0 * std::sqrt(expected + 1.0) + 16.0;
  const int64_t lo_rank = int64_t(std::ceil(expected + margin));
  const int64_t hi_rank = int64_t(std::floor(expected - margin));
  if (lo_rank >= int64_t(sample.size()) / 32) return false;   // k too large a share: radix
  const std::vector<U> top = largest_keys(sample, lo_rank + 1);
  const U lo = top[lo_rank];
  const U hi = hi_rank >= 0 ? top[hi_rank] : KeyTraits<U>::nan_key;
  if (lo == 0) return false;   // the bracket would hold every zero
  // Candidates in [lo, hi]: up to several times what the sample predicts.
  const double predicted = double(lo_rank - std::max<int64_t>(hi_rank, 0) + 1) / s * double(n);
  const int64_t capacity = std::min<int64_t>(n, int64_t(4.0 * predicted) + 4096);
  std::vector<U> cand_key;
  std::vector<int64_t> cand_idx;
  cand_key.reserve(int64_t(1.5 * predicted) + 1024);
  cand_idx.reserve(int64_t(1.5 * predicted) + 1024);
  const S lo_signed = S(lo);
  int64_t above = 0;
  auto visit = [&](int64_t i) -> bool {
    const U key = key_of(x[i]);
    if (key < lo) return true;
    if (key > hi) {
      if (above == k) return false;
      out[above++] = I(i);
    } else {
      if (int64_t(cand_key.size()) == capacity) return false;
      cand_key.push_back(key);
      cand_idx.push_back(i);
    }
    return true;
  };
  // Raw masked keys compare like capped ones against lo (lo <= the NaN key) and, with the sign
  // cleared, like signed integers: a compare SSE2 vectorizes.
  auto any_candidate = [&](int64_t from, int64_t count) {
    S any = 0;
    for (int64_t j = 0; j < count; ++j) any |= S(S(x[from + j] & KeyTraits<U>::mask) >= lo_signed);
    return any != 0;
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (!any_candidate(i, kBlock)) continue;
    for (int64_t sub = i; sub < i + kBlock; sub += kSubBlock) {   // dense blocks: look closer
      if (!any_candidate(sub, kSubBlock)) continue;
      for (int64_t j = sub; j < sub + kSubBlock; ++j)
        if (!visit(j)) return false;
    }
  }
  for (; i < n; ++i)
    if (!visit(i)) return false;
  const int64_t count = int64_t(cand_key.size());
  if (above + count < k) return false;
  const int64_t need = k - above;
  if (need == 0) return true;
  // T: the need-th largest candidate key; every entry with key T is a candidate (lo <= T <= hi).
  std::vector<U> keys(cand_key);
  std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.end(), std::greater<U>());
  const U threshold = keys[need - 1];
  int64_t ties = need;
  for (int64_t c = 0; c < count; ++c) ties -= cand_key[c] > threshold;
  int64_t chosen = 0;   // chosen candidates, compacted in place (still ascending)
  for (int64_t c = 0; c < count; ++c)
    if (cand_key[c] > threshold || (cand_key[c] == threshold && ties-- > 0))
      cand_idx[chosen++] = cand_idx[c];
  // Merge the two ascending lists into out, from the back.
  int64_t a = above - 1, b = chosen - 1, w = k - 1;
  while (b >= 0) {
    if (a >= 0 && int64_t(out[a]) > cand_idx[b]) out[w--] = out[a--];
    else out[w--] = I(cand_idx[b--]);
  }
  return true;
}

template <typename U, typename I>
int topk_abs(const void* data, int64_t n, int64_t k, I* out) {
  if (n < 0 || k < 0 || k > n || (n > 0 && data == nullptr) || (k > 0 && out == nullptr)) return -1;
  const U* x = static_cast<const U*>(data);
  try {
    if (k == 0) return 0;
    if (k == n) {
      for (int64_t i = 0; i < n; ++i) out[i] = I(i);
      return 0;
    }
    if (bracket_select(x, n, k, out)) return 0;
    U threshold;
    int64_t ties;
    radix_threshold(x, n, k, &threshold, &ties);
    emit_at_least(x, n, threshold, ties, out);
    return 0;
  } catch (const std::bad_alloc&) {
    return -2;
  }
}

}  // namespace

extern "C" {

int hvd_sparse_topk_abs_f32_i32(const void* x, int64_t n, int64_t k, int32_t* out) {
  return topk_abs<uint32_t, int32_t>(x, n, k, out);
}
int hvd_sparse_topk_abs_f32_i64(const void* x, int64_t n, int64_t k, int64_t* out) {
  return topk_abs<uint32_t, int64_t>(x, n, k, out);
}
int hvd_sparse_topk_abs_f64_i32(const void* x, int64_t n, int64_t k, int32_t* out) {
  return topk_abs<uint64_t, int32_t>(x, n, k, out);
}
int hvd_sparse_topk_abs_f64_i64(const void* x, int64_t n, int64_t k, int64_t* out) {
  return topk_abs<uint64_t, int64_t>(x, n, k, out);
}

}  // extern "C"
