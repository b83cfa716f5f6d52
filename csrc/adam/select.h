// Picks, at run time, the instantiation of a kernel loop for one combination of gradient type,
// half-output type and weight-decay mode, so that none of those choices is a branch inside the
// loop. Each SIMD file instantiates this with its own loop template from an anonymous
// namespace, so no two files share an instantiation ([Note: one definition per instruction
// set] in adam.h).
#pragma once

#include "adam.h"

namespace infinity::adam {

template <template <DType, DType, bool> class Loop, DType G, DType H>
KernelFn select_l2(bool use_l2) {
  return use_l2 ? &Loop<G, H, true>::run : &Loop<G, H, false>::run;
}

template <template <DType, DType, bool> class Loop, DType G>
KernelFn select_half(DType half, bool use_l2) {
  switch (half) {
    case DType::kBF16: return select_l2<Loop, G, DType::kBF16>(use_l2);
    case DType::kF16: return select_l2<Loop, G, DType::kF16>(use_l2);
    default: return select_l2<Loop, G, DType::kNone>(use_l2);
  }
}

template <template <DType, DType, bool> class Loop>
KernelFn select_loop(DType grad, DType half, bool use_l2) {
  switch (grad) {
    case DType::kBF16: return select_half<Loop, DType::kBF16>(half, use_l2);
    case DType::kF16: return select_half<Loop, DType::kF16>(half, use_l2);
    default: return select_half<Loop, DType::kF32>(half, use_l2);
  }
}

}  // namespace infinity::adam
