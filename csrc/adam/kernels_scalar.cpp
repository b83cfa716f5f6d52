// The reference implementation of every rule: one element at a time, baseline x86-64 (or any)
// instructions. Every SIMD path is tested against it bit for bit ([Note: exact parity with
// torch], [Note: Adagrad and Lion arithmetic] and [Note: bf16 moments] in adam.h).
// The half-precision conversions (convert_scalar.h, shared with lamb_scalar.cpp) are written out
// in integer arithmetic so that they give torch's bits on any machine.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "adam.h"
#include "convert_scalar.h"
#include "select.h"

namespace infinity::adam {
namespace {

using scalar::bf16_to_float;
using scalar::bits_of;
using scalar::f16_to_float;
using scalar::float_of;
using scalar::float_to_bf16;
using scalar::float_to_f16;

template <DType G>
float load_grad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) return static_cast<const float*>(grad)[i];
  if constexpr (G == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  if constexpr (G == DType::kF16) return f16_to_float(static_cast<const uint16_t*>(grad)[i]);
}

template <DType H>
void store_half(void* out, size_t i, float x) {
  if constexpr (H == DType::kBF16) static_cast<uint16_t*>(out)[i] = float_to_bf16(x);
  if constexpr (H == DType::kF16) static_cast<uint16_t*>(out)[i] = float_to_f16(x);
}

// A moment's element as a float, and back ([Note: bf16 moments] in adam.h).
template <DType M>
float load_moment(const void* moment, size_t i) {
  if constexpr (M == DType::kF32) return static_cast<const float*>(moment)[i];
  if constexpr (M == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(moment)[i]);
}

template <DType M>
void store_moment(void* moment, size_t i, float x) {
  if constexpr (M == DType::kF32) static_cast<float*>(moment)[i] = x;
  if constexpr (M == DType::kBF16) static_cast<uint16_t*>(moment)[i] = float_to_bf16(x);
}

// e4m3fn code -> float, exactly, as torch's `.float()`: a NaN code (0x7F, 0xFF) gives
// 0x7FF00000 | sign ([Note: 8-bit moments in the kernels] in adam.h).
float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t magnitude = code & 0x7Fu;
  if (magnitude == 0x7Fu) return float_of(sign | 0x7FF00000u);
  if (magnitude < 8u) return float_of(sign | bits_of(static_cast<float>(magnitude) * 0x1p-9f));
  return float_of(sign | ((magnitude << 20) + (120u << 23)));  // exponent 1..15 -> 121..135
}

// float -> e4m3fn as torch's `.to(torch.float8_e4m3fn)`: round to nearest even, saturate at
// 448 (infinity too), a NaN to 0x7F | sign.
uint8_t float_to_e4m3(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u & 0x80000000u) >> 24;
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t code;
  if (a > 0x7F800000u) {
    code = 0x7Fu;
  } else if (a >= 0x43E80001u) {  // above 464, the tie between 448 and the next octave's NaN
    code = 0x7Eu;
  } else if (a < (121u << 23)) {  // below 2^-6, e4m3's least normal: units of 2^-9, by a float add
    code = bits_of(float_of(a) + 0x1p14f) - (141u << 23);
  } else {
    code = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  }
  return static_cast<uint8_t>(code | sign);
}

// The fp32 values of the n moments of the block at element i (formats.py's decode).
void decode_block(const void* codes, const float* scales, size_t i, size_t n, bool square,
                  float* out) {
  const uint8_t* c = static_cast<const uint8_t*>(codes) + i;
  const float scale = scales[i / kBlock];
  for (size_t k = 0; k < n; ++k) {
    const float x = e4m3_to_float(c[k]) * scale;
    out[k] = square ? x * x : x;
  }
}

// The block's new values (n of them in `values`, roots taken in place) as codes and a scale.
void encode_block(float* values, size_t n, bool root, void* codes, float* scales, size_t i) {
  float top = 0.0f;
  bool has_nan = false;
  for (size_t k = 0; k < n; ++k) {
    const float x = root ? std::sqrt(values[k]) : values[k];
    values[k] = x;
    if (std::isnan(x)) {
      has_nan = true;
    } else {
      top = std::max(top, std::fabs(x));
    }
  }
  const float scale = e4m3_block_scale(top, has_nan);
  const float inverse = 1.0f / scale;  // a power of two (0 for an infinite scale): exact
  uint8_t* c = static_cast<uint8_t*>(codes) + i;
  for (size_t k = 0; k < n; ++k) {
    float y = values[k] * inverse;
    if (root && y > 0.0f) y = std::max(y, kLeastE4M3);
    c[k] = float_to_e4m3(y);
  }
  scales[i / kBlock] = scale;
}

float lerp(const Lerp& l, float start, float end) {
  const float diff = end - start;
  return l.small ? std::fma(l.w, diff, start) : std::fma(l.w_minus_1, diff, end);
}

// torch.sign: +1, -1, and +0 for both zeros and NaN.
float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

// One element of each rule, given its param p and scaled gradient g; returns the new param.
template <DType M, bool L2>
float adam(const StepConstants& c, const Buffers& b, size_t i, float p, float g) {
  p = p * c.decay;
  if constexpr (L2) g = std::fma(c.l2, p, g);
  const float m = lerp(c.lerp1, load_moment<M>(b.exp_avg, i), g);
  float v = load_moment<M>(b.exp_avg_sq, i) * c.beta2;
  v = std::fma(c.one_minus_beta2 * g, g, v);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  store_moment<M>(b.exp_avg, i, m);
  store_moment<M>(b.exp_avg_sq, i, v);
  return p + (c.neg_step * m) / denom;
}

template <DType M, bool L2>
float adagrad(const StepConstants& c, const Buffers& b, size_t i, float p, float g) {
  if constexpr (L2) g = std::fma(c.l2, p, g);
  const float s = std::fma(g, g, load_moment<M>(b.exp_avg_sq, i));
  const float std_dev = std::sqrt(s) + c.eps;
  store_moment<M>(b.exp_avg_sq, i, s);
  return p + (c.neg_step * g) / std_dev;
}

template <DType M>
float lion(const StepConstants& c, const Buffers& b, size_t i, float p, float g) {
  const float m = load_moment<M>(b.exp_avg, i);
  const float direction = lerp(c.lerp1, m, g);
  p = p * c.decay;
  p = p + c.neg_step * sign(direction);
  store_moment<M>(b.exp_avg, i, lerp(c.lerp2, m, g));
  return p;
}

template <Rule R, DType G, DType H, DType M, bool L2>
struct ScalarLoop {
  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const float g = load_grad<G>(b.grad, i) * c.grad_scale;
      float p = b.param[i];
      if constexpr (R == Rule::kAdam) p = adam<M, L2>(c, b, i, p, g);
      if constexpr (R == Rule::kAdagrad) p = adagrad<M, L2>(c, b, i, p, g);
      if constexpr (R == Rule::kLion) p = lion<M>(c, b, i, p, g);
      b.param[i] = p;
      store_half<H>(b.half_out, i, p);
    }
  }
};

// 8-bit moments, a block at a time ([Note: 8-bit moments in the kernels] in adam.h).
template <Rule R, DType G, DType H, bool L2>
struct ScalarLoop<R, G, H, DType::kE4M3Block, L2> {
  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    for (size_t i = begin; i < end; i += kBlock) {
      const size_t n = std::min(kBlock, end - i);
      float m[kBlock], v[kBlock];
      if constexpr (kHasExpAvg<R>) decode_block(b.exp_avg, b.exp_avg_scales, i, n, false, m);
      if constexpr (kHasExpAvgSq<R>) decode_block(b.exp_avg_sq, b.exp_avg_sq_scales, i, n, true, v);
      ScalarLoop<R, G, H, DType::kF32, L2>::run(c, block_buffers(b, i, m, v), 0, n);
      if constexpr (kHasExpAvg<R>) encode_block(m, n, false, b.exp_avg, b.exp_avg_scales, i);
      if constexpr (kHasExpAvgSq<R>) encode_block(v, n, true, b.exp_avg_sq, b.exp_avg_sq_scales, i);
    }
  }
};

}  // namespace

void update_scalar(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<ScalarLoop>(c, b)(c, b, begin, end);
}

void stream_scalar(const Buffers& b, size_t begin, size_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  float* exp_avg = static_cast<float*>(b.exp_avg);
  float* exp_avg_sq = static_cast<float*>(b.exp_avg_sq);
  for (size_t i = begin; i < end; ++i) {
    b.param[i] += grad[i];
    exp_avg[i] += grad[i];
    exp_avg_sq[i] += grad[i];
  }
}

}  // namespace infinity::adam
