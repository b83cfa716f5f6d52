// The AVX2 + F16C loads, stores and conversions every AVX2 kernel file shares (kernels_avx2.cpp,
// lamb_avx2.cpp): 8 floats per vector, 16-bit values converted exactly one way and rounded back
// as torch rounds them. Included only by files built with -mavx2 -mfma -mf16c; each gets its own
// copy (internal linkage), so nothing here is linked into the baseline path.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam.h"
#include "prefetch.h"

namespace infinity::adam {
namespace {

constexpr size_t kWidth = 8;

// Eight fp32 or 16-bit elements at `i` of `data`, as floats (bfloat16 and binary16 exactly).
template <DType T>
__m256 load_floats(const void* data, size_t i) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(data) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
    if constexpr (T == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even on the upper 16 bits, every NaN to 0xFFFF (torch's vectorized bits).
inline __m128i float_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(is_nan));
  // Every lane is in [0, 0xFFFF], so the unsigned-saturating pack keeps it as is.
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Eight floats rounded to the 16-bit type T (bfloat16 or binary16).
template <DType T>
__m128i to_half(__m256 x) {
  if constexpr (T == DType::kBF16) {
    return float_to_bf16(x);
  } else {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// Eight floats stored at `i` of `data` as T: fp32, or rounded to 16 bits (a moment kept in
// bfloat16, [Note: bf16 moments] in adam.h).
template <DType T>
void store_floats(void* data, size_t i, __m256 x) {
  if constexpr (T == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(data) + i, x);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(data) + i), to_half<T>(x));
  }
}

// The half copy of the new values (nothing when H is kNone); non-temporal when `stream`
// (16-byte aligned): see [Note: memory traffic] in adam.h.
template <DType H>
void store_half(void* out, size_t i, __m256 x, bool stream) {
  if constexpr (H != DType::kNone) {
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if (stream) {
      _mm_stream_si128(dst, to_half<H>(x));
    } else {
      _mm_storeu_si128(dst, to_half<H>(x));
    }
  }
}

template <typename T>
void copy_elements(T* dst, const T* src, size_t n) {
  for (size_t k = 0; k < n; ++k) dst[k] = src[k];
}

}  // namespace
}  // namespace infinity::adam
