// AVX-512 (F, BW, VL, DQ) path of every rule: 16 floats per vector, tails through masked loads
// and stores (the conversions, and why bfloat16 is rounded with integers, in vectors_avx512.h).
#include <immintrin.h>

#include <limits>

#include "adam.h"
#include "select.h"
#include "vectors_avx512.h"

namespace infinity::adam {
namespace {

__m512 lerp(const Lerp& l, __m512 start, __m512 end) {
  const __m512 diff = _mm512_sub_ps(end, start);
  return l.small ? _mm512_fmadd_ps(_mm512_set1_ps(l.w), diff, start)
                 : _mm512_fmadd_ps(_mm512_set1_ps(l.w_minus_1), diff, end);
}

// torch.sign: +1, -1, and +0 for both zeros and NaN (ordered compares are false for NaN).
__m512 sign(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 positive = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __m512 s = _mm512_maskz_mov_ps(positive, _mm512_set1_ps(1.0f));
  return _mm512_mask_mov_ps(s, negative, _mm512_set1_ps(-1.0f));
}

// A vector's moments in registers: the rule reads and updates `m` (Adam, Lion) and `v` (Adam,
// Adagrad), and leaves in `root` the square root of the new `v` it took (the stored root of an
// 8-bit exp_avg_sq, [Note: 8-bit moments in the kernels] in adam.h).
struct Moments {
  __m512 m, v, root;
};

// One vector of each rule, given the param p and scaled gradient g; returns the new param
// ([Note: exact parity with torch], [Note: Adagrad and Lion arithmetic] in adam.h). Masked-off
// lanes read zeros, which flow through without faults and are never stored.
template <bool L2>
__m512 adam(const StepConstants& c, __m512 p, __m512 g, Moments& s) {
  p = _mm512_mul_ps(p, _mm512_set1_ps(c.decay));
  if constexpr (L2) g = _mm512_fmadd_ps(_mm512_set1_ps(c.l2), p, g);
  s.m = lerp(c.lerp1, s.m, g);
  s.v = _mm512_mul_ps(s.v, _mm512_set1_ps(c.beta2));
  s.v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g, s.v);
  s.root = _mm512_sqrt_ps(s.v);
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(s.root, _mm512_set1_ps(c.bc2_sqrt)), _mm512_set1_ps(c.eps));
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step), s.m), denom));
}

template <bool L2>
__m512 adagrad(const StepConstants& c, __m512 p, __m512 g, Moments& s) {
  if constexpr (L2) g = _mm512_fmadd_ps(_mm512_set1_ps(c.l2), p, g);
  s.v = _mm512_fmadd_ps(g, g, s.v);
  s.root = _mm512_sqrt_ps(s.v);
  const __m512 std_dev = _mm512_add_ps(s.root, _mm512_set1_ps(c.eps));
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step), g), std_dev));
}

__m512 lion(const StepConstants& c, __m512 p, __m512 g, Moments& s) {
  const __m512 direction = lerp(c.lerp1, s.m, g);
  p = _mm512_mul_ps(p, _mm512_set1_ps(c.decay));
  p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_set1_ps(c.neg_step), sign(direction)));
  s.m = lerp(c.lerp2, s.m, g);
  return p;
}

// The rule R's update of the vector at element i whose moments are in `s`: reads the gradient
// and the param, writes the param and its half copy, updates `s`.
template <Rule R, DType G, DType H, bool L2>
inline __attribute__((always_inline)) void update_vector(const StepConstants& c, const Buffers& b,
                                                         size_t i, __mmask16 mask, bool stream,
                                                         Moments& s) {
  const __m512 g = _mm512_mul_ps(load_floats<G>(b.grad, i, mask), _mm512_set1_ps(c.grad_scale));
  __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
  if constexpr (R == Rule::kAdam) p = adam<L2>(c, p, g, s);
  if constexpr (R == Rule::kAdagrad) p = adagrad<L2>(c, p, g, s);
  if constexpr (R == Rule::kLion) p = lion(c, p, g, s);
  _mm512_mask_storeu_ps(b.param + i, mask, p);
  store_half<H>(b.half_out, i, p, mask, stream);
}

template <Rule R, DType G, DType H, DType M, bool L2>
struct Avx512Loop {
  static inline __attribute__((always_inline)) void body(const StepConstants& c, const Buffers& b,
                                                         size_t i, __mmask16 mask, bool stream) {
    Moments s{};
    if constexpr (kHasExpAvg<R>) s.m = load_floats<M>(b.exp_avg, i, mask);
    if constexpr (kHasExpAvgSq<R>) s.v = load_floats<M>(b.exp_avg_sq, i, mask);
    update_vector<R, G, H, L2>(c, b, i, mask, stream, s);
    if constexpr (kHasExpAvg<R>) store_floats<M>(b.exp_avg, i, s.m, mask);
    if constexpr (kHasExpAvgSq<R>) store_floats<M>(b.exp_avg_sq, i, s.v, mask);
  }

  // The update of [begin, end); returns whether it used streaming stores, which the caller
  // fences once it is done with them.
  static bool sweep(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
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
      prefetch_streams<G, M, kHasExpAvg<R>, kHasExpAvgSq<R>>(b, i, ahead);
      body(c, b, i, 0xFFFF, stream);
    }
    if (i < end) body(c, b, i, static_cast<__mmask16>((1u << (end - i)) - 1u), false);
    return stream;
  }

  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    if (sweep(c, b, begin, end)) _mm_sfence();  // order the streaming stores before the caller's "done"
  }
};

// 8-bit moments ([Note: 8-bit moments in the kernels] in adam.h): codes <-> floats, 16 at a time.

__mmask16 first_lanes(size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// The codes at `codes` that `mask` selects as floats, exactly (torch's `.float()`, NaN as
// 0x7FF00000 | sign); the others read as zero codes.
__m512 e4m3_to_floats(const uint8_t* codes, __mmask16 mask) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, codes));
  const __m512i magnitude = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
  const __m512i subnormal = _mm512_castps_si512(
      _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(0x1p-9f)));
  bits = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32(8)), bits,
                                 subnormal);
  bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epu32_mask(magnitude, _mm512_set1_epi32(0x7F)), bits,
                                 _mm512_set1_epi32(0x7FF00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

// [Note: decoding a block without NaN codes]
// A code's bits moved into fp32's (its magnitude's 7 bits to bits 20-26, its sign to bit 31) are
// an fp32 of 2^-120 times the code's value: an e4m3 normal as an fp32 normal, an e4m3 subnormal
// (exponent 0, m * 2^-9) as an fp32 subnormal (m * 2^-129). Times 2^120, exact, that is the code's
// value, the same as e4m3_to_floats gives, in four instructions instead of twelve, for every code
// but the two NaNs (0x7F, 0xFF), and only where the CPU reads subnormal inputs as they are: with
// MXCSR's DAZ bit set (torch.set_flush_denormal(True) sets it on its thread) they would read as
// zeros. So a block takes this decode when its codes hold no NaN and DAZ is off on the thread
// running it, else e4m3_to_floats.
__m512 e4m3_to_floats_finite(const uint8_t* codes, __mmask16 mask) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, codes));
  const __m512i bits = _mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(c, 24), 4),
                                        _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

// Whether the n codes at `codes` hold a NaN code (0x7F or 0xFF).
bool any_nan_code(const uint8_t* codes, size_t n) {
  const __m512i all = _mm512_set1_epi8(static_cast<char>(0xFF));
  __mmask64 found = 0;
  for (size_t k = 0; k < n; k += 64) {
    const __mmask64 lanes = n - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - k)) - 1;
    const __m512i c = _mm512_maskz_loadu_epi8(lanes, codes + k);
    const __m512i signed_c = _mm512_or_si512(c, _mm512_set1_epi8(static_cast<char>(0x80)));
    found |= _mm512_mask_cmpeq_epi8_mask(lanes, signed_c, all);  // 0xFF: a NaN code of either sign
  }
  return found != 0;
}

// Whether subnormal inputs read as zeros on this thread (MXCSR's DAZ bit).
bool denormals_are_zero() { return (_mm_getcsr() & 0x40u) != 0; }

// Sixteen floats as codes, one in the low byte of each 32-bit lane: torch's
// `.to(torch.float8_e4m3fn)` (nearest even, saturating at 448, a NaN to 0x7F | sign).
//
// [Note: a finite block's codes]
// Under a finite scale, a block with no NaN has every value at most 448 in magnitude
// (e4m3_block_scale's choice), so the saturating and NaN lanes below are never taken, and a
// root (a square root of a sum of squares, never -0) has no sign to carry: kChecked false
// leaves those steps out: a third of the encode's instructions, and about a tenth of the 8-bit
// update's time on the Intel host ([Note: 8-bit moments in the kernels] in adam.h). The codes
// are the same.
template <bool kChecked, bool kSigned>
__m512i floats_to_e4m3(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i sign = kSigned ? _mm512_and_si512(u, sign_bit) : _mm512_setzero_si512();
  const __m512i a = kSigned ? _mm512_xor_si512(u, sign) : u;
  // Below 2^-6: units of 2^-9, rounded by adding 2^14 (whose ulp is 2^-9).
  const __m512i subnormal = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(0x1p14f))),
      _mm512_set1_epi32(141 << 23));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i code = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF - (120 << 23))), odd), 20);
  code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), code,
                                 subnormal);
  if constexpr (kChecked) {
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x43E80000)), code,
                                   _mm512_set1_epi32(0x7E));
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), code,
                                   _mm512_set1_epi32(0x7F));
  }
  return kSigned ? _mm512_or_si512(code, _mm512_srli_epi32(sign, 24)) : code;
}

// The running max of |x| over a block's new values and whether one is a NaN (a NaN lane keeps
// `top`): what e4m3_block_scale reads.
struct BlockTop {
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;
  void add(__m512 x) {
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top = _mm512_max_ps(_mm512_abs_ps(x), top);
  }
  float scale() const { return e4m3_block_scale(_mm512_reduce_max_ps(top), nan != 0); }
  // Whether the block's codes under `scale` (this block's) need no saturating or NaN lanes
  // ([Note: a finite block's codes]).
  bool finite(float scale) const {
    return nan == 0 && scale < std::numeric_limits<float>::infinity();
  }
};

// The codes of the 16 values at `values` under `inverse` (1 / the block's scale), in 32-bit lanes.
template <bool kChecked, bool kRoot>
__m512i block_codes(const float* values, __m512 inverse) {
  __m512 y = _mm512_mul_ps(_mm512_load_ps(values), inverse);
  if constexpr (kRoot) {  // a positive root never rounds to zero
    const __mmask16 positive = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ);
    y = _mm512_mask_max_ps(y, positive, y, _mm512_set1_ps(kLeastE4M3));
  }
  return floats_to_e4m3<kChecked, kChecked || !kRoot>(y);
}

// The block's n new values (in `values`, 64-byte aligned, roots already taken) as codes at
// element i, under `scale`, their BlockTop's. Sixty-four codes are packed into one vector and
// stored at once: narrowing stores (vpmovdb to memory) cost several cycles each on Zen 4.
template <bool kChecked, bool kRoot>
void encode_codes(const float* values, size_t n, float scale, void* codes, size_t i) {
  const __m512 inverse = _mm512_set1_ps(1.0f / scale);  // a power of two (or 0): exact
  uint8_t* c = static_cast<uint8_t*>(codes) + i;
  size_t k = 0;
  for (; k + 64 <= n; k += 64) {
    // Codes fit 8 bits, so the saturating packs keep them; the packs interleave the 128-bit
    // lanes of their inputs, which the permute puts back in order.
    const __m512i low = _mm512_packus_epi32(block_codes<kChecked, kRoot>(values + k, inverse),
                                            block_codes<kChecked, kRoot>(values + k + 16, inverse));
    const __m512i high =
        _mm512_packus_epi32(block_codes<kChecked, kRoot>(values + k + 32, inverse),
                            block_codes<kChecked, kRoot>(values + k + 48, inverse));
    const __m512i packed = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
        _mm512_packus_epi16(low, high));
    _mm512_storeu_si512(c + k, packed);
  }
  for (; k < n; k += 16) {
    _mm_mask_storeu_epi8(c + k, first_lanes(n - k),
                         _mm512_cvtepi32_epi8(block_codes<kChecked, kRoot>(values + k, inverse)));
  }
}

template <bool kRoot>
void encode_block(const float* values, size_t n, const BlockTop& top, void* codes, float* scales,
                  size_t i) {
  const float scale = top.scale();
  if (top.finite(scale)) {
    encode_codes<false, kRoot>(values, n, scale, codes, i);
  } else {
    encode_codes<true, kRoot>(values, n, scale, codes, i);
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

// 8-bit moments, a block at a time, in two passes over its vectors: the first decodes a
// vector's codes into registers, updates it, and keeps the new values (roots for exp_avg_sq,
// the one the rule took) in the stack and their running max; the second encodes them under the
// block's new scale. Whole in registers, the integer decode of one vector overlaps the square
// root and divisions of the ones before it (a round trip through memory there would wait on
// the masked stores, which do not forward to loads).
template <Rule R, DType G, DType H, bool L2>
struct Avx512Loop<R, G, H, DType::kE4M3Block, L2> {
  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    const size_t ahead = prefetch_ahead();
    bool stream = false;
    const bool daz = denormals_are_zero();  // [Note: decoding a block without NaN codes]
    for (size_t i = begin; i < end; i += kBlock) {
      const size_t n = end - i < kBlock ? end - i : kBlock;
      alignas(64) float m[kBlock], v[kBlock];
      prefetch_codes<R>(b, i, ahead);
      const Buffers block = block_buffers(b, i, m, v);
      // A block keeps its first vector's alignment: whole vectors of the half copy go out as
      // streaming stores where that is 32 bytes.
      const bool aligned =
          H != DType::kNone && reinterpret_cast<uintptr_t>(block.half_out) % 32 == 0;
      // The block's codes and scales of each moment the rule has (the others' pointers are null).
      const uint8_t* m_codes = nullptr;
      const uint8_t* v_codes = nullptr;
      __m512 m_scale = _mm512_setzero_ps(), v_scale = _mm512_setzero_ps();
      if constexpr (kHasExpAvg<R>) {
        m_codes = static_cast<const uint8_t*>(b.exp_avg) + i;
        m_scale = _mm512_set1_ps(b.exp_avg_scales[i / kBlock]);
      }
      if constexpr (kHasExpAvgSq<R>) {
        v_codes = static_cast<const uint8_t*>(b.exp_avg_sq) + i;
        v_scale = _mm512_set1_ps(b.exp_avg_sq_scales[i / kBlock]);
      }
      const bool m_finite = kHasExpAvg<R> && !daz && !any_nan_code(m_codes, n);
      const bool v_finite = kHasExpAvgSq<R> && !daz && !any_nan_code(v_codes, n);
      BlockTop m_top, v_top;
      for (size_t k = 0; k < n; k += 16) {
        const __mmask16 mask = first_lanes(n - k);
        const bool whole = aligned && mask == 0xFFFF;
        prefetch_streams<G, DType::kF32, false, false>(block, k, ahead);
        Moments s{};
        if constexpr (kHasExpAvg<R>) {
          const __m512 x = m_finite ? e4m3_to_floats_finite(m_codes + k, mask)
                                    : e4m3_to_floats(m_codes + k, mask);
          s.m = _mm512_mul_ps(x, m_scale);
        }
        if constexpr (kHasExpAvgSq<R>) {
          const __m512 root = v_finite ? e4m3_to_floats_finite(v_codes + k, mask)
                                       : e4m3_to_floats(v_codes + k, mask);
          const __m512 x = _mm512_mul_ps(root, v_scale);
          s.v = _mm512_mul_ps(x, x);
        }
        update_vector<R, G, H, L2>(c, block, k, mask, whole, s);
        stream |= whole;
        // Lanes past n hold what zero codes update to; they are never encoded or counted.
        if constexpr (kHasExpAvg<R>) {
          _mm512_store_ps(m + k, s.m);
          m_top.add(_mm512_maskz_mov_ps(mask, s.m));
        }
        if constexpr (kHasExpAvgSq<R>) {
          _mm512_store_ps(v + k, s.root);
          v_top.add(_mm512_maskz_mov_ps(mask, s.root));
        }
      }
      if constexpr (kHasExpAvg<R>) {
        encode_block<false>(m, n, m_top, b.exp_avg, b.exp_avg_scales, i);
      }
      if constexpr (kHasExpAvgSq<R>) {
        encode_block<true>(v, n, v_top, b.exp_avg_sq, b.exp_avg_sq_scales, i);
      }
    }
    if (stream) _mm_sfence();
  }
};

}  // namespace

void update_avx512(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<Avx512Loop>(c, b)(c, b, begin, end);
}

namespace {

inline __attribute__((always_inline)) void stream_vector(const Buffers& b, size_t i,
                                                         __mmask16 mask) {
  float* exp_avg = static_cast<float*>(b.exp_avg);
  float* exp_avg_sq = static_cast<float*>(b.exp_avg_sq);
  const __m512 g = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(b.grad) + i);
  const __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
  const __m512 m = _mm512_maskz_loadu_ps(mask, exp_avg + i);
  const __m512 v = _mm512_maskz_loadu_ps(mask, exp_avg_sq + i);
  _mm512_mask_storeu_ps(b.param + i, mask, _mm512_add_ps(p, g));
  _mm512_mask_storeu_ps(exp_avg + i, mask, _mm512_add_ps(m, g));
  _mm512_mask_storeu_ps(exp_avg_sq + i, mask, _mm512_add_ps(v, g));
}

}  // namespace

void stream_avx512(const Buffers& b, size_t begin, size_t end) {
  const size_t ahead = prefetch_ahead();
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    prefetch_streams<DType::kF32, DType::kF32, true, true>(b, i, ahead);
    stream_vector(b, i, 0xFFFF);
  }
  if (i < end) stream_vector(b, i, static_cast<__mmask16>((1u << (end - i)) - 1u));
}

}  // namespace infinity::adam
