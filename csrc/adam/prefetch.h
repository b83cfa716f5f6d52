// Software prefetch of the streams an update reads, shared by the SIMD paths (vectors_avx2.h,
// vectors_avx512.h). Only SSE's prefetch instruction, part of every x86-64.
#pragma once

#include <xmmintrin.h>

#include <cstddef>

#include "adam.h"

namespace infinity::adam {
namespace {

constexpr size_t size_of(DType t) { return t == DType::kF32 ? 4 : 2; }

// Asks for the lines kPrefetchBytes ahead of element i in the master, the gradient and the
// moments a rule reads (`exp_avg`, `exp_avg_sq`).
template <DType G, DType M, bool exp_avg, bool exp_avg_sq>
void prefetch_streams(const Buffers& b, size_t i) {
  constexpr size_t ahead = kPrefetchBytes / sizeof(float);
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
