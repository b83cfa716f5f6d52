// LAMB (DeepSpeed's FusedLamb) over a flat fp32 shard, in the two passes the tiers run
// ([Note: LAMB's two passes] in infinity/optim/rules.py): `norms` reads the state and sums p^2
// and u^2, changing nothing; `apply` computes the same u again and steps with the trust ratio
// the caller derived from every part of the tensor. Plain C++17, no Python, no torch.
//
// [Note: LAMB arithmetic]
// Every element goes through this sequence of IEEE fp32 operations, each correctly rounded and
// none fused (-ffp-contract=off, and no fma intrinsic in the fp32 part of any path), so that
// every SIMD path gives the same bits, and so that torch can express it exactly: each line is
// one torch op (LambRule._direction and _torch_math in infinity/optim/rules.py). With g the
// gradient, p the fp32 master, m and v the moments (bf16 ones widened exactly, [Note: bf16
// moments] in adam.h):
//
//   g  = g * grad_scale                 grad.float() * grad_scale
//   m' = m * beta1 + g * (1 - beta1)    m.mul(beta1).add_(g.mul(1 - beta1))      three roundings
//   v' = v * beta2 + (g * g) * (1 - beta2)
//                                       v.mul(beta2).add_(g.mul(g).mul_(1 - beta2))   four
//   d  = sqrt(v') + eps                 v2.sqrt().add_(eps)
//   u  = m' / d + p * weight_decay      m2.div(d).add_(p.mul(weight_decay))       always, also
//                                       for weight_decay == 0 (p * 0 is +-0, or NaN for an
//                                       infinite p, as FusedLamb's `decay * p`)
// pass 2 only:
//   p  = p - u * scale                  p.sub_(u.mul(scale))
//
// The scalars are rounded to float once each from doubles, where torch rounds a Python float
// that meets a float tensor: beta1, beta2, eps, weight_decay, grad_scale, 1 - beta1 and
// 1 - beta2 (differences taken in double), and
//
//   step_size = lr * (1 - beta2^step)^0.5 / (1 - beta1^step)   (lr without bias correction)
//   scale     = float(step_size * ratio)
//
// with step_size and its product with the trust ratio in double (C pow, as Python's `**`),
// rounded to float only as the product. No fused multiply-add: torch has no op that is sure to
// be one on every device (its CPU `add(alpha=)` is an fma in the vector loop; elsewhere it is
// whatever the compiler makes of a + alpha * b), while its separate ops are correctly rounded
// everywhere but in one place: torch's CPU sqrt comes from MKL and is off by one ulp on some
// elements ([Note: exact parity with torch] in adam.h). So the torch path gives these bits on
// CUDA (IEEE division and square root; checked on an H100) and on the CPU with a correctly
// rounded sqrt in place of torch's (tests/test_lamb_kernel.py).
// The half copy (half_out) is the new p rounded to nearest even, the bits of torch's
// `.to(dtype)` (as for Adam), and bf16 moments are stored as in [Note: bf16 moments].
//
// [Note: LAMB's sums]
// Pass 1 returns sum p^2 and sum u^2 in double, and the sums do not depend on the SIMD path or
// the thread count, so that a step is reproducible wherever it runs. The order is fixed by
// the element index i of the call ([0, count)):
// - a float squared in double is exact (24-bit significands, exponents far inside double's
//   range), so each term is exact and only the additions round; a fused acc + x * x therefore
//   gives the same bits as a separate multiply and add, and the SIMD paths use it;
// - the elements are cut into chunks of kLambChunk (the last one shorter); within a chunk, term
//   i goes to lane i % 16 of 16 double accumulators, each starting at +0 and adding its terms
//   in index order; the lanes are then added as a tree: lane k += lane k + 8 (k < 8), then
//   k += k + 4, k += k + 2, and lane 0 + lane 1 is the chunk's sum. Lanes that get no term
//   (a short last chunk) add nothing: the vector paths add +0 there, which changes no sum
//   (a sum of squares is never -0);
// - the call's sum is +0 plus the chunk sums, one after the other in chunk order.
// Threads take whole chunks and write each chunk's sums to its own slot; the caller adds them
// up at the end, so the thread count changes who computes a chunk, not its value. The cost is a
// 16-byte slot per 4096 elements (0.1% of the fp32 master's size). A tensor's sum over several
// calls (spans, NVMe pieces, ranks) adds the calls' results in the caller's order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "adam.h"
#include "simd.h"

namespace infinity::adam {

class Updater;

constexpr size_t kLambChunk = 4096;  // elements per chunk of the sums ([Note: LAMB's sums])
constexpr size_t kLambLanes = 16;    // double accumulators per chunk

// One call's hyper-parameters as the caller holds them (doubles). Pass 1 reads beta1, beta2,
// eps, weight_decay and grad_scale; pass 2 all.
struct LambParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.0;
  double grad_scale = 1.0;   // multiplies the gradient before anything else
  int64_t step = 1;          // 1 on the first update
  bool bias_correction = true;
  double ratio = 1.0;        // the tensor's trust ratio, clamped by the caller
};

// The float scalars of [Note: LAMB arithmetic].
struct LambConstants {
  float grad_scale;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float scale;  // float(step_size * ratio)
};

LambConstants make_lamb_constants(const LambParams& lp);

struct LambSums {
  double w_sq;  // sum of p^2
  double u_sq;  // sum of u^2
};

// Pass 1 over [begin, end), begin a multiple of kLambChunk: the sums of each chunk of it, in
// order, to out[0], out[1], ... (buffers.half_out is not read).
using LambNormsFn = void (*)(const LambConstants&, const Buffers&, size_t begin, size_t end,
                             LambSums* out);
// Pass 2 over [begin, end): p, the moments and the half copy updated in place.
using LambApplyFn = void (*)(const LambConstants&, const Buffers&, size_t begin, size_t end);

void lamb_norms_scalar(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                       LambSums* out);
void lamb_norms_avx2(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                     LambSums* out);
void lamb_norms_avx512(const LambConstants& c, const Buffers& b, size_t begin, size_t end,
                       LambSums* out);
void lamb_apply_scalar(const LambConstants& c, const Buffers& b, size_t begin, size_t end);
void lamb_apply_avx2(const LambConstants& c, const Buffers& b, size_t begin, size_t end);
void lamb_apply_avx512(const LambConstants& c, const Buffers& b, size_t begin, size_t end);

// Pass 1 over [0, count) on up to num_threads threads of `updater` ([Note: LAMB's sums]).
LambSums lamb_norms(Updater& updater, const LambParams& lp, const Buffers& b, size_t count,
                    int num_threads, Simd simd);
// Pass 2 over [0, count) on up to num_threads threads of `updater`.
void lamb_apply(Updater& updater, const LambParams& lp, const Buffers& b, size_t count,
                int num_threads, Simd simd);

// The instantiation of a file's loop template Loop<G, M, H> (gradient, moment and half-copy
// types) for the buffers' types; Loop is in the file's anonymous namespace, so no two files
// share an instantiation ([Note: one definition per instruction set] in adam.h).
template <DType T>
using LambDType = std::integral_constant<DType, T>;

template <typename Fn>
auto with_lamb_grad(DType t, const Fn& fn) {
  switch (t) {
    case DType::kBF16: return fn(LambDType<DType::kBF16>{});
    case DType::kF16: return fn(LambDType<DType::kF16>{});
    default: return fn(LambDType<DType::kF32>{});
  }
}

template <typename Fn>
auto with_lamb_half(DType t, const Fn& fn) {
  switch (t) {
    case DType::kBF16: return fn(LambDType<DType::kBF16>{});
    case DType::kF16: return fn(LambDType<DType::kF16>{});
    default: return fn(LambDType<DType::kNone>{});
  }
}

template <typename Fn>
auto with_lamb_moment(DType t, const Fn& fn) {
  return t == DType::kBF16 ? fn(LambDType<DType::kBF16>{}) : fn(LambDType<DType::kF32>{});
}

template <template <DType, DType, DType> class Loop>
LambNormsFn select_lamb_norms(const Buffers& b) {
  return with_lamb_grad(b.grad_dtype, [&](auto g) {
    return with_lamb_moment(b.moment_dtype, [&](auto m) {
      return &Loop<decltype(g)::value, decltype(m)::value, DType::kNone>::norms;
    });
  });
}

template <template <DType, DType, DType> class Loop>
LambApplyFn select_lamb_apply(const Buffers& b) {
  return with_lamb_grad(b.grad_dtype, [&](auto g) {
    return with_lamb_moment(b.moment_dtype, [&](auto m) {
      return with_lamb_half(b.half_dtype, [&](auto h) {
        return &Loop<decltype(g)::value, decltype(m)::value, decltype(h)::value>::apply;
      });
    });
  });
}

}  // namespace infinity::adam
