// Exact conversions between float and the 16-bit formats, in integer arithmetic, for files of
// the baseline instruction set only ([Note: one definition per instruction set] in adam.h: an
// inline function here is emitted by each file that uses it, with that file's flags). They give
// torch's bits on any machine, including the NaN encodings of its vectorized converters. Used by
// kernels_scalar.cpp and lamb_scalar.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace infinity::adam::scalar {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

inline float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// Round to nearest even on the upper 16 bits; every NaN becomes 0xFFFF, as torch's vectorized
// float -> bfloat16 conversion writes it.
inline uint16_t float_to_bf16(float x) {
  if (std::isnan(x)) return 0xFFFF;
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, exact; a NaN keeps its sign and payload and comes out quiet,
// as F16C's vcvtph2ps does.
inline float f16_to_float(uint16_t h) {
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
inline uint16_t float_to_f16(float x) {
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

}  // namespace infinity::adam::scalar
