// AVX2 + FMA + F16C path of LAMB's two passes: 8 floats per vector, 16 elements (two vectors,
// the 16 lanes of [Note: LAMB's sums]) a turn ([Note: LAMB arithmetic] in lamb.h). A last turn
// of fewer than 16 elements is copied into zeroed stack buffers, run through the same code and
// copied back, so the tail gives the body's bits without a second implementation. The 16-bit
// conversions are kernels_avx2.cpp's (vectors_avx2.h).
#include <immintrin.h>

#include <type_traits>

#include "lamb.h"
#include "vectors_avx2.h"

namespace infinity::adam {
namespace {

constexpr size_t kTurn = 2 * kWidth;

struct Direction {
  __m256 m, v, u;
};

// [Note: LAMB arithmetic] for the 8 elements at i, with master values p.
template <DType G, DType M>
Direction direction(const LambConstants& c, const Buffers& b, size_t i, __m256 p) {
  const __m256 g = _mm256_mul_ps(load_floats<G>(b.grad, i), _mm256_set1_ps(c.grad_scale));
  const __m256 m =
      _mm256_add_ps(_mm256_mul_ps(load_floats<M>(b.exp_avg, i), _mm256_set1_ps(c.beta1)),
                    _mm256_mul_ps(g, _mm256_set1_ps(c.one_minus_beta1)));
  const __m256 v =
      _mm256_add_ps(_mm256_mul_ps(load_floats<M>(b.exp_avg_sq, i), _mm256_set1_ps(c.beta2)),
                    _mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(c.one_minus_beta2)));
  const __m256 d = _mm256_add_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c.eps));
  const __m256 u =
      _mm256_add_ps(_mm256_div_ps(m, d), _mm256_mul_ps(p, _mm256_set1_ps(c.weight_decay)));
  return {m, v, u};
}

// A chunk's 16 double accumulators, 4 to a register: lanes 0-3, 4-7, 8-11, 12-15.
struct Lanes {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};

  // Adds x^2 to lanes half * 8 + (0..7); exact squares, so the fused add rounds as an add.
  void add_squares(__m256 x, int half) {
    const __m256d x_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d x_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc[2 * half] = _mm256_fmadd_pd(x_lo, x_lo, acc[2 * half]);
    acc[2 * half + 1] = _mm256_fmadd_pd(x_hi, x_hi, acc[2 * half + 1]);
  }

  // k += k + 8, k += k + 4, k += k + 2, then lane 0 + lane 1 ([Note: LAMB's sums]).
  double sum() const {
    const __m256d s4 = _mm256_add_pd(_mm256_add_pd(acc[0], acc[2]), _mm256_add_pd(acc[1], acc[3]));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
  }
};

// All ones in the first n of 8 lanes, zeros after.
__m256 first_lanes(size_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index));
}

template <DType G, DType M, DType H>
struct Avx2Loop {
  using GradT = std::conditional_t<G == DType::kF32, float, uint16_t>;
  using MomentT = std::conditional_t<M == DType::kF32, float, uint16_t>;

  // The stack copy of a turn of fewer than kTurn elements at i (zeros after them), as Buffers.
  struct Tail {
    alignas(32) float p[kTurn] = {};
    alignas(32) GradT g[kTurn] = {};
    alignas(32) MomentT m[kTurn] = {}, v[kTurn] = {};
    alignas(32) uint16_t h[kTurn] = {};

    Tail(const Buffers& b, size_t i, size_t n) {
      copy_elements(p, b.param + i, n);
      copy_elements(g, static_cast<const GradT*>(b.grad) + i, n);
      copy_elements(m, static_cast<const MomentT*>(b.exp_avg) + i, n);
      copy_elements(v, static_cast<const MomentT*>(b.exp_avg_sq) + i, n);
    }
    Buffers buffers(const Buffers& b) {
      return Buffers{p, g, m, v, h, b.grad_dtype, b.half_dtype, b.moment_dtype};
    }
    void copy_back(const Buffers& b, size_t i, size_t n) const {
      copy_elements(b.param + i, p, n);
      copy_elements(static_cast<MomentT*>(b.exp_avg) + i, m, n);
      copy_elements(static_cast<MomentT*>(b.exp_avg_sq) + i, v, n);
      if constexpr (H != DType::kNone) copy_elements(static_cast<uint16_t*>(b.half_out) + i, h, n);
    }
  };

  // The squares of the kTurn elements at i, of which the first n count.
  static void add_turn(const LambConstants& c, const Buffers& b, size_t i, size_t n, Lanes& w,
                       Lanes& u) {
    for (int half = 0; half < 2; ++half) {
      const size_t at = i + half * kWidth;
      const __m256 p = _mm256_loadu_ps(b.param + at);
      w.add_squares(p, half);
      const __m256 u_vec = direction<G, M>(c, b, at, p).u;
      // Lanes past the end hold 0 / eps, NaN when eps == 0: add +0 there instead.
      const size_t valid = n > half * kWidth ? n - half * kWidth : 0;
      u.add_squares(valid >= kWidth ? u_vec : _mm256_and_ps(u_vec, first_lanes(valid)), half);
    }
  }

  static void norms(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                    LambSums* out) {
    const size_t ahead = prefetch_ahead();
    for (size_t chunk = begin; chunk < end; chunk += kLambChunk, ++out) {
      const size_t chunk_end = end - chunk < kLambChunk ? end : chunk + kLambChunk;
      Lanes w, u;
      size_t i = chunk;
      for (; i + kTurn <= chunk_end; i += kTurn) {
        prefetch_streams<G, M, true, true>(b, i, ahead);
        add_turn(c, b, i, kTurn, w, u);
      }
      if (i < chunk_end) {
        Tail tail(b, i, chunk_end - i);
        add_turn(c, tail.buffers(b), 0, chunk_end - i, w, u);
      }
      *out = LambSums{w.sum(), u.sum()};
    }
  }

  static inline __attribute__((always_inline)) void body(const LambConstants& c, const Buffers& b,
                                                         size_t i, bool stream) {
    const __m256 p = _mm256_loadu_ps(b.param + i);
    const Direction d = direction<G, M>(c, b, i, p);
    const __m256 p_new = _mm256_sub_ps(p, _mm256_mul_ps(d.u, _mm256_set1_ps(c.scale)));
    _mm256_storeu_ps(b.param + i, p_new);
    store_floats<M>(b.exp_avg, i, d.m);
    store_floats<M>(b.exp_avg_sq, i, d.v);
    store_half<H>(b.half_out, i, p_new, stream);
  }

  // Fewer than kWidth elements at i (zeroed lanes run through without faults and stay behind).
  static void tail(const LambConstants& c, const Buffers& b, size_t i, size_t n) {
    Tail local(b, i, n);
    body(c, local.buffers(b), 0, false);
    local.copy_back(b, i, n);
  }

  static void apply(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
    size_t i = begin;
    bool stream = false;
    if constexpr (H != DType::kNone) {
      // Up to the half copy's next 16-byte boundary first, then whole aligned vectors.
      const auto address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.half_out) + i);
      const size_t lead = address % 2 ? 0 : (16 - address % 16) % 16 / 2;
      if (address % 2 == 0 && lead < end - i) {
        if (lead > 0) tail(c, b, i, lead);
        i += lead;
        stream = true;
      }
    }
    for (; i + kTurn <= end; i += kTurn) {  // one prefetch per 64-byte line of each fp32 stream
      prefetch_streams<G, M, true, true>(b, i, ahead);
      body(c, b, i, stream);
      body(c, b, i + kWidth, stream);
    }
    for (; i + kWidth <= end; i += kWidth) body(c, b, i, stream);
    if (i < end) tail(c, b, i, end - i);
    if (stream) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

}  // namespace

void lamb_norms_avx2(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                     LambSums* out) {
  select_lamb_norms<Avx2Loop>(b)(c, b, begin, end, out);
}

void lamb_apply_avx2(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_lamb_apply<Avx2Loop>(b)(c, b, begin, end);
}

}  // namespace infinity::adam
