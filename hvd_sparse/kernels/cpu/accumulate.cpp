// Error-feedback accumulation and the fused accumulate-and-select of the threshold methods.
//
// Semantics are those of the torch reference path, bit for bit:
//   residual[i] = residual[i] + x[i]: x converted exactly to the wider of the two float types,
//   one IEEE add there, rounded to the residual's type (torch's in-place add with a promoted
//   input); the selection |a_i| >= T in the residual's type (T already rounded to it by the
//   caller, as NumPy and torch compare an array with a Python float); NaN never passes.
// One thread; plain loops over fixed-size chunks that the compiler vectorizes. Build flags keep
// floating point strict (no -ffast-math, no FMA contraction), so results match the reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "sums.h"

namespace {

enum Dtype : int { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };

constexpr int64_t CHUNK = 1024;      // elements accumulated before they are scanned (L1-resident)
constexpr int64_t GROUP = 64;        // elements counted at once before a scalar scan for indices
constexpr int MAX_PROBES = 8;
constexpr int CHECK_AND_CLEAR = 2;   // hvd_sparse_accumulate_select's clear: check the inputs too
constexpr int64_t LINE = 64;        // bytes per cache line

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE half -> float, exact for every value (normal, subnormal, zero, Inf, NaN with its payload),
// branch-free so that it vectorizes.
inline float half_to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
    const uint32_t exp = shifted_exp & o;
    o += (127u - 15u) << 23;
    const uint32_t inf_nan = o + ((128u - 16u) << 23);
    const float sub = bits_float(o + (1u << 23)) - bits_float(113u << 23);
    uint32_t result = exp == shifted_exp ? inf_nan : o;
    result = exp == 0 ? float_bits(sub) : result;
    return bits_float(result | ((uint32_t(h) & 0x8000u) << 16));
}

inline float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

struct Half { uint16_t bits; };
struct BFloat { uint16_t bits; };

inline float widen(Half x) { return half_to_float(x.bits); }
inline float widen(BFloat x) { return bf16_to_float(x.bits); }
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }

// The type the add is computed in: the residual's, or double for a double input into a float
// residual (torch promotes, adds, and rounds on the store).
template <typename R, typename X> struct Compute { using type = R; };
template <> struct Compute<float, double> { using type = double; };

template <typename R, typename X>
inline void add_chunk(R* __restrict r, X* __restrict x, int64_t n, bool clear) {
    using C = typename Compute<R, X>::type;
    for (int64_t i = 0; i < n; ++i) r[i] = R(C(r[i]) + C(widen(x[i])));
    if (clear) std::memset(static_cast<void*>(x), 0, sizeof(X) * n);
}

// The momentum correction's accumulation of one piece, with velocity u and factor m, element by
// element in the residual's type R (the reference Backend.momentum_accumulate; momentum.cpp):
//   g = 0 + x     (x converted exactly to the wider type, one add there, rounded to R: the
//                  reference accumulates the inputs into zeros, which turns -0 into +0)
//   plain:    u = u * m + g;      r = r + u
//   nesterov: u = (u + g) * m;    r = (r + u) + g
// each operation rounded to R, in that order (the build forbids contracting them into an FMA).
template <typename R, typename X>
inline void momentum_chunk(R* __restrict r, R* __restrict u, X* __restrict x, int64_t n, R m, bool nesterov,
                           bool clear) {
    using C = typename Compute<R, X>::type;
    if (nesterov) {
        for (int64_t i = 0; i < n; ++i) {
            const R g = R(C(0) + C(widen(x[i])));
            const R v = (u[i] + g) * m;
            u[i] = v;
            r[i] = (r[i] + v) + g;
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            const R g = R(C(0) + C(widen(x[i])));
            const R v = u[i] * m + g;
            u[i] = v;
            r[i] = r[i] + v;
        }
    }
    if (clear) std::memset(static_cast<void*>(x), 0, sizeof(X) * n);
}

// The Adam path's accumulation of one piece (the reference Backend.adam_step): Adam's moments u
// and v of the rank's own gradient run parallel to the residual; element by element in R,
//   g = 0 + x                        (as momentum_chunk's)
//   u = u * b1 + g * gain1           (gain1 = 1 - b1, rounded to R by the caller)
//   v = v * b2 + (g * g) * gain2     (gain2 = 1 - b2; Frozen: v shared by the ranks, only read)
//   r = r + clamp((u * c1) / (sqrt(v * c2) + eps), -bound, bound)   (NaN passes the clamp)
// each operation rounded to R in that order (adam.cpp's update, clamped).
template <bool Frozen, typename R, typename X>
inline void adam_chunk(R* __restrict r, R* __restrict u, R* __restrict v, X* __restrict x, int64_t n,
                       const R* k, bool clear) {
    using C = typename Compute<R, X>::type;
    const R b1 = k[0], gain1 = k[1], b2 = k[2], gain2 = k[3], c1 = k[4], c2 = k[5], eps = k[6], bound = k[7];
    for (int64_t i = 0; i < n; ++i) {
        const R g = R(C(0) + C(widen(x[i])));
        const R m = u[i] * b1 + g * gain1;
        u[i] = m;
        R w = v[i];
        if (!Frozen) {
            w = w * b2 + (g * g) * gain2;
            v[i] = w;
        }
        R step = (m * c1) / (std::sqrt(w * c2) + eps);
        step = step > bound ? bound : (step < -bound ? -bound : step);
        r[i] = r[i] + step;
    }
    if (clear) std::memset(static_cast<void*>(x), 0, sizeof(X) * n);
}

// What a pass adds into a piece of the residual: the input (PlainAdd), or the input through the
// momentum correction's velocity (MomentumAdd, whose u runs parallel to the residual), or through
// the Adam path's moments (AdamAdd).
struct PlainAdd {
    template <typename R, typename X>
    void operator()(R* r, X* x, int64_t, int64_t n, bool clear) const { add_chunk(r, x, n, clear); }
};

template <typename R>
struct MomentumAdd {
    R* u = nullptr;
    R m = 0;
    bool nesterov = false;
    template <typename X>
    void operator()(R* r, X* x, int64_t at, int64_t n, bool clear) const {
        momentum_chunk(r, u + at, x, n, m, nesterov, clear);
    }
};

template <typename R>
struct AdamAdd {
    R* u = nullptr;
    R* v = nullptr;
    R k[8] = {};   // b1, 1 - b1, b2, 1 - b2, c1, c2, eps, bound
    bool frozen = false;   // v shared by the ranks: read, never written
    template <typename X>
    void operator()(R* r, X* x, int64_t at, int64_t n, bool clear) const {
        if (frozen)
            adam_chunk<true>(r, u + at, v + at, x, n, k, clear);
        else
            adam_chunk<false>(r, u + at, v + at, x, n, k, clear);
    }
};

// The bits of a float type, and its exponent mask (all ones: Inf or NaN).
template <typename R> struct Bits;
template <> struct Bits<float> { using type = uint32_t; static constexpr uint32_t exponent = 0x7f800000u; };
template <> struct Bits<double> { using type = uint64_t; static constexpr uint64_t exponent = 0x7ff0000000000000ull; };

// add_chunk for an input of the residual's own type, which keeps the residual's old value in the
// input (a copy to restore it from) and checks the input in the same loop: false when an entry of
// x is NaN or Inf. The add is the same IEEE add as add_chunk's.
template <typename R>
inline bool add_keep_chunk(R* __restrict r, R* __restrict x, int64_t n) {
    using U = typename Bits<R>::type;
    U bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        const R value = x[i];
        U bits;
        std::memcpy(&bits, &value, sizeof bits);
        bad |= U(0) - U((bits & Bits<R>::exponent) == Bits<R>::exponent);
        const R old = r[i];
        r[i] = old + value;
        x[i] = old;
    }
    return bad == 0;
}

// Zeroes n bytes with streaming stores where the CPU has them: a large buffer goes to memory
// without being read first or displacing the cache (twice as fast as memset on 100 MB here,
// whose own streaming threshold scales with the last-level cache).
void stream_zero(void* data, int64_t bytes) {
    char* p = static_cast<char*>(data);
#if defined(__SSE2__)
    if (bytes >= (int64_t(1) << 20)) {
        const int64_t head = (16 - int64_t(reinterpret_cast<uintptr_t>(p) & 15)) & 15;
        std::memset(p, 0, size_t(head));
        p += head;
        bytes -= head;
        const __m128i zero = _mm_setzero_si128();
        const int64_t body = bytes & ~int64_t(15);
        for (int64_t i = 0; i < body; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(p + i), zero);
        _mm_sfence();
        p += body;
        bytes -= body;
    }
#endif
    if (bytes > 0) std::memset(p, 0, size_t(bytes));
}

// Indices i (absolute: base + offset in the chunk) with |r[i]| >= t, appended to out.
template <typename R, typename I>
inline int64_t select_chunk(const R* __restrict r, int64_t n, R t, int64_t base, I* __restrict out) {
    int64_t m = 0;
    for (int64_t g = 0; g < n; g += GROUP) {
        const int64_t end = g + GROUP < n ? g + GROUP : n;
        int hits = 0;
        for (int64_t i = g; i < end; ++i) hits += std::fabs(r[i]) >= t;
        if (hits == 0) continue;
        // Branch-free compaction (every index is written, the count advances on a pass): as fast
        // at a dense selection as at a sparse one.
        for (int64_t i = g; i < end; ++i) {
            out[m] = I(base + i);
            m += std::fabs(r[i]) >= t;
        }
    }
    return m;
}

template <typename R>
inline void count_chunk(const R* __restrict r, int64_t n, const R* probes, int num_probes,
                        int64_t* counts) {
    // A counter as wide as R, so that the compare's mask adds lane by lane (n <= CHUNK).
    using Count = std::conditional_t<sizeof(R) == 4, int32_t, int64_t>;
    for (int p = 0; p < num_probes; ++p) {
        const R t = probes[p];
        Count c = 0;
        for (int64_t i = 0; i < n; ++i) c += Count(std::fabs(r[i]) >= t);
        counts[p] += c;
    }
}

// What the caller asks of the own range [lo, hi); lo == hi: plain accumulation. A piece visitor
// (see accumulate_segment): piece_end() says where a piece starting at `at` must end, visit()
// receives each piece of the accumulated vector.
template <typename R, typename I>
struct Selection {
    int64_t lo = 0, hi = 0;
    R threshold = 0;
    I* out = nullptr;
    int64_t selected = 0;
    // Probe counts over sampled rows: row r of length row_len, r = 0, every, 2*every, ... below
    // sample_end (relative to lo); row_len == 0 counts the whole range.
    int num_probes = 0;
    R probes[MAX_PROBES] = {};
    int64_t counts[MAX_PROBES] = {};
    int64_t row_len = 0, every = 1, sample_end = 0;

    // Whether [a, b) (relative to lo, inside one row) is sampled, and where that row ends.
    bool sampled(int64_t a, int64_t* row_end) const {
        if (row_len == 0) { *row_end = hi - lo; return true; }
        if (a >= sample_end) { *row_end = hi - lo; return false; }
        const int64_t row = a / row_len;
        *row_end = (row + 1) * row_len;
        return row % every == 0;
    }

    int64_t piece_end(int64_t at) const {
        if (at < lo) return lo;
        if (at >= hi) return INT64_MAX;
        int64_t row_end = hi - lo;
        if (num_probes > 0) sampled(at - lo, &row_end);
        return std::min<int64_t>(lo + row_end, hi);
    }

    void visit(const R* r, int64_t at, int64_t len) {
        if (at < lo || at >= hi) return;
        selected += select_chunk(r, len, threshold, at, out + selected);
        int64_t row_end;
        if (num_probes > 0 && sampled(at - lo, &row_end)) count_chunk(r, len, probes, num_probes, counts);
    }
};

// Gaussian-k's moments of the whole accumulated vector (sums.h).
struct Moments {
    hvd_sparse::MomentSums sums;
    int64_t piece_end(int64_t) const { return INT64_MAX; }
    template <typename R>
    void visit(const R* r, int64_t, int64_t len) { sums.add(r, len); }
};

// Sums S (sums.h) of each of consecutive segments of the accumulated vector: DEFT's sums of
// squares (SquareSums), Gaussian-k's moments of each tensor of a packed bucket (MomentSums).
template <typename S>
struct Segments {
    const int64_t* lengths = nullptr;
    int64_t count = 0;                      // segments (at least one)
    S* sums = nullptr;
    int64_t segment = 0, segment_end = 0;   // the segment of the last piece, and where it ends

    int64_t piece_end(int64_t at) {
        while (segment_end <= at && segment + 1 < count) segment_end += lengths[++segment];
        return segment_end;
    }
    template <typename R>
    void visit(const R* r, int64_t, int64_t len) { sums[segment].add(r, len); }
};

// One pass over one input tensor occupying [offset, offset + n) of the residual, in pieces of at
// most CHUNK entries (L1-resident when the visitor reads them) that end where the visitor asks.
template <typename R, typename X, typename V, typename A>
void accumulate_segment(R* residual, X* x, int64_t offset, int64_t n, bool clear, V& visitor, const A& add) {
    int64_t i = 0;
    while (i < n) {
        const int64_t at = offset + i;
        const int64_t end = std::min<int64_t>(std::min<int64_t>(n, i + CHUNK), visitor.piece_end(at) - offset);
        const int64_t len = end - i;
        add(residual + at, x + i, at, len, clear);
        visitor.visit(residual + at, at, len);
        i = end;
    }
}

// accumulate_all for inputs of the residual's type with the finite check in the same pass
// (add_keep_chunk): on success the inputs are zeroed (stream_zero) and true comes back; at the
// first piece holding NaN/Inf the residual gets back every old value the inputs kept, the
// visitor sees no more pieces, and false comes back (the inputs then hold a mix of old residual
// and gradient values: the caller overwrites them).
template <typename R, typename V>
bool accumulate_kept(void* residual, const void* const* inputs, const int64_t* sizes, int num_inputs,
                     V& visitor) {
    R* r = static_cast<R*>(residual);
    int64_t offset = 0;
    for (int k = 0; k < num_inputs; ++k) {
        R* x = static_cast<R*>(const_cast<void*>(inputs[k]));
        for (int64_t i = 0; i < sizes[k];) {
            const int64_t at = offset + i;
            const int64_t end = std::min<int64_t>(std::min<int64_t>(sizes[k], i + CHUNK), visitor.piece_end(at) - offset);
            if (!add_keep_chunk(r + at, x + i, end - i)) {
                int64_t back = 0;
                for (int j = 0; j <= k; ++j) {
                    const int64_t kept = j < k ? sizes[j] : end;
                    std::memcpy(r + back, inputs[j], sizeof(R) * size_t(kept));
                    back += sizes[j];
                }
                return false;
            }
            visitor.visit(r + at, at, end - i);
            i = end;
        }
        offset += sizes[k];
    }
    for (int k = 0; k < num_inputs; ++k) stream_zero(const_cast<void*>(inputs[k]), int64_t(sizeof(R)) * sizes[k]);
    return true;
}

template <typename R, typename V, typename A = PlainAdd>
void accumulate_all(void* residual, const void* const* inputs, const int* dtypes, const int64_t* sizes,
                    int num_inputs, bool clear, V& visitor, const A& add = A{}) {
    R* r = static_cast<R*>(residual);
    int64_t offset = 0;
    for (int k = 0; k < num_inputs; ++k) {
        void* x = const_cast<void*>(inputs[k]);
        switch (dtypes[k]) {
            case F16: accumulate_segment(r, static_cast<Half*>(x), offset, sizes[k], clear, visitor, add); break;
            case BF16: accumulate_segment(r, static_cast<BFloat*>(x), offset, sizes[k], clear, visitor, add); break;
            case F32: accumulate_segment(r, static_cast<float*>(x), offset, sizes[k], clear, visitor, add); break;
            default: accumulate_segment(r, static_cast<double*>(x), offset, sizes[k], clear, visitor, add); break;
        }
        offset += sizes[k];
    }
}

template <typename R, typename I>
Selection<R, I> selection(int64_t lo, int64_t hi, double threshold, void* out, const double* probes,
                          int num_probes, int64_t row_len, int64_t every, int64_t sample_end) {
    Selection<R, I> s;
    s.lo = lo; s.hi = hi; s.threshold = R(threshold); s.out = static_cast<I*>(out);
    s.num_probes = num_probes;
    for (int p = 0; p < num_probes; ++p) s.probes[p] = R(probes[p]);
    s.row_len = row_len; s.every = every; s.sample_end = sample_end;
    return s;
}

// clear: 0 keep the inputs, 1 zero them, 2 check and zero them (accumulate_kept; every input of
// the residual's dtype): -2 when an input holds NaN/Inf (the residual as it was).
template <typename R, typename I>
int64_t run(void* residual, const void* const* inputs, const int* dtypes, const int64_t* sizes,
            int num_inputs, int clear, int64_t lo, int64_t hi, double threshold, void* out,
            const double* probes, int num_probes, int64_t row_len, int64_t every, int64_t sample_end,
            int64_t* counts) {
    auto s = selection<R, I>(lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end);
    if (clear == CHECK_AND_CLEAR) {
        const int own = std::is_same<R, float>::value ? F32 : F64;
        for (int k = 0; k < num_inputs; ++k)
            if (dtypes[k] != own) return -1;
        if (!accumulate_kept<R>(residual, inputs, sizes, num_inputs, s)) return -2;
    } else {
        accumulate_all<R>(residual, inputs, dtypes, sizes, num_inputs, clear != 0, s);
    }
    for (int p = 0; p < num_probes; ++p) counts[p] = s.counts[p];
    return s.selected;
}

// The selection of run() over a vector that is already accumulated: one read of [lo, hi).
template <typename R, typename I>
int64_t select_only(const void* x, int64_t lo, int64_t hi, double threshold, void* out,
                    const double* probes, int num_probes, int64_t row_len, int64_t every,
                    int64_t sample_end, int64_t* counts) {
    auto s = selection<R, I>(lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end);
    const R* r = static_cast<const R*>(x);
    for (int64_t at = lo; at < hi;) {
        const int64_t end = std::min<int64_t>(at + CHUNK, s.piece_end(at));
        s.visit(r + at, at, end - at);
        at = end;
    }
    for (int p = 0; p < num_probes; ++p) counts[p] = s.counts[p];
    return s.selected;
}

bool valid_inputs(const int* dtypes, int num_inputs) {
    for (int k = 0; k < num_inputs; ++k)
        if (dtypes[k] < F16 || dtypes[k] > F64) return false;
    return true;
}

template <typename X>
bool finite(const X* x, int64_t n, X mask) {
    // A float is finite unless its exponent bits are all set. One core's read-only scan is
    // latency-bound: a single stream, even prefetched, reads up to a fifth slower than four (each
    // step reads four lines from each quarter of the vector), which keep more misses in flight.
    constexpr int STREAMS = 4;
    constexpr int64_t STEP = 4 * LINE / int64_t(sizeof(X));
    const int64_t part = n / (STREAMS * STEP) * STEP;
    X bad = 0;
    for (int64_t i = 0; i < part; i += STEP) {
        for (int s = 0; s < STREAMS; ++s) {
            const X* y = x + s * part + i;
            for (int64_t j = 0; j < STEP; ++j) bad |= X(X(0) - X((y[j] & mask) == mask));
        }
        if (bad && (i / STEP) % 64 == 63) return false;   // now and then: stop early
    }
    for (int64_t j = STREAMS * part; j < n; ++j) bad |= X(X(0) - X((x[j] & mask) == mask));
    return bad == 0;
}

// Whether no entry of the n values at data (dtype code) is NaN or Inf; -1 for an unknown dtype.
int all_finite(const void* data, int64_t n, int dtype) {
    switch (dtype) {
        case F16: return finite(static_cast<const uint16_t*>(data), n, uint16_t(0x7c00u));
        case BF16: return finite(static_cast<const uint16_t*>(data), n, uint16_t(0x7f80u));
        case F32: return finite(static_cast<const uint32_t*>(data), n, uint32_t(0x7f800000u));
        case F64: return finite(static_cast<const uint64_t*>(data), n, uint64_t(0x7ff0000000000000ull));
        default: return -1;
    }
}

// run() with the momentum correction (MomentumAdd): one pass reads u, the input and the residual
// and writes u and the residual (and zeroes the input with clear), selecting as run() does. With
// check, the inputs are read first (all_finite): -2 when one holds NaN/Inf, before anything is
// written. That read is the price of leaving u and the residual untouched exactly: undoing the
// pass instead would need the old u and the old residual of every entry already written, 64 bits
// an entry of which the input's slot holds 32 (see docs/kernels.md).
template <typename R, typename I>
int64_t run_momentum(void* residual, const void* const* inputs, const int* dtypes, const int64_t* sizes,
                     int num_inputs, bool clear, void* momentum, double factor, bool nesterov, bool check,
                     int64_t lo, int64_t hi, double threshold, void* out, const double* probes,
                     int num_probes, int64_t row_len, int64_t every, int64_t sample_end, int64_t* counts) {
    if (check)
        for (int k = 0; k < num_inputs; ++k)
            if (!all_finite(inputs[k], sizes[k], dtypes[k])) return -2;
    auto s = selection<R, I>(lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end);
    MomentumAdd<R> add;
    add.u = static_cast<R*>(momentum);
    add.m = R(factor);
    add.nesterov = nesterov;
    accumulate_all<R>(residual, inputs, dtypes, sizes, num_inputs, clear, s, add);
    for (int p = 0; p < num_probes; ++p) counts[p] = s.counts[p];
    return s.selected;
}

// run_momentum with the Adam path's accumulation (AdamAdd): one pass reads u, v, the input and the
// residual and writes u, v and the residual. constants: b1, 1 - b1, b2, 1 - b2, c1, c2, eps, bound
// (doubles, rounded to R here as the reference rounds the Python floats it multiplies and clamps by),
// and 1 where v is frozen (shared by the ranks: read, not written).
template <typename R, typename I>
int64_t run_adam(void* residual, const void* const* inputs, const int* dtypes, const int64_t* sizes,
                 int num_inputs, bool clear, void* momentum, void* second, const double* constants,
                 bool check, int64_t lo, int64_t hi, double threshold, void* out, const double* probes,
                 int num_probes, int64_t row_len, int64_t every, int64_t sample_end, int64_t* counts) {
    if (check)
        for (int k = 0; k < num_inputs; ++k)
            if (!all_finite(inputs[k], sizes[k], dtypes[k])) return -2;
    auto s = selection<R, I>(lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end);
    AdamAdd<R> add;
    add.u = static_cast<R*>(momentum);
    add.v = static_cast<R*>(second);
    for (int j = 0; j < 8; ++j) add.k[j] = R(constants[j]);
    add.frozen = constants[8] != 0.0;
    accumulate_all<R>(residual, inputs, dtypes, sizes, num_inputs, clear, s, add);
    for (int p = 0; p < num_probes; ++p) counts[p] = s.counts[p];
    return s.selected;
}

}  // namespace

// residual += the inputs, feeding each of the count consecutive segments of the result (lengths)
// to its own sums S. 0, or -1 for an unsupported dtype or lengths that do not add up to the inputs.
template <typename S>
int accumulate_segments(void* residual, int residual_dtype, const void* const* inputs, const int* dtypes,
                        const int64_t* sizes, int num_inputs, int clear, const int64_t* lengths, int64_t count,
                        S* sums) {
    if (!valid_inputs(dtypes, num_inputs) || count < 1) return -1;
    int64_t total = 0, covered = 0;
    for (int k = 0; k < num_inputs; ++k) total += sizes[k];
    for (int64_t s = 0; s < count; ++s) {
        if (lengths[s] < 0) return -1;
        covered += lengths[s];
    }
    if (covered != total) return -1;   // a piece must never run past the last segment
    Segments<S> v;
    v.lengths = lengths; v.count = count; v.sums = sums; v.segment_end = lengths[0];
    if (residual_dtype == F32) accumulate_all<float>(residual, inputs, dtypes, sizes, num_inputs, clear != 0, v);
    else if (residual_dtype == F64) accumulate_all<double>(residual, inputs, dtypes, sizes, num_inputs, clear != 0, v);
    else return -1;
    return 0;
}

extern "C" {

// 1 when no entry of the n values at data (dtype code) is NaN or Inf.
int hvd_sparse_all_finite(const void* data, int64_t n, int dtype) { return all_finite(data, n, dtype); }

// Zero n bytes at data (stream_zero): about twice as fast as torch's fill on tens of megabytes,
// which reads each line before writing it.
void hvd_sparse_clear(void* data, int64_t bytes) {
    if (bytes > 0) stream_zero(data, bytes);
}

// residual (residual_dtype F32 or F64, contiguous) += the inputs in order (each contiguous, of
// dtypes[k] and sizes[k] elements), zeroing each input when clear != 0. Inside [lo, hi) writes
// the indices with |a| >= threshold to out (index_bits 32 or 64; room for hi - lo) and returns
// their count; counts[p] = entries of the sampled rows with |a| >= probes[p]. clear == 2 also
// checks the inputs in the same pass (every one of the residual's dtype, else -1): when one
// holds NaN or Inf the residual is left as it was, the inputs' contents are unspecified, and -2
// comes back. Returns -1 for an unsupported dtype.
int64_t hvd_sparse_accumulate_select(void* residual, int residual_dtype, const void* const* inputs,
                                     const int* dtypes, const int64_t* sizes, int num_inputs,
                                     int clear, int64_t lo, int64_t hi, double threshold, void* out,
                                     int index_bits, const double* probes, int num_probes,
                                     int64_t row_len, int64_t every, int64_t sample_end,
                                     int64_t* counts) {
    if (num_probes > MAX_PROBES || num_probes < 0 || !valid_inputs(dtypes, num_inputs)) return -1;
    // One instantiation per (residual type, index type).
    auto go = [&](auto residual_tag, auto index_tag) {
        return run<decltype(residual_tag), decltype(index_tag)>(
            residual, inputs, dtypes, sizes, num_inputs, clear, lo, hi, threshold, out, probes,
            num_probes, row_len, every, sample_end, counts);
    };
    const bool wide = index_bits == 64;
    if (residual_dtype == F32) return wide ? go(float{}, int64_t{}) : go(float{}, int32_t{});
    if (residual_dtype == F64) return wide ? go(double{}, int64_t{}) : go(double{}, int32_t{});
    return -1;
}

// hvd_sparse_accumulate_select with the momentum correction: the inputs enter the residual through
// the velocity momentum (residual_dtype, contiguous, as long as the residual; updated in place)
// with factor and form nesterov (see momentum_chunk), in the same one pass that selects in [lo,
// hi) and counts at the probes. clear: 0 keep the inputs, 1 zero them. check != 0: the inputs are
// checked first; when one holds NaN/Inf nothing is written (residual, momentum and inputs as they
// were) and -2 comes back. Returns the count, or -1 for unsupported arguments.
int64_t hvd_sparse_momentum_accumulate_select(void* residual, int residual_dtype, const void* const* inputs,
                                              const int* dtypes, const int64_t* sizes, int num_inputs,
                                              int clear, void* momentum, double factor, int nesterov,
                                              int check, int64_t lo, int64_t hi, double threshold, void* out,
                                              int index_bits, const double* probes, int num_probes,
                                              int64_t row_len, int64_t every, int64_t sample_end,
                                              int64_t* counts) {
    if (num_probes > MAX_PROBES || num_probes < 0 || !valid_inputs(dtypes, num_inputs) || clear < 0 || clear > 1
        || momentum == nullptr)
        return -1;
    auto go = [&](auto residual_tag, auto index_tag) {
        return run_momentum<decltype(residual_tag), decltype(index_tag)>(
            residual, inputs, dtypes, sizes, num_inputs, clear != 0, momentum, factor, nesterov != 0,
            check != 0, lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end, counts);
    };
    const bool wide = index_bits == 64;
    if (residual_dtype == F32) return wide ? go(float{}, int64_t{}) : go(float{}, int32_t{});
    if (residual_dtype == F64) return wide ? go(double{}, int64_t{}) : go(double{}, int32_t{});
    return -1;
}

// hvd_sparse_momentum_accumulate_select on the Adam path: the inputs enter Adam's moments momentum
// (u) and second (v) and the residual gains the clamped update of them (adam_chunk; both
// residual_dtype, contiguous, as long as the residual, updated in place); constants =
// {b1, 1 - b1, b2, 1 - b2, c1, c2, eps, bound, frozen}. lo == hi: the accumulation alone. Returns the count,
// -2 when check != 0 and an input holds NaN/Inf (nothing written), -1 for unsupported arguments.
int64_t hvd_sparse_adam_accumulate_select(void* residual, int residual_dtype, const void* const* inputs,
                                          const int* dtypes, const int64_t* sizes, int num_inputs, int clear,
                                          void* momentum, void* second, const double* constants,
                                          int check, int64_t lo, int64_t hi, double threshold, void* out,
                                          int index_bits, const double* probes, int num_probes,
                                          int64_t row_len, int64_t every, int64_t sample_end,
                                          int64_t* counts) {
    if (num_probes > MAX_PROBES || num_probes < 0 || !valid_inputs(dtypes, num_inputs) || clear < 0 || clear > 1
        || momentum == nullptr || second == nullptr || constants == nullptr)
        return -1;
    auto go = [&](auto residual_tag, auto index_tag) {
        return run_adam<decltype(residual_tag), decltype(index_tag)>(
            residual, inputs, dtypes, sizes, num_inputs, clear != 0, momentum, second, constants,
            check != 0, lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end, counts);
    };
    const bool wide = index_bits == 64;
    if (residual_dtype == F32) return wide ? go(float{}, int64_t{}) : go(float{}, int32_t{});
    if (residual_dtype == F64) return wide ? go(double{}, int64_t{}) : go(double{}, int32_t{});
    return -1;
}

// residual += the inputs, as hvd_sparse_accumulate_select without a selection, and in the same
// pass Gaussian-k's moments of the result: sums[0] = shift (a[0]), sums[1] = Σd, sums[2] = Σd²
// for d = a - a[0], *depth = the most roundings a term of them went through (sums.h). The
// residual must hold at least one entry. Returns 0, or -1 for an unsupported dtype.
int hvd_sparse_accumulate_moments(void* residual, int residual_dtype, const void* const* inputs,
                                  const int* dtypes, const int64_t* sizes, int num_inputs, int clear,
                                  double* sums, int64_t* depth) {
    if (!valid_inputs(dtypes, num_inputs)) return -1;
    Moments m;
    if (residual_dtype == F32) accumulate_all<float>(residual, inputs, dtypes, sizes, num_inputs, clear != 0, m);
    else if (residual_dtype == F64) accumulate_all<double>(residual, inputs, dtypes, sizes, num_inputs, clear != 0, m);
    else return -1;
    sums[0] = m.sums.shift;
    sums[1] = m.sums.sums.total(0);
    sums[2] = m.sums.sums.total(1);
    *depth = m.sums.depth();
    return 0;
}

// residual += the inputs, and in the same pass the sum of squares of each of the count
// consecutive segments of the result (lengths, adding up to the residual's size; count >= 1)
// into sums, with the most roundings a term went through into depths (sums.h). Returns 0, or -1
// for an unsupported dtype or invalid lengths.
int hvd_sparse_accumulate_norms(void* residual, int residual_dtype, const void* const* inputs,
                                const int* dtypes, const int64_t* sizes, int num_inputs, int clear,
                                const int64_t* lengths, int64_t count, double* sums, int64_t* depths) {
    if (count < 1) return -1;
    std::vector<hvd_sparse::SquareSums> squares(count);
    if (accumulate_segments(residual, residual_dtype, inputs, dtypes, sizes, num_inputs, clear, lengths, count,
                            squares.data()) != 0)
        return -1;
    for (int64_t s = 0; s < count; ++s) {
        sums[s] = squares[s].sums.total(0);
        depths[s] = squares[s].depth();
    }
    return 0;
}

// hvd_sparse_accumulate_moments for each of the count consecutive segments of the result
// (lengths, adding up to the residual's size; count >= 1): sums[3s..3s+2] = the segment's shift,
// Σd and Σd², depths[s] their roundings. An empty segment has sums 0 and depth 0. Returns 0, or
// -1 for an unsupported dtype or invalid lengths.
int hvd_sparse_accumulate_segment_moments(void* residual, int residual_dtype, const void* const* inputs,
                                          const int* dtypes, const int64_t* sizes, int num_inputs, int clear,
                                          const int64_t* lengths, int64_t count, double* sums,
                                          int64_t* depths) {
    if (count < 1) return -1;
    std::vector<hvd_sparse::MomentSums> moments(count);
    if (accumulate_segments(residual, residual_dtype, inputs, dtypes, sizes, num_inputs, clear, lengths, count,
                            moments.data()) != 0)
        return -1;
    for (int64_t s = 0; s < count; ++s) {
        sums[3 * s] = moments[s].shift;
        sums[3 * s + 1] = moments[s].sums.total(0);
        sums[3 * s + 2] = moments[s].sums.total(1);
        depths[s] = moments[s].depth();
    }
    return 0;
}

// The selection of hvd_sparse_accumulate_select on an accumulated vector x (F32 or F64,
// contiguous), read once: the indices in [lo, hi) with |x| >= threshold into out (room for
// hi - lo), their count returned, and the probe counts over the sampled rows. -1: unsupported.
int64_t hvd_sparse_select_at_least(const void* x, int dtype, int64_t lo, int64_t hi, double threshold,
                                   void* out, int index_bits, const double* probes, int num_probes,
                                   int64_t row_len, int64_t every, int64_t sample_end, int64_t* counts) {
    if (num_probes > MAX_PROBES || num_probes < 0) return -1;
    auto go = [&](auto value_tag, auto index_tag) {
        return select_only<decltype(value_tag), decltype(index_tag)>(
            x, lo, hi, threshold, out, probes, num_probes, row_len, every, sample_end, counts);
    };
    const bool wide = index_bits == 64;
    if (dtype == F32) return wide ? go(float{}, int64_t{}) : go(float{}, int32_t{});
    if (dtype == F64) return wide ? go(double{}, int64_t{}) : go(double{}, int32_t{});
    return -1;
}

}  // extern "C"
