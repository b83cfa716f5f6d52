// AVX2 + FMA + F16C path: 8 floats per vector. The last partial vector is copied into zeroed
// stack buffers, updated there by the same vector code and copied back, so the tail gives the
// same bits as the body without a second (scalar) implementation in this file.
#include <immintrin.h>

#include <type_traits>

#include "adam.h"
#include "select.h"

namespace infinity::adam {
namespace {

constexpr size_t kWidth = 8;

template <DType G>
__m256 load_grad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even on the upper 16 bits, every NaN to 0xFFFF (torch's vectorized bits).
__m128i float_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(is_nan));
  // Every lane is in [0, 0xFFFF], so the unsigned-saturating pack keeps it as is.
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Non-temporal when `stream` (16-byte aligned): see [Note: memory traffic] in adam.h.
template <DType H>
void store_half(void* out, size_t i, __m256 x, bool stream) {
  if constexpr (H != DType::kNone) {
    __m128i h;
    if constexpr (H == DType::kBF16) {
      h = float_to_bf16(x);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if (stream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
}

// Asks for the lines kPrefetchBytes ahead of element i in every input stream.
template <DType G>
void prefetch_ahead(const Buffers& b, size_t i) {
  constexpr size_t ahead = kPrefetchBytes / sizeof(float);
  constexpr size_t grad_size = G == DType::kF32 ? 4 : 2;
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i + ahead), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.grad) + (i + ahead) * grad_size, _MM_HINT_T0);
}

template <typename T>
void copy_elements(T* dst, const T* src, size_t n) {
  for (size_t k = 0; k < n; ++k) dst[k] = src[k];
}

template <DType G, DType H, bool L2>
struct Avx2Loop {
  using GradT = std::conditional_t<G == DType::kF32, float, uint16_t>;

  // One vector of the update ([Note: exact parity with torch] in adam.h).
  static inline __attribute__((always_inline)) void body(const StepConstants& c, const Buffers& b,
                                                         size_t i, bool stream) {
    __m256 g = _mm256_mul_ps(load_grad<G>(b.grad, i), _mm256_set1_ps(c.grad_scale));
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(b.param + i), _mm256_set1_ps(c.decay));
    if constexpr (L2) g = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), p, g);
    __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    const __m256 diff = _mm256_sub_ps(g, m);
    m = c.lerp_small ? _mm256_fmadd_ps(_mm256_set1_ps(c.lerp_w), diff, m)
                     : _mm256_fmadd_ps(_mm256_set1_ps(c.lerp_w_minus_1), diff, g);
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), _mm256_set1_ps(c.beta2));
    v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), g), g, v);
    const __m256 denom = _mm256_add_ps(
        _mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step), m), denom));
    _mm256_storeu_ps(b.param + i, p);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    store_half<H>(b.half_out, i, p, stream);
  }

  // Fewer than kWidth elements at `i`: zeroed lanes run through the same code (0 / eps, no
  // fault) and are not copied back.
  static void tail(const StepConstants& c, const Buffers& b, size_t i, size_t n) {
    alignas(32) float p[kWidth] = {}, m[kWidth] = {}, v[kWidth] = {};
    alignas(32) GradT g[kWidth] = {};
    alignas(32) uint16_t h[kWidth] = {};
    copy_elements(p, b.param + i, n);
    copy_elements(m, b.exp_avg + i, n);
    copy_elements(v, b.exp_avg_sq + i, n);
    copy_elements(g, static_cast<const GradT*>(b.grad) + i, n);
    const Buffers local{p, g, m, v, h, b.grad_dtype, b.half_dtype};
    body(c, local, 0, false);
    copy_elements(b.param + i, p, n);
    copy_elements(b.exp_avg + i, m, n);
    copy_elements(b.exp_avg_sq + i, v, n);
    if constexpr (H != DType::kNone) copy_elements(static_cast<uint16_t*>(b.half_out) + i, h, n);
  }

  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    size_t i = begin;
    bool stream = false;
    if constexpr (H != DType::kNone) {
      // Elements up to the half copy's next 16-byte boundary go first, so that the rest can
      // use streaming stores whatever the offset the caller started at.
      const auto address =
          reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(b.half_out) + i);
      const size_t lead = address % 2 ? 0 : (16 - address % 16) % 16 / 2;
      if (address % 2 == 0 && lead < end - i) {
        if (lead > 0) tail(c, b, i, lead);
        i += lead;
        stream = true;
      }
    }
    // Two vectors a turn: one prefetch per 64-byte line of each fp32 stream.
    for (; i + 2 * kWidth <= end; i += 2 * kWidth) {
      prefetch_ahead<G>(b, i);
      body(c, b, i, stream);
      body(c, b, i + kWidth, stream);
    }
    for (; i + kWidth <= end; i += kWidth) body(c, b, i, stream);
    if (i < end) tail(c, b, i, end - i);
    if (stream) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

}  // namespace

void update_avx2(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<Avx2Loop>(b.grad_dtype, b.half_dtype, c.use_l2)(c, b, begin, end);
}

void stream_avx2(const Buffers& b, size_t begin, size_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  size_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    prefetch_ahead<DType::kF32>(b, i);
    const __m256 g = _mm256_loadu_ps(grad + i);
    const __m256 p = _mm256_loadu_ps(b.param + i);
    const __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    const __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
    _mm256_storeu_ps(b.param + i, _mm256_add_ps(p, g));
    _mm256_storeu_ps(b.exp_avg + i, _mm256_add_ps(m, g));
    _mm256_storeu_ps(b.exp_avg_sq + i, _mm256_add_ps(v, g));
  }
  for (; i < end; ++i) {
    b.param[i] += grad[i];
    b.exp_avg[i] += grad[i];
    b.exp_avg_sq[i] += grad[i];
  }
}

}  // namespace infinity::adam
