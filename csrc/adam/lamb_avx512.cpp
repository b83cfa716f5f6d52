// AVX-512 (F, BW, VL, DQ) path of LAMB's two passes: 16 floats per vector, tails through masked
// loads and stores ([Note: LAMB arithmetic] and [Note: LAMB's sums] in lamb.h). The 16-bit
// conversions are kernels_avx512.cpp's (vectors_avx512.h: integer rounding to bfloat16, for
// torch's bits).
#include <immintrin.h>

#include "lamb.h"
#include "vectors_avx512.h"

namespace infinity::adam {
namespace {

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
    const size_t ahead = prefetch_ahead();
    for (size_t chunk = begin; chunk < end; chunk += kLambChunk, ++out) {
      const size_t chunk_end = end - chunk < kLambChunk ? end : chunk + kLambChunk;
      Lanes w, u;
      for (size_t i = chunk; i < chunk_end; i += 16) {
        prefetch_streams<G, M, true, true>(b, i, ahead);
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
    store_half<H>(b.half_out, i, p_new, mask, stream);
  }

  static void apply(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
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
      prefetch_streams<G, M, true, true>(b, i, ahead);
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
