// The reference implementation of LAMB's two passes: one element at a time, baseline
// instructions. Every SIMD path is tested against it bit for bit ([Note: LAMB arithmetic] and
// [Note: LAMB's sums] in lamb.h).
#include <cmath>

#include "convert_scalar.h"
#include "lamb.h"

namespace infinity::adam {
namespace {

using scalar::bf16_to_float;
using scalar::f16_to_float;
using scalar::float_to_bf16;
using scalar::float_to_f16;

// An fp32 or 16-bit element as a float (exactly), and a float stored as type T.
template <DType T>
float load(const void* data, size_t i) {
  if constexpr (T == DType::kF32) return static_cast<const float*>(data)[i];
  if constexpr (T == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  if constexpr (T == DType::kF16) return f16_to_float(static_cast<const uint16_t*>(data)[i]);
}

template <DType T>
void store(void* data, size_t i, float x) {
  if constexpr (T == DType::kF32) static_cast<float*>(data)[i] = x;
  if constexpr (T == DType::kBF16) static_cast<uint16_t*>(data)[i] = float_to_bf16(x);
  if constexpr (T == DType::kF16) static_cast<uint16_t*>(data)[i] = float_to_f16(x);
}

struct Direction {
  float m;  // m'
  float v;  // v'
  float u;
};

// [Note: LAMB arithmetic], the part both passes share, for element i with master value p.
template <DType G, DType M>
Direction direction(const LambConstants& c, const Buffers& b, size_t i, float p) {
  const float g = load<G>(b.grad, i) * c.grad_scale;
  const float m = load<M>(b.exp_avg, i) * c.beta1 + g * c.one_minus_beta1;
  const float v = load<M>(b.exp_avg_sq, i) * c.beta2 + (g * g) * c.one_minus_beta2;
  const float u = m / (std::sqrt(v) + c.eps) + p * c.weight_decay;
  return {m, v, u};
}

// Lane k += lane k + width for width 8, 4, 2, 1: the chunk's sum ([Note: LAMB's sums]).
double reduce_lanes(double* lanes) {
  for (size_t width = kLambLanes / 2; width > 0; width /= 2) {
    for (size_t k = 0; k < width; ++k) lanes[k] = lanes[k] + lanes[k + width];
  }
  return lanes[0];
}

template <DType G, DType M, DType H>
struct ScalarLoop {
  static void norms(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                    LambSums* out) {
    for (size_t chunk = begin; chunk < end; chunk += kLambChunk, ++out) {
      double w_lanes[kLambLanes] = {}, u_lanes[kLambLanes] = {};
      const size_t chunk_end = end - chunk < kLambChunk ? end : chunk + kLambChunk;
      for (size_t i = chunk; i < chunk_end; ++i) {
        const double p = b.param[i];
        const double u = direction<G, M>(c, b, i, b.param[i]).u;
        w_lanes[i % kLambLanes] += p * p;
        u_lanes[i % kLambLanes] += u * u;
      }
      *out = LambSums{reduce_lanes(w_lanes), reduce_lanes(u_lanes)};
    }
  }

  static void apply(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Direction d = direction<G, M>(c, b, i, b.param[i]);
      const float p = b.param[i] - d.u * c.scale;
      b.param[i] = p;
      store<M>(b.exp_avg, i, d.m);
      store<M>(b.exp_avg_sq, i, d.v);
      if constexpr (H != DType::kNone) store<H>(b.half_out, i, p);
    }
  }
};

}  // namespace

void lamb_norms_scalar(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                       LambSums* out) {
  select_lamb_norms<ScalarLoop>(b)(c, b, begin, end, out);
}

void lamb_apply_scalar(const LambConstants& c, const Buffers& b, size_t begin, size_t end) {
  select_lamb_apply<ScalarLoop>(b)(c, b, begin, end);
}

}  // namespace infinity::adam
