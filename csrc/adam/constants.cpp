// Per-step scalars of the update, derived as torch.optim derives them in Python: in double
// precision, with Python's `**` (C pow, also for the square root: torch writes
// `bias_correction2 ** 0.5`), then rounded to float when they meet a float tensor.
#include <atomic>
#include <cmath>

#include "adam.h"

namespace infinity::adam {
namespace {

Lerp make_lerp(double one_minus_beta) {
  Lerp l{};
  l.w = static_cast<float>(one_minus_beta);
  l.small = std::fabs(l.w) < 0.5f;
  l.w_minus_1 = l.w - 1.0f;
  return l;
}

std::atomic<size_t> g_prefetch_bytes{kDefaultPrefetchBytes};

}  // namespace

size_t prefetch_bytes() { return g_prefetch_bytes.load(std::memory_order_relaxed); }

void set_prefetch_bytes(size_t bytes) { g_prefetch_bytes.store(bytes, std::memory_order_relaxed); }

StepConstants make_constants(const HyperParams& hp) {
  StepConstants c{};
  const double step = static_cast<double>(hp.step);
  const bool decay = hp.weight_decay != 0.0;
  c.rule = hp.rule;
  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.decay = 1.0f;
  c.l2 = static_cast<float>(hp.weight_decay);
  c.eps = static_cast<float>(hp.eps);
  switch (hp.rule) {
    case Rule::kAdam: {
      const double bias_correction1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, step) : 1.0;
      const double bias_correction2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, step) : 1.0;
      if (decay && hp.adamw_mode) c.decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
      c.use_l2 = decay && !hp.adamw_mode;
      c.lerp1 = make_lerp(1.0 - hp.beta1);
      c.beta2 = static_cast<float>(hp.beta2);
      c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
      c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
      c.neg_step = static_cast<float>(-(hp.lr / bias_correction1));
      break;
    }
    case Rule::kAdagrad:
      // torch: clr = lr / (1 + (step - 1) * lr_decay), then value=-clr meets the tensors.
      c.use_l2 = decay;
      c.neg_step = static_cast<float>(-(hp.lr / (1.0 + (step - 1.0) * hp.lr_decay)));
      break;
    case Rule::kLion:
      if (decay) c.decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
      c.lerp1 = make_lerp(1.0 - hp.beta1);
      c.lerp2 = make_lerp(1.0 - hp.beta2);
      c.neg_step = static_cast<float>(-hp.lr);
      break;
  }
  return c;
}

}  // namespace infinity::adam
