// Picks, at run time, the instantiation of a kernel loop for one combination of rule, gradient
// type, half-output type, moment type and L2 weight decay, so that none of those choices is a
// branch inside the loop. Each SIMD file instantiates this with its own loop template from an
// anonymous namespace, so no two files share an instantiation ([Note: one definition per
// instruction set] in adam.h).
#pragma once

#include "adam.h"

namespace infinity::adam {

template <template <Rule, DType, DType, DType, bool> class Loop, Rule R, DType G, DType H,
          DType M>
KernelFn select_l2(bool use_l2) {
  if constexpr (R == Rule::kLion) {
    return &Loop<R, G, H, M, false>::run;  // Lion's weight decay is decoupled, never L2
  } else {
    return use_l2 ? &Loop<R, G, H, M, true>::run : &Loop<R, G, H, M, false>::run;
  }
}

template <template <Rule, DType, DType, DType, bool> class Loop, Rule R, DType G, DType H>
KernelFn select_moment(DType moment, bool use_l2) {
  switch (moment) {
    case DType::kBF16: return select_l2<Loop, R, G, H, DType::kBF16>(use_l2);
    case DType::kE4M3Block: return select_l2<Loop, R, G, H, DType::kE4M3Block>(use_l2);
    default: return select_l2<Loop, R, G, H, DType::kF32>(use_l2);
  }
}

template <template <Rule, DType, DType, DType, bool> class Loop, Rule R, DType G>
KernelFn select_half(DType half, DType moment, bool use_l2) {
  switch (half) {
    case DType::kBF16: return select_moment<Loop, R, G, DType::kBF16>(moment, use_l2);
    case DType::kF16: return select_moment<Loop, R, G, DType::kF16>(moment, use_l2);
    default: return select_moment<Loop, R, G, DType::kNone>(moment, use_l2);
  }
}

template <template <Rule, DType, DType, DType, bool> class Loop, Rule R>
KernelFn select_grad(const Buffers& b, bool use_l2) {
  switch (b.grad_dtype) {
    case DType::kBF16: return select_half<Loop, R, DType::kBF16>(b.half_dtype, b.moment_dtype, use_l2);
    case DType::kF16: return select_half<Loop, R, DType::kF16>(b.half_dtype, b.moment_dtype, use_l2);
    default: return select_half<Loop, R, DType::kF32>(b.half_dtype, b.moment_dtype, use_l2);
  }
}

// The loop for the constants' rule and the buffers' element types.
template <template <Rule, DType, DType, DType, bool> class Loop>
KernelFn select_loop(const StepConstants& c, const Buffers& b) {
  switch (c.rule) {
    case Rule::kAdagrad: return select_grad<Loop, Rule::kAdagrad>(b, c.use_l2);
    case Rule::kLion: return select_grad<Loop, Rule::kLion>(b, c.use_l2);
    default: return select_grad<Loop, Rule::kAdam>(b, c.use_l2);
  }
}

}  // namespace infinity::adam
