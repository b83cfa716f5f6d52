// CPU optimizer kernels over flat fp32 shards (Adam / AdamW, Adagrad, Lion): plain C++17, no
// Python, no torch.
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
// every fma above and below is written out, and no other one exists.
//
// [Note: Adagrad and Lion arithmetic]
// Adagrad is torch.optim.Adagrad's fused CPU kernel (fused=True), bit for bit on every length
// (its scalar tail rounds as its vectors do), with clr = lr / (1 + (step - 1) * lr_decay) in
// double, rounded to float once:
//
//   g = g * grad_scale
//   g = fma(wd, p, g)        (wd != 0)          grad.add(param, alpha=wd)
//   s = fma(g, g, s)                            sum.addcmul_(grad, grad, value=1)
//   d = sqrt(s) + eps
//   p = p + (-clr * g) / d                      param.addcdiv_(grad, std, value=-clr)
//
// Torch's single-tensor and foreach paths do the same operations, but take the square root from
// MKL (not correctly rounded), so they differ from these bits in the last place of a few
// elements per step, as for Adam.
// Lion has no torch reference; its order is defined here, in torch's terms (the tests run these
// torch ops as the reference), with the update direction from the old momentum:
//
//   g = g * grad_scale
//   c = fma(w1, g - m, m) or fma(w1 - 1, g - m, g)    c = exp_avg.lerp(grad, w1), w1 = 1 - beta1
//   p = p * decay                                       param.mul_(1 - lr * wd)
//   p = p + (-lr) * sign(c)                             param.add_(c.sign(), alpha=-lr)
//   m = lerp(m, g, w2)                                  exp_avg.lerp_(grad, 1 - beta2)
//
// (-lr) * sign(c) is exact, so the last add rounds once however it is written. sign is
// torch.sign: +1, -1, or +0 for zeros and NaN (so a NaN gradient leaves p where it was and
// puts NaN in exp_avg).
//
// [Note: bf16 moments]
// The moment buffers of a call (Adam's exp_avg and exp_avg_sq, Adagrad's sum, Lion's exp_avg)
// are all fp32 or all bf16. A bf16 moment is widened to fp32 exactly, goes through the fp32
// arithmetic above in registers (the param update reads the fp32 value, before rounding), and
// is stored rounded to nearest even, every NaN as 0xFFFF: the bits of `m.float()`, the same
// fp32 torch ops, then `.to(torch.bfloat16)`. The param (master) stays fp32. Each SIMD file
// rounds with its own helper, the one it uses for the half copy, so every path gives the same
// bits.
//
// [Note: 8-bit moments in the kernels]
// A moment of DType::kE4M3Block is the "8bit" format of infinity/optim/formats.py ([Note: moment
// formats] there), updated in one pass instead of formats.py's decode, fp32 kernel, encode; the
// result is that composition's, bit for bit. Its buffer holds one e4m3fn code a value (then
// padding to 4 bytes) and one fp32 scale, a power of two, per block of kBlock values; Buffers
// points at the codes and, apart, at the scales, each at the buffer's first element. Blocks are
// counted from there, and a scale depends on every value of its block, so a call (and each
// thread's range of it: updater.cpp) starts on a block and ends on one or at the buffer's end.
// Per block, with `square` for exp_avg_sq (Adam's second moment, Adagrad's sum), stored as roots:
//
//   x = e4m3(code) * scale                     exact: e4m3 -> fp32, times a power of two
//   x = x * x                  (square)        the one rounding of the decode
//   ...the fp32 loop of the rule, unchanged, on the block's values in a stack array...
//   x = sqrt(x)                (square)        correctly rounded (formats.py takes it in double)
//   top = max |x|, NaN aside; scale = e4m3_block_scale(top, any NaN)
//   y = x * (1 / scale)                        x / scale's bits: 1 / scale is a power of two (0 for
//                                              an infinite scale), so both round the same quotient
//   y = max(y, 2^-9)           (square, y > 0) a positive root never rounds to zero
//   code = e4m3(y)                             torch's conversion: nearest even, saturating
//
// e4m3_block_scale is formats.py's choice without its log2: the smallest 2^e with top <= 448 *
// 2^e, at least 2^-126, read off top's exponent and mantissa (448 is 1.75 * 2^8); 1 for a block
// of zeros, for one with a NaN, and for a top of at most 224 * 2^-149 (where formats.py's top /
// 448 rounds to 0); infinity for an infinite top. It was compared with formats.py's choice for
// every float top. torch's conversion (2.13) rounds to nearest even, saturates above 448
// (infinity too) and writes a NaN as 0x7F | sign, which each file writes out in integer
// arithmetic, compared with torch's for every float; an e4m3 NaN decodes to 0x7FF00000 | sign,
// as torch's `.float()` does. The loop runs over one block at a time: its values stay in the L1
// cache from decode through update to encode, so the moments cross memory once, a byte a value.
// That makes the update bound by arithmetic rather than memory, so the AVX-512 and AVX2 loops
// decode, update and measure each vector in registers in one pass and encode in a second (the
// root the rule took is the one stored; the scalar loop, and an AVX2 block that ends inside a
// vector, keep a pass per stage). On the 2-core development machine
// (bench/bench_8bit_moments.py, Adam over 16M values, 2 threads) AVX-512 takes 10.9 ms where the
// fp32 kernel on fp32 moments takes 9.0 ms in the same rounds, against 13.5 ms with a pass per
// stage, and 444 ms for the torch-op decode, kernel, encode it replaces; AVX2 (INFINITY_SIMD=avx2)
// takes 13.6 ms against 16.2-17.2 ms with a pass per stage. On the Intel Xeon host (AVX-512, 9
// rounds), the AVX-512 loop took 16.4 ms against the fp32 kernel's 14.1 ms; with the shortcuts of
// [Note: a finite block's codes] and [Note: decoding a block without NaN codes]
// (kernels_avx512.cpp), 13.5-14.0 ms against 14.1-14.3 ms in the same rounds.
//
// [Note: one definition per instruction set]
// kernels_avx2.cpp and kernels_avx512.cpp are compiled with -mavx2 / -mavx512f. An inline function
// defined in a header and used by them would be emitted once per file with that file's
// instructions, and the linker would keep any one of those copies for all callers, so a scalar
// machine could end up running AVX-512 code. Hence this header declares only plain types and
// functions defined in a file of the baseline instruction set, and the SIMD files keep their
// helpers in an anonymous namespace.
//
// [Note: memory traffic]
// With both cores busy the update is bound by memory bandwidth, not arithmetic: 28 bytes a
// parameter for Adam (param, exp_avg, exp_avg_sq read and written, grad read), 20 for Adagrad
// and Lion (one moment), 4 fewer per moment in bf16, 6 fewer in 8 bits (and 8 bytes of scales
// a block), 2 more for a half copy. The measurements
// below are Adam's; the other rules run the same loop.
// Measured on the 2-core development machine (EPYC, Zen 4), against torch's fused kernel in
// the same rounds:
// - non-temporal stores for the half copy: a plain store first reads the line it writes (2
//   more bytes a parameter); streaming stores do not: +12-16% for the update with a half copy;
// - software prefetch prefetch_bytes() ahead in each input stream (the hardware prefetcher
//   stops at each 4 KiB page; this one does not). The distance that pays grows with the
//   bandwidth one core draws, as a line must be asked for a memory latency before it is used,
//   and hosts differ: on one streaming 36 GB/s a thread, 256 and 512 bytes gave +2-8% and 1024
//   less; on one streaming 57 GB/s (one thread, 100M parameters, `CPUAdam.step` against fused
//   AdamW, 3 processes of 20 rounds each, interleaved), 512 bytes gave 0.93x, none 1.00x, 1024
//   1.04x, 1536 and 2048 1.07-1.08x, 3072 0.98x, and with two threads every distance was within
//   2% of parity. 1536 was the default from then on; on the same EPYC VM later (2026-11-30,
//   distances compared within one process, `bench/bench_cpu_optim.py --prefetch-bytes`), 1536
//   gave 0.83x with one thread and 0.95-0.99x with two, none 1.01x, 256-512 1.02-1.07x, 768
//   and more 0.89-1.00x. kDefaultPrefetchBytes (384) sits in the band that paid on both hosts
//   that favoured short distances; a host can set its own (INFINITY_PREFETCH_BYTES), and the
//   bits are the same at every distance;
// - non-temporal stores for param and the moments: -10% or worse. Their lines were just read
//   and are in cache, so a plain store costs no extra traffic there.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity::adam {

// How far ahead of the element being updated the kernels ask for the lines of each stream, in
// bytes of an fp32 stream (a 16-bit stream is asked half as far in bytes, the same elements);
// 0: no software prefetch. kDefaultPrefetchBytes unless set ([Note: memory traffic]); read once
// per kernel call, so a bench can compare distances within one process.
constexpr size_t kDefaultPrefetchBytes = 384;
size_t prefetch_bytes();
void set_prefetch_bytes(size_t bytes);
constexpr size_t kBlock = 256;  // values per scale of a kE4M3Block moment

// The e4m3 value of the least subnormal, to which a positive root is clamped before rounding.
constexpr float kLeastE4M3 = 0x1p-9f;

// Element type of a buffer the kernel reads (gradient, moments) or writes (moments, half copy).
// kE4M3Block: a moment in 8 bits with a scale per block ([Note: 8-bit moments in the kernels]).
enum class DType : uint8_t { kNone, kF32, kBF16, kF16, kE4M3Block };

// The update rule a job runs ([Note: exact parity with torch], [Note: Adagrad and Lion
// arithmetic]).
enum class Rule : uint8_t { kAdam, kAdagrad, kLion };

// Which moment buffers a rule reads and writes: Adam both, Adagrad its sum in exp_avg_sq (as
// DeepSpeed's CPU Adagrad names it), Lion exp_avg. Constants, so that no code is emitted for
// them in any file ([Note: one definition per instruction set]).
template <Rule R>
inline constexpr bool kHasExpAvg = R != Rule::kAdagrad;
template <Rule R>
inline constexpr bool kHasExpAvgSq = R != Rule::kLion;

// One step's hyper-parameters as the caller holds them: doubles, like torch's param_groups.
// Each rule reads its own: Adam all but lr_decay; Adagrad lr, eps, weight_decay, lr_decay,
// step; Lion lr, beta1, beta2, weight_decay.
struct HyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double grad_scale = 1.0;   // multiplies the gradient before anything else
  int64_t step = 1;          // 1 on the first update, as torch's state["step"] after += 1
  bool adamw_mode = true;    // Adam: decoupled weight decay; false: L2 added to the gradient
  bool bias_correction = true;
  Rule rule = Rule::kAdam;
  double lr_decay = 0.0;     // Adagrad: lr / (1 + (step - 1) * lr_decay)
};

// torch's lerp(start, end, w) with a scalar weight, as its vectorized kernel computes it.
struct Lerp {
  bool small;          // |w| < 0.5: fma(w, end - start, start); else fma(w - 1, end - start, end)
  float w;
  float w_minus_1;     // computed in float, as torch's vectorized lerp does
};

// The float scalars the kernels use, rounded from doubles exactly where torch rounds them.
struct StepConstants {
  Rule rule;
  float grad_scale;
  float decay;          // AdamW, Lion: 1 - lr * wd; exactly 1 otherwise (x * 1 == x for every x)
  float l2;             // Adam in L2 mode, Adagrad: wd, used only when `use_l2`
  bool use_l2;          // wd != 0 there (torch skips the add when wd == 0)
  Lerp lerp1;           // Adam: exp_avg's update, Lion: the direction; w = 1 - beta1
  Lerp lerp2;           // Lion: exp_avg's update, w = 1 - beta2
  float beta2;          // Adam
  float one_minus_beta2;
  float bc2_sqrt;       // Adam: sqrt(1 - beta2^step), 1 without bias correction
  float eps;            // Adam, Adagrad
  float neg_step;       // Adam: -lr / (1 - beta1^step) (-lr without bias correction);
                        // Adagrad: -clr; Lion: -lr
};

StepConstants make_constants(const HyperParams& hp);

// The memory one update touches; all arrays are indexed by the same element index. A moment
// the rule does not use (kHasExpAvg, kHasExpAvgSq) may be null.
struct Buffers {
  float* param;
  const void* grad;    // grad_dtype elements
  void* exp_avg;       // moment_dtype elements
  void* exp_avg_sq;    // moment_dtype elements
  void* half_out;      // half_dtype elements, or null with kNone
  DType grad_dtype;    // kF32, kBF16 or kF16
  DType half_dtype;    // kNone, kBF16 or kF16
  DType moment_dtype;  // kF32, kBF16 ([Note: bf16 moments]) or kE4M3Block
  float* exp_avg_scales;     // kE4M3Block: the scale of the block of element 0, then the next...
  float* exp_avg_sq_scales;  // ...([Note: 8-bit moments in the kernels]); null otherwise
};

// kE4M3Block ([Note: 8-bit moments in the kernels]), defined in block8.cpp: the scale of a block
// whose largest magnitude, NaN aside, is `top`, and the buffers of the block at element `i`
// (a multiple of kBlock) with its moments in the fp32 arrays `exp_avg` and `exp_avg_sq`.
float e4m3_block_scale(float top, bool has_nan);
Buffers block_buffers(const Buffers& b, size_t i, float* exp_avg, float* exp_avg_sq);

// Updates elements [begin, end) by the rule the constants were made for (c.rule). Every
// implementation gives the same bits.
using KernelFn = void (*)(const StepConstants&, const Buffers&, size_t begin, size_t end);

void update_scalar(const StepConstants& c, const Buffers& b, size_t begin, size_t end);
void update_avx2(const StepConstants& c, const Buffers& b, size_t begin, size_t end);
void update_avx512(const StepConstants& c, const Buffers& b, size_t begin, size_t end);

// The memory roofline of Adam's update, for benchmarks: the same loads and stores as an update
// with fp32 gradients and moments and no half output, one add per array (param, exp_avg and
// exp_avg_sq each += grad) in place of Adam. One per instruction set, as the width of the
// loads and stores changes what a core gets from memory.
using StreamFn = void (*)(const Buffers&, size_t begin, size_t end);

void stream_scalar(const Buffers& b, size_t begin, size_t end);
void stream_avx2(const Buffers& b, size_t begin, size_t end);
void stream_avx512(const Buffers& b, size_t begin, size_t end);

}  // namespace infinity::adam
