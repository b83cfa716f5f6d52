// AVX2 + FMA + F16C path of every rule: 8 floats per vector. The last partial vector is copied
// into zeroed stack buffers, updated there by the same vector code and copied back, so the tail
// gives the same bits as the body without a second (scalar) implementation in this file.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "adam.h"
#include "select.h"
#include "vectors_avx2.h"

namespace infinity::adam {
namespace {

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

// A vector's moments in registers: the rule reads and updates `m` (Adam, Lion) and `v` (Adam,
// Adagrad), and leaves in `root` the square root of the new `v` it took (the stored root of an
// 8-bit exp_avg_sq, [Note: 8-bit moments in the kernels] in adam.h).
struct Moments {
  __m256 m, v, root;
};

// One vector of each rule, given the param p and scaled gradient g; returns the new param
// ([Note: exact parity with torch], [Note: Adagrad and Lion arithmetic] in adam.h).
template <bool L2>
__m256 adam(const StepConstants& c, __m256 p, __m256 g, Moments& s) {
  p = _mm256_mul_ps(p, _mm256_set1_ps(c.decay));
  if constexpr (L2) g = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), p, g);
  s.m = lerp(c.lerp1, s.m, g);
  s.v = _mm256_mul_ps(s.v, _mm256_set1_ps(c.beta2));
  s.v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), g), g, s.v);
  s.root = _mm256_sqrt_ps(s.v);
  const __m256 denom =
      _mm256_add_ps(_mm256_div_ps(s.root, _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step), s.m), denom));
}

template <bool L2>
__m256 adagrad(const StepConstants& c, __m256 p, __m256 g, Moments& s) {
  if constexpr (L2) g = _mm256_fmadd_ps(_mm256_set1_ps(c.l2), p, g);
  s.v = _mm256_fmadd_ps(g, g, s.v);
  s.root = _mm256_sqrt_ps(s.v);
  const __m256 std_dev = _mm256_add_ps(s.root, _mm256_set1_ps(c.eps));
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step), g), std_dev));
}

__m256 lion(const StepConstants& c, __m256 p, __m256 g, Moments& s) {
  const __m256 direction = lerp(c.lerp1, s.m, g);
  p = _mm256_mul_ps(p, _mm256_set1_ps(c.decay));
  p = _mm256_add_ps(p, _mm256_mul_ps(_mm256_set1_ps(c.neg_step), sign(direction)));
  s.m = lerp(c.lerp2, s.m, g);
  return p;
}

// The rule R's update of the vector at element i whose moments are in `s`: reads the gradient
// and the param, writes the param and its half copy, updates `s`.
template <Rule R, DType G, DType H, bool L2>
inline __attribute__((always_inline)) void update_vector(const StepConstants& c, const Buffers& b,
                                                         size_t i, bool stream, Moments& s) {
  const __m256 g = _mm256_mul_ps(load_floats<G>(b.grad, i), _mm256_set1_ps(c.grad_scale));
  __m256 p = _mm256_loadu_ps(b.param + i);
  if constexpr (R == Rule::kAdam) p = adam<L2>(c, p, g, s);
  if constexpr (R == Rule::kAdagrad) p = adagrad<L2>(c, p, g, s);
  if constexpr (R == Rule::kLion) p = lion(c, p, g, s);
  _mm256_storeu_ps(b.param + i, p);
  store_half<H>(b.half_out, i, p, stream);
}

template <Rule R, DType G, DType H, DType M, bool L2>
struct Avx2Loop {
  using GradT = std::conditional_t<G == DType::kF32, float, uint16_t>;
  using MomentT = std::conditional_t<M == DType::kF32, float, uint16_t>;

  static inline __attribute__((always_inline)) void body(const StepConstants& c, const Buffers& b,
                                                         size_t i, bool stream) {
    Moments s{};
    if constexpr (kHasExpAvg<R>) s.m = load_floats<M>(b.exp_avg, i);
    if constexpr (kHasExpAvgSq<R>) s.v = load_floats<M>(b.exp_avg_sq, i);
    update_vector<R, G, H, L2>(c, b, i, stream, s);
    if constexpr (kHasExpAvg<R>) store_floats<M>(b.exp_avg, i, s.m);
    if constexpr (kHasExpAvgSq<R>) store_floats<M>(b.exp_avg_sq, i, s.v);
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
    const Buffers local{p, g, m, v, h, b.grad_dtype, b.half_dtype, b.moment_dtype, nullptr, nullptr};
    body(c, local, 0, false);
    copy_elements(b.param + i, p, n);
    if constexpr (kHasExpAvg<R>) copy_elements(static_cast<MomentT*>(b.exp_avg) + i, m, n);
    if constexpr (kHasExpAvgSq<R>) copy_elements(static_cast<MomentT*>(b.exp_avg_sq) + i, v, n);
    if constexpr (H != DType::kNone) copy_elements(static_cast<uint16_t*>(b.half_out) + i, h, n);
  }

  // The update of [begin, end); returns whether it used streaming stores, which the caller
  // fences once it is done with them.
  static bool sweep(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
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
      prefetch_streams<G, M, kHasExpAvg<R>, kHasExpAvgSq<R>>(b, i, ahead);
      body(c, b, i, stream);
      body(c, b, i + kWidth, stream);
    }
    for (; i + kWidth <= end; i += kWidth) body(c, b, i, stream);
    if (i < end) tail(c, b, i, end - i);
    return stream;
  }

  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    if (sweep(c, b, begin, end)) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

// 8-bit moments ([Note: 8-bit moments in the kernels] in adam.h): codes <-> floats, 8 at a time.

// Eight codes at `codes` as floats, exactly (torch's `.float()`, NaN as 0x7FF00000 | sign).
__m256 e4m3_to_floats(const uint8_t* codes) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23));
  const __m256i subnormal = _mm256_castps_si256(
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f)));
  __m256i bits = _mm256_blendv_epi8(normal, subnormal,
                                    _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FF00000),
                            _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F)));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

// Eight floats as codes, one in the low byte of each 32-bit lane: torch's
// `.to(torch.float8_e4m3fn)` (nearest even, saturating at 448, a NaN to 0x7F | sign). All
// compares are of magnitudes below 2^31.
__m256i e4m3_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(u, sign);
  // Below 2^-6: units of 2^-9, rounded by adding 2^14 (whose ulp is 2^-9).
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0x1p14f))),
      _mm256_set1_epi32(141 << 23));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i code = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF - (120 << 23))), odd), 20);
  code = _mm256_blendv_epi8(code, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E),
                            _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43E80000)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                            _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

// The same eight codes in the low 8 bytes.
__m128i floats_to_e4m3(__m256 x) {
  const __m256i code = e4m3_lanes(x);
  const __m128i words =
      _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  return _mm_packus_epi16(words, words);
}

// The fp32 values of the n moments of the block at element i (formats.py's decode), into `out`
// rounded up to whole vectors (the lanes past n read zero codes).
void decode_block(const void* codes, const float* scales, size_t i, size_t n, bool square,
                  float* out) {
  const uint8_t* c = static_cast<const uint8_t*>(codes) + i;
  alignas(16) uint8_t padded[kBlock];
  if (n < kBlock) {  // the buffer's last block: do not read past its codes
    for (size_t k = 0; k < kBlock; ++k) padded[k] = k < n ? c[k] : 0;
    c = padded;
  }
  const __m256 scale = _mm256_set1_ps(scales[i / kBlock]);
  for (size_t k = 0; k < n; k += kWidth) {
    __m256 x = _mm256_mul_ps(e4m3_to_floats(c + k), scale);
    if (square) x = _mm256_mul_ps(x, x);
    _mm256_store_ps(out + k, x);
  }
}

// The block's new values (n of them in `values`, 32-byte aligned, roots taken in place) as
// codes and a scale.
void encode_block(float* values, size_t n, bool root, void* codes, float* scales, size_t i) {
  const size_t whole = (n + kWidth - 1) / kWidth * kWidth;
  for (size_t k = n; k < whole; ++k) values[k] = 0.0f;  // lanes past n: no effect on the top
  const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  for (size_t k = 0; k < whole; k += kWidth) {
    __m256 x = _mm256_load_ps(values + k);
    if (root) {
      x = _mm256_sqrt_ps(x);
      _mm256_store_ps(values + k, x);
    }
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    top = _mm256_max_ps(_mm256_and_ps(x, magnitude_mask), top);  // a NaN lane keeps top
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float scale = e4m3_block_scale(_mm_cvtss_f32(half), _mm256_movemask_ps(nan) != 0);
  const __m256 inverse = _mm256_set1_ps(1.0f / scale);  // a power of two (or 0): exact
  uint8_t* c = static_cast<uint8_t*>(codes) + i;
  for (size_t k = 0; k < whole; k += kWidth) {
    __m256 y = _mm256_mul_ps(_mm256_load_ps(values + k), inverse);
    if (root) {  // a positive root never rounds to zero
      const __m256 positive = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ);
      y = _mm256_blendv_ps(y, _mm256_max_ps(y, _mm256_set1_ps(kLeastE4M3)), positive);
    }
    const __m128i code = floats_to_e4m3(y);
    if (k + kWidth <= n) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(c + k), code);
    } else {
      alignas(16) uint8_t last[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(last), code);
      copy_elements(c + k, last, n - k);
    }
  }
  scales[i / kBlock] = scale;
}

// Asks for the codes of the block `ahead` elements past element i (the fp32 streams'
// distance): 1 byte a value, a line for 64 of them.
template <Rule R>
inline __attribute__((always_inline)) void prefetch_codes(const Buffers& b, size_t i,
                                                          size_t ahead) {
  if (ahead == 0) return;
  for (size_t line = 0; line < kBlock; line += 64) {
    if constexpr (kHasExpAvg<R>) {
      _mm_prefetch(static_cast<const char*>(b.exp_avg) + i + ahead + line, _MM_HINT_T0);
    }
    if constexpr (kHasExpAvgSq<R>) {
      _mm_prefetch(static_cast<const char*>(b.exp_avg_sq) + i + ahead + line, _MM_HINT_T0);
    }
  }
}

// The running max of |x| over a block's new values and whether one is a NaN (a NaN lane keeps
// `top`): what e4m3_block_scale reads.
struct BlockTop {
  __m256 top = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  void add(__m256 x) {
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    top = _mm256_max_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))), top);
  }
  float scale() const {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_movehdup_ps(half));
    return e4m3_block_scale(_mm_cvtss_f32(half), _mm256_movemask_ps(nan) != 0);
  }
};

// The codes of the 8 values at `values` under `inverse` (1 / the block's scale), in 32-bit lanes.
__m256i block_codes(const float* values, __m256 inverse, bool root) {
  __m256 y = _mm256_mul_ps(_mm256_load_ps(values), inverse);
  if (root) {  // a positive root never rounds to zero
    const __m256 positive = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ);
    y = _mm256_blendv_ps(y, _mm256_max_ps(y, _mm256_set1_ps(kLeastE4M3)), positive);
  }
  return e4m3_lanes(y);
}

// The block's n new values (n a multiple of kWidth, in `values`, 32-byte aligned, roots already
// taken) as codes at element i under `scale`, their BlockTop's. Thirty-two codes leave in one
// store: the packs interleave the 128-bit lanes of their inputs, which the permute puts back in
// order (codes fit 8 bits, so the saturating packs keep them).
void encode_vectors(const float* values, size_t n, bool root, float scale, void* codes,
                    float* scales, size_t i) {
  const __m256 inverse = _mm256_set1_ps(1.0f / scale);  // a power of two (or 0): exact
  uint8_t* c = static_cast<uint8_t*>(codes) + i;
  size_t k = 0;
  for (; k + 4 * kWidth <= n; k += 4 * kWidth) {
    const __m256i low = _mm256_packus_epi32(block_codes(values + k, inverse, root),
                                            block_codes(values + k + 8, inverse, root));
    const __m256i high = _mm256_packus_epi32(block_codes(values + k + 16, inverse, root),
                                             block_codes(values + k + 24, inverse, root));
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low, high),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + k), packed);
  }
  for (; k < n; k += kWidth) {
    const __m256i code = block_codes(values + k, inverse, root);
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(c + k), _mm_packus_epi16(words, words));
  }
  scales[i / kBlock] = scale;
}

// 8-bit moments, a block at a time. A block of whole vectors (every block but, maybe, a buffer's
// last) goes in two passes, as on AVX-512: the first decodes a vector's codes into registers,
// updates it, and keeps the new values (roots for exp_avg_sq, the one the rule took) in the
// stack and their running max; the second encodes them under the block's new scale. A block
// that ends inside a vector takes a pass per stage instead (decode into the stack, the fp32
// loop, whose tail handles the partial vector, encode), which gives the same bits.
template <Rule R, DType G, DType H, bool L2>
struct Avx2Loop<R, G, H, DType::kE4M3Block, L2> {
  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
    bool stream = false;
    for (size_t i = begin; i < end; i += kBlock) {
      const size_t n = std::min(kBlock, end - i);
      alignas(32) float m[kBlock], v[kBlock];
      prefetch_codes<R>(b, i, ahead);
      if (n % kWidth != 0) {
        if constexpr (kHasExpAvg<R>) decode_block(b.exp_avg, b.exp_avg_scales, i, n, false, m);
        if constexpr (kHasExpAvgSq<R>) decode_block(b.exp_avg_sq, b.exp_avg_sq_scales, i, n, true, v);
        stream |= Avx2Loop<R, G, H, DType::kF32, L2>::sweep(c, block_buffers(b, i, m, v), 0, n);
        if constexpr (kHasExpAvg<R>) encode_block(m, n, false, b.exp_avg, b.exp_avg_scales, i);
        if constexpr (kHasExpAvgSq<R>) encode_block(v, n, true, b.exp_avg_sq, b.exp_avg_sq_scales, i);
        continue;
      }
      const Buffers block = block_buffers(b, i, m, v);
      // Whole vectors of the half copy go out as streaming stores where the block's first is
      // 16-byte aligned (then so is every one).
      const bool aligned =
          H != DType::kNone && reinterpret_cast<uintptr_t>(block.half_out) % 16 == 0;
      stream |= aligned;
      // The block's codes and scales of each moment the rule has (the others' pointers are null).
      const uint8_t* m_codes = nullptr;
      const uint8_t* v_codes = nullptr;
      __m256 m_scale = _mm256_setzero_ps(), v_scale = _mm256_setzero_ps();
      if constexpr (kHasExpAvg<R>) {
        m_codes = static_cast<const uint8_t*>(b.exp_avg) + i;
        m_scale = _mm256_set1_ps(b.exp_avg_scales[i / kBlock]);
      }
      if constexpr (kHasExpAvgSq<R>) {
        v_codes = static_cast<const uint8_t*>(b.exp_avg_sq) + i;
        v_scale = _mm256_set1_ps(b.exp_avg_sq_scales[i / kBlock]);
      }
      BlockTop m_top, v_top;
      for (size_t k = 0; k < n; k += kWidth) {
        if (k % (2 * kWidth) == 0) prefetch_streams<G, DType::kF32, false, false>(block, k, ahead);
        Moments s{};
        if constexpr (kHasExpAvg<R>) s.m = _mm256_mul_ps(e4m3_to_floats(m_codes + k), m_scale);
        if constexpr (kHasExpAvgSq<R>) {
          const __m256 x = _mm256_mul_ps(e4m3_to_floats(v_codes + k), v_scale);
          s.v = _mm256_mul_ps(x, x);
        }
        update_vector<R, G, H, L2>(c, block, k, aligned, s);
        if constexpr (kHasExpAvg<R>) {
          _mm256_store_ps(m + k, s.m);
          m_top.add(s.m);
        }
        if constexpr (kHasExpAvgSq<R>) {
          _mm256_store_ps(v + k, s.root);
          v_top.add(s.root);
        }
      }
      if constexpr (kHasExpAvg<R>) {
        encode_vectors(m, n, false, m_top.scale(), b.exp_avg, b.exp_avg_scales, i);
      }
      if constexpr (kHasExpAvgSq<R>) {
        encode_vectors(v, n, true, v_top.scale(), b.exp_avg_sq, b.exp_avg_sq_scales, i);
      }
    }
    if (stream) _mm_sfence();
  }
};

}  // namespace

void update_avx2(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<Avx2Loop>(c, b)(c, b, begin, end);
}

void stream_avx2(const Buffers& b, size_t begin, size_t end) {
  const size_t ahead = prefetch_ahead();
  const float* grad = static_cast<const float*>(b.grad);
  float* exp_avg = static_cast<float*>(b.exp_avg);
  float* exp_avg_sq = static_cast<float*>(b.exp_avg_sq);
  size_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    prefetch_streams<DType::kF32, DType::kF32, true, true>(b, i, ahead);
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
