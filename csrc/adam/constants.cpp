// Per-step scalars of the update, derived as torch.optim.AdamW derives them in Python: in double
// precision, with Python's `**` (C pow, also for the square root: torch writes
// `bias_correction2 ** 0.5`), then rounded to float when they meet a float tensor.
#include <cmath>

#include "adam.h"

namespace infinity::adam {

StepConstants make_constants(const HyperParams& hp) {
  StepConstants c{};
  const double step = static_cast<double>(hp.step);
  const double bias_correction1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, step) : 1.0;
  const double bias_correction2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, step) : 1.0;
  const bool decay = hp.weight_decay != 0.0;

  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.decay = decay && hp.adamw_mode ? static_cast<float>(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  c.use_l2 = decay && !hp.adamw_mode;
  c.l2 = static_cast<float>(hp.weight_decay);
  c.lerp_w = static_cast<float>(1.0 - hp.beta1);
  c.lerp_small = std::fabs(c.lerp_w) < 0.5f;
  c.lerp_w_minus_1 = c.lerp_w - 1.0f;
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  c.eps = static_cast<float>(hp.eps);
  c.neg_step = static_cast<float>(-(hp.lr / bias_correction1));
  return c;
}

}  // namespace infinity::adam
