// AVX-512 (F, BW, VL, DQ) path of LAMB's two passes: 16 floats per vector, tails through masked
// loads and stores ([Note: LAMB arithmetic] and [Note: LAMB's sums] in lamb.h). The 16-bit
// conversions are the same as kernels_avx512.cpp's (integer rounding to bfloat16, for torch's
// bits).
#include <immintrin.h>

#include "lamb.h"

namespace infinity::adam {
namespace {

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
__m256i float_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 is_number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  const __m512i h = _mm512_mask_blend_epi32(is_number, _mm512_set1_epi32(0xFFFF), rounded);
  return _mm512_cvtepi32_epi16(h);
}

__m256i to_half(__m512 x, DType t) {
  return t == DType::kBF16 ? float_to_bf16(x)
                           : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <DType T>
void store_floats(void* data, size_t i, __m512 x, __mmask16 mask) {
  if constexpr (T == DType::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(data) + i, mask, x);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(data) + i, mask, to_half(x, T));
  }
}

constexpr size_t size_of(DType t) { return t == DType::kF32 ? 4 : 2; }

template <DType G, DType M>
void prefetch_ahead(const Buffers& b, size_t i) {
  constexpr size_t ahead = kPrefetchBytes / sizeof(float);
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i + ahead), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.exp_avg) + (i + ahead) * size_of(M), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.exp_avg_sq) + (i + ahead) * size_of(M), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.grad) + (i + ahead) * size_of(G), _MM_HINT_T0);
}

struct Direction {
  __m512 m, v, u;
};

// [Note: LAMB arithmetic] for the lanes of `mask` (the others read zeros, flow through without
// faults, and are never stored or summed).
template <DType G, DType M>
Direction direction(const LambConstants& c, const Buffers& b, size_t i, __mmask16 mask,
                    __m512 p) {
  const __m512 g = _mm512_mul_ps(load_floats<G>(b.grad, i, mask), _mm512_set1_ps(c.grad_scale));
  const __m512 m =
      _mm512_add_ps(_mm512_mul_ps(load_floats<M>(b.exp_avg, i, mask), _mm512_set1_ps(c.beta1)),
                    _mm512_mul_ps(g, _mm512_set1_ps(c.one_minus_beta1)));
  const __m512 v = _mm512_add_ps(
      _mm512_mul_ps(load_floats<M>(b.exp_avg_sq, i, mask), _mm512_set1_ps(c.beta2)),
      _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(c.one_minus_beta2)));
  const __m512 d = _mm512_add_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.eps));
  const __m512 u =
      _mm512_add_ps(_mm512_div_ps(m, d), _mm512_mul_ps(p, _mm512_set1_ps(c.weight_decay)));
  return {m, v, u};
}

// Lanes 0-7 (lo) and 8-15 (hi) of a chunk's 16 double accumulators ([Note: LAMB's sums]).
struct Lanes {
  __m512d lo = _mm512_setzero_pd();
  __m512d hi = _mm512_setzero_pd();

  // Adds x^2 lane by lane; the square is exact in double, so the fused add rounds as a
  // separate one would.
  void add_squares(__m512 x) {
    const __m512d x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d x_hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    lo = _mm512_fmadd_pd(x_lo, x_lo, lo);
    hi = _mm512_fmadd_pd(x_hi, x_hi, hi);
  }

  // k += k + 8, k += k + 4, k += k + 2, then lane 0 + lane 1.
  double sum() const {
    const __m512d s8 = _mm512_add_pd(lo, hi);
    const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
  }
};

__mmask16 first_lanes(size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

template <DType G, DType M, DType H>
struct Avx512Loop {
  static void norms(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                    LambSums* out) {
    for (size_t chunk = begin; chunk < end; chunk += kLambChunk, ++out) {
      const size_t chunk_end = end - chunk < kLambChunk ? end : chunk + kLambChunk;
      Lanes w, u;
      for (size_t i = chunk; i < chunk_end; i += 16) {
        prefetch_ahead<G, M>(b, i);
        const __mmask16 mask = first_lanes(chunk_end - i);
        const __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
        w.add_squares(p);
        // Lanes past the end hold 0 / eps, NaN when eps == 0: add +0 there instead.
        u.add_squares(_mm512_maskz_mov_ps(mask, direction<G, M>(c, b, i, mask, p).u));
      }
      *out = LambSums{w.sum(), u.sum()};
    }
  }

  static inline __attribute__((always_inline)) void body(const LambConstants& c, const Buffers& b,
                                                         size_t i, __mmask16 mask, bool stream) {
    const __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
    const Direction d = direction<G, M>(c, b, i, mask, p);
    const __m512 p_new = _mm512_sub_ps(p, _mm512_mul_ps(d.u, _mm512_set1_ps(c.scale)));
    _mm512_mask_storeu_ps(b.param + i, mask, p_new);
    store_floats<M>(b.exp_avg, i, d.m, mask);
    store_floats<M>(b.exp_avg_sq, i, d.v, mask);
    if constexpr (H != DType::kNone) {
      // Streaming stores for the half copy ([Note: memory traffic] in adam.h).
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.half_out) + i),
                            to_half(p_new, H));
      } else {
        store_floats<H>(b.half_out, i, p_new, mask);
      }
    }
  }

  static void apply(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
    size_t i = begin;
    bool stream = false;
    if constexpr (H != DType::kNone) {
      // Up to the half copy's next 32-byte boundary first, then whole aligned vectors.
      const auto address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.half_out) + i);
      const size_t lead = address % 2 ? 0 : (32 - address % 32) % 32 / 2;
      if (address % 2 == 0 && lead < end - i) {
        if (lead > 0) body(c, b, i, first_lanes(lead), false);
        i += lead;
        stream = true;
      }
    }
    for (; i + 16 <= end; i += 16) {
      prefetch_ahead<G, M>(b, i);
      body(c, b, i, 0xFFFF, stream);
    }
    if (i < end) body(c, b, i, first_lanes(end - i), false);
    if (stream) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

}  // namespace

void lamb_norms_avx512(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                       LambSums* out) {
  select_lamb_norms<Avx512Loop>(b)(c, b, begin, end, out);
}

void lamb_apply_avx512(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_lamb_apply<Avx512Loop>(b)(c, b, begin, end);
}

}  // namespace infinity::adam
