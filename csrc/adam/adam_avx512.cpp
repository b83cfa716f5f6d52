// AVX-512 (F, BW, VL, DQ) path: 16 floats per vector, tails through masked loads and stores.
//
// bfloat16 output uses integer rounding, not vcvtneps2bf16: that instruction flushes denormal
// inputs to zero and writes a different NaN than torch, and the update must match torch's
// conversion bit for bit. The integer form costs four integer instructions per 16 elements, well
// under the memory time.
#include <immintrin.h>

#include "adam.h"
#include "select.h"

namespace infinity::adam {
namespace {

template <DType G>
__m512 load_grad(const void* grad, size_t i, __mmask16 mask) {
  if constexpr (G == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round to nearest even on the upper 16 bits, every NaN to 0xFFFF (torch's vectorized bits).
__m256i float_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 is_number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  const __m512i h = _mm512_mask_blend_epi32(is_number, _mm512_set1_epi32(0xFFFF), rounded);
  return _mm512_cvtepi32_epi16(h);
}

// Non-temporal when `stream` (the whole vector is written, 32-byte aligned): the half copy is
// never read back by this pass, so fetching its lines first would only waste bandwidth
// ([Note: memory traffic] in adam.h).
template <DType H>
void store_half(void* out, size_t i, __m512 x, __mmask16 mask, bool stream) {
  if constexpr (H != DType::kNone) {
    __m256i h;
    if constexpr (H == DType::kBF16) {
      h = float_to_bf16(x);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
    } else {
      _mm256_mask_storeu_epi16(dst, mask, h);
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

template <DType G, DType H, bool L2>
struct Avx512Loop {
  // One vector of the update ([Note: exact parity with torch] in adam.h). Masked-off lanes read
  // zeros, which flow through without faults (0 / eps) and are never stored.
  static inline __attribute__((always_inline)) void body(const StepConstants& c, const Buffers& b,
                                                         size_t i, __mmask16 mask, bool stream) {
    __m512 g = _mm512_mul_ps(load_grad<G>(b.grad, i, mask), _mm512_set1_ps(c.grad_scale));
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, b.param + i), _mm512_set1_ps(c.decay));
    if constexpr (L2) g = _mm512_fmadd_ps(_mm512_set1_ps(c.l2), p, g);
    __m512 m = _mm512_maskz_loadu_ps(mask, b.exp_avg + i);
    const __m512 diff = _mm512_sub_ps(g, m);
    m = c.lerp_small ? _mm512_fmadd_ps(_mm512_set1_ps(c.lerp_w), diff, m)
                     : _mm512_fmadd_ps(_mm512_set1_ps(c.lerp_w_minus_1), diff, g);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, b.exp_avg_sq + i),
                             _mm512_set1_ps(c.beta2));
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g, v);
    const __m512 denom = _mm512_add_ps(
        _mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bc2_sqrt)), _mm512_set1_ps(c.eps));
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step), m), denom));
    _mm512_mask_storeu_ps(b.param + i, mask, p);
    _mm512_mask_storeu_ps(b.exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(b.exp_avg_sq + i, mask, v);
    store_half<H>(b.half_out, i, p, mask, stream);
  }

  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    size_t i = begin;
    bool stream = false;
    if constexpr (H != DType::kNone) {
      // Elements up to the half copy's next 32-byte boundary go first, so that the rest can
      // use streaming stores whatever the offset the caller started at.
      const auto address =
          reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(b.half_out) + i);
      const size_t lead = address % 2 ? 0 : (32 - address % 32) % 32 / 2;
      if (address % 2 == 0 && lead < end - i) {
        if (lead > 0) body(c, b, i, static_cast<__mmask16>((1u << lead) - 1u), false);
        i += lead;
        stream = true;
      }
    }
    for (; i + 16 <= end; i += 16) {
      prefetch_ahead<G>(b, i);
      body(c, b, i, 0xFFFF, stream);
    }
    if (i < end) body(c, b, i, static_cast<__mmask16>((1u << (end - i)) - 1u), false);
    if (stream) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

}  // namespace

void update_avx512(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<Avx512Loop>(b.grad_dtype, b.half_dtype, c.use_l2)(c, b, begin, end);
}

namespace {

inline __attribute__((always_inline)) void stream_vector(const Buffers& b, size_t i,
                                                         __mmask16 mask) {
  const __m512 g = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(b.grad) + i);
  const __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
  const __m512 m = _mm512_maskz_loadu_ps(mask, b.exp_avg + i);
  const __m512 v = _mm512_maskz_loadu_ps(mask, b.exp_avg_sq + i);
  _mm512_mask_storeu_ps(b.param + i, mask, _mm512_add_ps(p, g));
  _mm512_mask_storeu_ps(b.exp_avg + i, mask, _mm512_add_ps(m, g));
  _mm512_mask_storeu_ps(b.exp_avg_sq + i, mask, _mm512_add_ps(v, g));
}

}  // namespace

void stream_avx512(const Buffers& b, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    prefetch_ahead<DType::kF32>(b, i);
    stream_vector(b, i, 0xFFFF);
  }
  if (i < end) stream_vector(b, i, static_cast<__mmask16>((1u << (end - i)) - 1u));
}

}  // namespace infinity::adam
