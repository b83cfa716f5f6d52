// The reference implementation: one element at a time, baseline x86-64 (or any) instructions.
// Every SIMD path is tested against it bit for bit ([Note: exact parity with torch] in adam.h).
// The half-precision conversions are written out in integer arithmetic so that they give
// torch's bits on any machine, including the NaN encodings of its vectorized converters.
#include <cmath>
#include <cstring>

#include "adam.h"
#include "select.h"

namespace infinity::adam {
namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// Round to nearest even on the upper 16 bits; every NaN becomes 0xFFFF, as torch's vectorized
// float -> bfloat16 conversion writes it.
uint16_t float_to_bf16(float x) {
  if (std::isnan(x)) return 0xFFFF;
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, exact; a NaN keeps its sign and payload and comes out quiet,
// as F16C's vcvtph2ps does.
float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) {
    return float_of(sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return float_of(sign | bits_of(magnitude));
  }
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// IEEE binary32 -> binary16, round to nearest even, as F16C's vcvtps2ph with
// _MM_FROUND_TO_NEAREST_INT: overflow to infinity, gradual underflow, a NaN keeps its sign and
// the top of its payload and comes out quiet.
uint16_t float_to_f16(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to infinity
  if (a >= 0x38800000u) {                         // normal in binary16: rebias 127 -> 15
    return sign | static_cast<uint16_t>((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13);
  }
  const uint32_t exponent = a >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
  // Subnormal result: the value in units of 2^-24 is mantissa >> (126 - exponent).
  const uint32_t mantissa = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exponent;
  uint32_t h = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;  // may carry into the smallest normal
  return sign | static_cast<uint16_t>(h);
}

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

template <DType G, DType H, bool L2>
struct ScalarLoop {
  static void run(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float g = load_grad<G>(b.grad, i) * c.grad_scale;
      float p = b.param[i] * c.decay;
      if constexpr (L2) g = std::fma(c.l2, p, g);
      float m = b.exp_avg[i];
      const float diff = g - m;
      m = c.lerp_small ? std::fma(c.lerp_w, diff, m) : std::fma(c.lerp_w_minus_1, diff, g);
      float v = b.exp_avg_sq[i] * c.beta2;
      v = std::fma(c.one_minus_beta2 * g, g, v);
      const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
      p = p + (c.neg_step * m) / denom;
      b.param[i] = p;
      b.exp_avg[i] = m;
      b.exp_avg_sq[i] = v;
      store_half<H>(b.half_out, i, p);
    }
  }
};

}  // namespace

void update_scalar(const StepConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_loop<ScalarLoop>(b.grad_dtype, b.half_dtype, c.use_l2)(c, b, begin, end);
}

void stream_scalar(const Buffers& b, size_t begin, size_t end) {
  const float* grad = static_cast<const float*>(b.grad);
  for (size_t i = begin; i < end; ++i) {
    b.param[i] += grad[i];
    b.exp_avg[i] += grad[i];
    b.exp_avg_sq[i] += grad[i];
  }
}

}  // namespace infinity::adam
