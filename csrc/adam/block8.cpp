// What the kernels of every instruction set share for 8-bit moments ([Note: 8-bit moments in the
// kernels] in adam.h), compiled for the baseline instruction set ([Note: one definition per
// instruction set]): called once per block of kBlock values, out of line.
#include <cstring>

#include "adam.h"

namespace infinity::adam {

float e4m3_block_scale(float top, bool has_nan) {
  uint32_t u;
  std::memcpy(&u, &top, sizeof(u));  // top >= +0: max of magnitudes
  uint32_t scale;
  if (has_nan || u <= 224u) {
    // formats.py: a NaN top, a zero one, and one whose top / 448 rounds to 0 (top <= 224 *
    // 2^-149, top / 448 <= 2^-150: ties to even 0) all leave the scale at 1 (log2 gives -inf or
    // NaN, which nan_to_num makes 0).
    scale = 0x3F800000u;
  } else if (u >= 0x7F800000u) {
    scale = 0x7F800000u;  // infinite top: formats.py's correction loop doubles 2^127 to infinity
  } else {
    // top = 1.f * 2^(E - 127) (or a subnormal, whose answer is the floor below). 448 = 1.75 * 2^8,
    // so top <= 448 * 2^e holds from e = E - 135 when 1.f <= 1.75, else from E - 134.
    const int biased = static_cast<int>(u >> 23);
    int e = biased - 135 + ((u & 0x7FFFFFu) > 0x600000u ? 1 : 0);
    if (e < -126) e = -126;  // formats.py's clamp (the upper one, 127, is never reached)
    scale = static_cast<uint32_t>(e + 127) << 23;
  }
  float out;
  std::memcpy(&out, &scale, sizeof(out));
  return out;
}

Buffers block_buffers(const Buffers& b, size_t i, float* exp_avg, float* exp_avg_sq) {
  const size_t grad_size = b.grad_dtype == DType::kF32 ? 4 : 2;
  Buffers out = b;
  out.param = b.param + i;
  out.grad = static_cast<const char*>(b.grad) + i * grad_size;
  out.half_out = b.half_out == nullptr ? nullptr : static_cast<uint16_t*>(b.half_out) + i;
  out.exp_avg = exp_avg;
  out.exp_avg_sq = exp_avg_sq;
  out.moment_dtype = DType::kF32;
  out.exp_avg_scales = nullptr;
  out.exp_avg_sq_scales = nullptr;
  return out;
}

}  // namespace infinity::adam
