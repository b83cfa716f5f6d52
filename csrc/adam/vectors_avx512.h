// The AVX-512 (F, BW, VL, DQ) loads, stores and conversions every AVX-512 kernel file shares
// (kernels_avx512.cpp, lamb_avx512.cpp): 16 floats per vector, tails through masked loads and
// stores. bfloat16 is rounded with integer instructions, not vcvtneps2bf16: that instruction
// flushes denormal inputs to zero and writes a different NaN than torch, and the update must
// match torch's conversion bit for bit (four integer instructions per 16 elements, well under
// the memory time). Included only by files built with the AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam.h"
#include "prefetch.h"

namespace infinity::adam {
namespace {

// The fp32 or 16-bit elements at `i` of `data` that `mask` selects, as floats (bfloat16 and
// binary16 exactly); the others read as zero.
template <DType T>
__m512 load_floats(const void* data, size_t i, __mmask16 mask) {
  if constexpr (T == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + i);
    if constexpr (T == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round to nearest even on the upper 16 bits, every NaN to 0xFFFF (torch's vectorized bits).
inline __m256i float_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 is_number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  const __m512i h = _mm512_mask_blend_epi32(is_number, _mm512_set1_epi32(0xFFFF), rounded);
  return _mm512_cvtepi32_epi16(h);
}

// Sixteen floats rounded to the 16-bit type T (bfloat16 or binary16).
template <DType T>
__m256i to_half(__m512 x) {
  if constexpr (T == DType::kBF16) {
    return float_to_bf16(x);
  } else {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// The lanes of `mask` stored at `i` of `data` as T: fp32, or rounded to 16 bits (a moment kept
// in bfloat16, [Note: bf16 moments] in adam.h).
template <DType T>
void store_floats(void* data, size_t i, __m512 x, __mmask16 mask) {
  if constexpr (T == DType::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(data) + i, mask, x);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(data) + i, mask, to_half<T>(x));
  }
}

// The half copy of the new values (nothing when H is kNone); non-temporal when `stream` (the
// whole vector is written, 32-byte aligned): the pass never reads it back, so fetching its
// lines first would only waste bandwidth ([Note: memory traffic] in adam.h).
template <DType H>
void store_half(void* out, size_t i, __m512 x, __mmask16 mask, bool stream) {
  if constexpr (H != DType::kNone) {
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), to_half<H>(x));
    } else {
      _mm256_mask_storeu_epi16(dst, mask, to_half<H>(x));
    }
  }
}

}  // namespace
}  // namespace infinity::adam
