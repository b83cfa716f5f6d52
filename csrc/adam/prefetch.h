// Software prefetch of the streams an update reads, shared by the SIMD paths (vectors_avx2.h,
// vectors_avx512.h). Only SSE's prefetch instruction, part of every x86-64.
#pragma once

#include <xmmintrin.h>

#include <cstddef>

#include "adam.h"

namespace infinity::adam {
namespace {

constexpr size_t size_of(DType t) { return t == DType::kF32 ? 4 : 2; }

// The prefetch distance of a kernel call, in elements (prefetch_bytes() of an fp32 stream).
inline size_t prefetch_ahead() { return prefetch_bytes() / sizeof(float); }

// Asks for the lines `ahead` elements past element i in the master, the gradient and the
// moments a rule reads (`exp_avg`, `exp_avg_sq`); nothing when `ahead` is 0.
//
// [Note: prefetches are always inlined]
// GCC counts a prefetch as free of side effects: a prefetching function it leaves out of line
// is taken for a pure one, and its calls, returning nothing, are dropped as dead code. With the
// distance a run-time value GCC 12 stopped inlining these at -O3 and no prefetch was left in the
// module, so both are forced inline.
template <DType G, DType M, bool exp_avg, bool exp_avg_sq>
inline __attribute__((always_inline)) void prefetch_streams(const Buffers& b, size_t i,
                                                            size_t ahead) {
  if (ahead == 0) return;
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i + ahead), _MM_HINT_T0);
  if constexpr (exp_avg) {
    _mm_prefetch(static_cast<const char*>(b.exp_avg) + (i + ahead) * size_of(M), _MM_HINT_T0);
  }
  if constexpr (exp_avg_sq) {
    _mm_prefetch(static_cast<const char*>(b.exp_avg_sq) + (i + ahead) * size_of(M), _MM_HINT_T0);
  }
  _mm_prefetch(static_cast<const char*>(b.grad) + (i + ahead) * size_of(G), _MM_HINT_T0);
}

}  // namespace
}  // namespace infinity::adam
