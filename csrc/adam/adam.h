// CPU Adam / AdamW over flat fp32 shards: plain C++17, no Python, no torch.
//
// [Note: exact parity with torch]
// Every element goes through the same IEEE operations, in the same order and with the same
// fused multiply-adds, as torch.optim.AdamW / Adam on the CPU (the elementwise kernels of
// `_single_tensor_adam`: lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_), and the per-step
// scalars are derived from the same doubles and rounded to float where torch rounds them. Each
// of these operations is correctly rounded, so every SIMD path gives the same bits, and they
// are the bits of torch's fused CPU kernel (fused=True) on whole vectors (its scalar tail
// rounds differently). Torch's default path takes its sqrt from MKL, which is not correctly
// rounded (within one ulp), so it differs from both in the last bit of some elements per step.
// Per element, with g the gradient and p, m, v the param and moments:
//
//   g = g * grad_scale                          (the fused unscale / clip multiplier)
//   p = p * decay            (AdamW)            decay = float(1 - lr * weight_decay)
//   g = fma(l2, p, g)        (Adam, wd != 0)    grad.add(param, alpha=wd)
//   m = fma(w, g - m, m)     (w < 0.5)          exp_avg.lerp_(grad, w), w = float(1 - beta1)
//   m = fma(w - 1, g - m, g) (w >= 0.5)         lerp's other branch
//   v = v * beta2
//   v = fma((1 - beta2) * g, g, v)              addcmul_(grad, grad, value=1 - beta2)
//   d = sqrt(v) / bc2_sqrt + eps
//   p = p + (neg_step * m) / d                  addcdiv_(exp_avg, denom, value=-step_size)
//
// The build passes -ffp-contract=off so that the compiler never fuses an a*b+c on its own:
// every fma above is written out, and no other one exists.
//
// [Note: one definition per instruction set]
// adam_avx2.cpp and adam_avx512.cpp are compiled with -mavx2 / -mavx512f. An inline function
// defined in a header and used by them would be emitted once per file with that file's
// instructions, and the linker would keep any one of those copies for all callers, so a scalar
// machine could end up running AVX-512 code. Hence this header declares only plain types and
// functions defined in a file of the baseline instruction set, and the SIMD files keep their
// helpers in an anonymous namespace.
//
// [Note: memory traffic]
// With both cores busy the update is bound by memory bandwidth, not arithmetic: 28 bytes a
// parameter (param, exp_avg, exp_avg_sq read and written, grad read), 2 more for a half copy.
// Measured on the 2-core development machine (EPYC, Zen 4), against torch's fused kernel in
// the same rounds:
// - non-temporal stores for the half copy: a plain store first reads the line it writes (2
//   more bytes a parameter); streaming stores do not: +12-16% for the update with a half copy;
// - software prefetch kPrefetchBytes ahead in each input stream (the hardware prefetcher
//   stops at each 4 KiB page; this one does not). The distance that pays grows with the
//   bandwidth one core draws, as a line must be asked for a memory latency before it is used:
//   on a host where one thread streamed 36 GB/s, 256 and 512 bytes gave +2-8% and 1024 less;
//   on one streaming 57 GB/s (one thread, 100M parameters, `CPUAdam.step` against fused
//   AdamW, 3 processes of 20 rounds each, interleaved), 512 bytes gave 0.93x, none 1.00x,
//   1024 1.04x, 1536 and 2048 1.07-1.08x, 3072 0.98x; with two threads every distance was
//   within 2% of parity. 1536 sits in the middle of the band that paid there;
// - non-temporal stores for param and the moments: -10% or worse. Their lines were just read
//   and are in cache, so a plain store costs no extra traffic there.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity::adam {

constexpr size_t kPrefetchBytes = 1536;

// Element type of a buffer the kernel reads (gradient) or writes (half-precision copy).
enum class DType : uint8_t { kNone, kF32, kBF16, kF16 };

// One step's hyper-parameters as the caller holds them: doubles, like torch's param_groups.
struct HyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double grad_scale = 1.0;   // multiplies the gradient before anything else
  int64_t step = 1;          // 1 on the first update, as torch's state["step"] after += 1
  bool adamw_mode = true;    // decoupled weight decay; false: L2 added to the gradient
  bool bias_correction = true;
};

// The float scalars the kernels use, rounded from doubles exactly where torch rounds them.
struct StepConstants {
  float grad_scale;
  float decay;          // AdamW: 1 - lr * wd; exactly 1 otherwise (x * 1 == x for every x)
  float l2;             // Adam: wd, used only when `use_l2`
  bool use_l2;          // Adam with wd != 0 (torch skips the add when wd == 0)
  bool lerp_small;      // w < 0.5 picks lerp's first branch
  float lerp_w;         // w = 1 - beta1
  float lerp_w_minus_1; // computed in float, as torch's vectorized lerp does
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^step), 1 without bias correction
  float eps;
  float neg_step;       // -lr / (1 - beta1^step), -lr without bias correction
};

StepConstants make_constants(const HyperParams& hp);

// The memory one update touches; all arrays are indexed by the same element index.
struct Buffers {
  float* param;
  const void* grad;  // grad_dtype elements
  float* exp_avg;
  float* exp_avg_sq;
  void* half_out;    // half_dtype elements, or null with kNone
  DType grad_dtype;  // kF32, kBF16 or kF16
  DType half_dtype;  // kNone, kBF16 or kF16
};

// Updates elements [begin, end). Every implementation gives the same bits.
using KernelFn = void (*)(const StepConstants&, const Buffers&, size_t begin, size_t end);

void update_scalar(const StepConstants& c, const Buffers& b, size_t begin, size_t end);
void update_avx2(const StepConstants& c, const Buffers& b, size_t begin, size_t end);
void update_avx512(const StepConstants& c, const Buffers& b, size_t begin, size_t end);

// The memory roofline of the update, for benchmarks: the same loads and stores as an update
// with fp32 gradients and no half output, one add per array (param, exp_avg and exp_avg_sq
// each += grad) in place of Adam. One per instruction set, as the width of the loads and
// stores changes what a core gets from memory.
using StreamFn = void (*)(const Buffers&, size_t begin, size_t end);

void stream_scalar(const Buffers& b, size_t begin, size_t end);
void stream_avx2(const Buffers& b, size_t begin, size_t end);
void stream_avx512(const Buffers& b, size_t begin, size_t end);

}  // namespace infinity::adam
