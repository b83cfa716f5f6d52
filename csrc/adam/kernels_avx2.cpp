// AVX2 + FMA + F16C path of every rule: 8 floats per vector. The last partial vector is copied
// into zeroed stack buffers, updated there by the same vector code and copied back, so the tail
// gives the same bits as the body without a second (scalar) implementation in this file.
#include <immintrin.h>

#include <type_traits>

#include "adam.h"
#include "select.h"

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

// A moment stored back from fp32 registers ([Note: bf16 moments] in adam.h).
template <DType M>
void store_moment(void* moment, size_t i, __m256 x) {
  if constexpr (M == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(moment) + i, x);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(moment) + i),
                     float_to_bf16(x));
  }
}

constexpr size_t size_of(DType t) { return t == DType::kF32 ? 4 : 2; }

// Asks for the lines kPrefetchBytes ahead of element i in every input stream of rule R.
template <Rule R, DType G, DType M>
void prefetch_ahead(const Buffers& b, size_t i) {
  constexpr size_t ahead = kPrefetchBytes / sizeof(float);
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i + ahead), _MM_HINT_T0);
  if constexpr (kHasExpAvg<R>) {
    _mm_prefetch(static_cast<const char*>(b.exp_avg) + (i + ahead) * size_of(M), _MM_HINT_T0);
  }
  if constexpr (kHasExpAvgSq<R>) {
    _mm_prefetch(static_cast<const char*>(b.exp_avg_sq) + (i + ahead) * size_of(M), _MM_HINT_T0);
  }
  _mm_prefetch(static_cast<const char*>(b.grad) + (i + ahead) * size_of(G), _MM_HINT_T0);
}

template <typename T>
void copy_elements(T* dst, const T* src, size_t n) {
  for (size_t k = 0; k < n; ++k) dst[k] = src[k];
}

__m256 lerp(const Lerp& l, __m256 start, __m256 end) {
  const __m256 diff = _mm256_sub_ps(end, start);
  return l.small ? _mm256_fmadd_ps(_mm256_set1_ps(l.w), diff, start)
                 : _mm256_fmadd_ps(_mm256_set1_ps(l.w_minus_1), diff, end);
}

// torch.sign: +1, -1, and +0 for both zeros and NaN (ordered compares are false for NaN).
__m256 sign(__m256 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 positive = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
  const __m256 negative = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
  return _mm256_or_ps(positive, negative);
}

// One vector of each rule, given the param p and scaled gradient g; returns the new param
// ([Note: exact parity with torch], [Note: Adagrad and Lion arithmetic] in adam.h).
template <DType M, bool L2>
__m256 adam(const StepConstants& c, const Buffers& b, size_t i, __m256 p, __m256 g) {
  p = _mm256_mul_ps(p, _mm256_set1_ps(c.decay));
  if constexpr (L2) g = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), p, g);
  const __m256 m = lerp(c.lerp1, load_floats<M>(b.exp_avg, i), g);
  __m256 v = _mm256_mul_ps(load_floats<M>(b.exp_avg_sq, i), _mm256_set1_ps(c.beta2));
  v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), g), g, v);
  const __m256 denom = _mm256_add_ps(
      _mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
  store_moment<M>(b.exp_avg, i, m);
  store_moment<M>(b.exp_avg_sq, i, v);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step), m), denom));
}

template <DType M, bool L2>
__m256 adagrad(const StepConstants& c, const Buffers& b, size_t i, __m256 p, __m256 g) {
  if constexpr (L2) g = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), p, g);
  const __m256 s = _mm256_fmadd_ps(g, g, load_floats<M>(b.exp_avg_sq, i));
  const __m256 std_dev = _mm256_add_ps(_mm256_sqrt_ps(s), _mm256_set1_ps(c.eps));
  store_moment<M>(b.exp_avg_sq, i, s);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step), g), std_dev));
}

template <DType M>
__m256 lion(const StepConstants& c, const Buffers& b, size_t i, __m256 p, __m256 g) {
  const __m256 m = load_floats<M>(b.exp_avg, i);
  const __m256 direction = lerp(c.lerp1, m, g);
  p = _mm256_mul_ps(p, _mm256_set1_ps(c.decay));
  p = _mm256_add_ps(p, _mm256_mul_ps(_mm256_set1_ps(c.neg_step), sign(direction)));
  store_moment<M>(b.exp_avg, i, lerp(c.lerp2, m, g));
  return p;
}

template <Rule R, DType G, DType H, DType M, bool L2>
struct Avx2Loop {
  using GradT = std::conditional_t<G == DType::kF32, float, uint16_t>;
  using MomentT = std::conditional_t<M == DType::kF32, float, uint16_t>;

  static inline __attribute__((always_inline)) void body(const StepConstants& c, const Buffers& b,
                                                         size_t i, bool stream) {
    const __m256 g = _mm256_mul_ps(load_floats<G>(b.grad, i), _mm256_set1_ps(c.grad_scale));
    __m256 p = _mm256_loadu_ps(b.param + i);
    if constexpr (R == Rule::kAdam) p = adam<M, L2>(c, b, i, p, g);
    if constexpr (R == Rule::kAdagrad) p = adagrad<M, L2>(c, b, i, p, g);
    if constexpr (R == Rule::kLion) p = lion<M>(c, b, i, p, g);
    _mm256_storeu_ps(b.param + i, p);
    store_half<H>(b.half_out, i, p, stream);
  }

  // Fewer than kWidth elements at `i`: zeroed lanes run through the same code (no fault: the
  // floating-point exceptions are masked) and are not copied back.
  static void tail(const StepConstants& c, const Buffers& b, size_t i, size_t n) {
    alignas(32) float p[kWidth] = {};
    alignas(32) MomentT m[kWidth] = {}, v[kWidth] = {};
    alignas(32) GradT g[kWidth] = {};
    alignas(32) uint16_t h[kWidth] = {};
    copy_elements(p, b.param + i, n);
    copy_elements(g, static_cast<const GradT*>(b.grad) + i, n);
    if constexpr (kHasExpAvg<R>) copy_elements(m, static_cast<const MomentT*>(b.exp_avg) + i, n);
    if constexpr (kHasExpAvgSq<R>) {
      copy_elements(v, static_cast<const MomentT*>(b.exp_avg_sq) + i, n);
    }
    const Buffers local{p, g, m, v, h, b.grad_dtype, b.half_dtype, b.moment_dtype};
    body(c, local, 0, false);
    copy_elements(b.param + i, p, n);
    if constexpr (kHasExpAvg<R>) copy_elements(static_cast<MomentT*>(b.exp_avg) + i, m, n);
    if constexpr (kHasExpAvgSq<R>) copy_elements(static_cast<MomentT*>(b.exp_avg_sq) + i, v, n);
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
      prefetch_ahead<R, G, M>(b, i);
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
  select_loop<Avx2Loop>(c, b)(c, b, begin, end);
}

void stream_avx2(const Buffers& b, size_t begin, size_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  float* exp_avg = static_cast<float*>(b.exp_avg);
  float* exp_avg_sq = static_cast<float*>(b.exp_avg_sq);
  size_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    prefetch_ahead<Rule::kAdam, DType::kF32, DType::kF32>(b, i);
    const __m256 g = _mm256_loadu_ps(grad + i);
    const __m256 p = _mm256_loadu_ps(b.param + i);
    const __m256 m = _mm256_loadu_ps(exp_avg + i);
    const __m256 v = _mm256_loadu_ps(exp_avg_sq + i);
    _mm256_storeu_ps(b.param + i, _mm256_add_ps(p, g));
    _mm256_storeu_ps(exp_avg + i, _mm256_add_ps(m, g));
    _mm256_storeu_ps(exp_avg_sq + i, _mm256_add_ps(v, g));
  }
  for (; i < end; ++i) {
    b.param[i] += grad[i];
    exp_avg[i] += grad[i];
    exp_avg_sq[i] += grad[i];
  }
}

}  // namespace infinity::adam
