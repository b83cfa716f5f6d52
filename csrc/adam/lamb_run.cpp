// LAMB's constants and its two passes over a whole call, on the threads of an Updater
// ([Note: LAMB arithmetic] and [Note: LAMB's sums] in lamb.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "lamb.h"
#include "updater.h"

namespace infinity::adam {
namespace {

// A thread takes this many chunks (64K elements) at a time: about as long as waking a thread
// takes (updater.cpp's kMinPerThread), and long streams for the prefetchers. A multiple of 64
// elements, so no two threads write the same cache line.
constexpr size_t kChunksPerTask = 16;
constexpr size_t kTaskElements = kChunksPerTask * kLambChunk;

LambNormsFn norms_for(Simd simd) {
  switch (simd) {
    case Simd::kAvx512: return &lamb_norms_avx512;
    case Simd::kAvx2: return &lamb_norms_avx2;
    default: return &lamb_norms_scalar;
  }
}

LambApplyFn apply_for(Simd simd) {
  switch (simd) {
    case Simd::kAvx512: return &lamb_apply_avx512;
    case Simd::kAvx2: return &lamb_apply_avx2;
    default: return &lamb_apply_scalar;
  }
}

// Calls fn(begin, end) for the tasks of kTaskElements covering [0, count), each once, on up to
// num_threads threads; which thread runs a task does not change what it computes.
template <typename Fn>
void for_each_task(Updater& updater, size_t count, int num_threads, const Fn& fn) {
  const size_t num_tasks = (count + kTaskElements - 1) / kTaskElements;
  auto run_task = [&](size_t k) {
    fn(k * kTaskElements, std::min(count, (k + 1) * kTaskElements));
  };
  const size_t threads = std::min<size_t>(std::max(num_threads, 1), num_tasks);
  if (threads <= 1) {
    for (size_t k = 0; k < num_tasks; ++k) run_task(k);
    return;
  }
  std::atomic<size_t> next{0};
  updater.run_parallel(static_cast<int>(threads), [&] {
    for (size_t k = next.fetch_add(1, std::memory_order_relaxed); k < num_tasks;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      run_task(k);
    }
  });
}

}  // namespace

LambConstants make_lamb_constants(const LambParams& lp) {
  const double step = static_cast<double>(lp.step);
  // Python's order: lr * (1 - beta2 ** step) ** 0.5 / (1 - beta1 ** step), each `**` C's pow.
  const double step_size =
      lp.bias_correction
          ? lp.lr * std::pow(1.0 - std::pow(lp.beta2, step), 0.5) / (1.0 - std::pow(lp.beta1, step))
          : lp.lr;
  LambConstants c{};
  c.grad_scale = static_cast<float>(lp.grad_scale);
  c.beta1 = static_cast<float>(lp.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - lp.beta1);
  c.beta2 = static_cast<float>(lp.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - lp.beta2);
  c.eps = static_cast<float>(lp.eps);
  c.weight_decay = static_cast<float>(lp.weight_decay);
  c.scale = static_cast<float>(step_size * lp.ratio);
  return c;
}

LambSums lamb_norms(Updater& updater, const LambParams& lp, const Buffers& b, size_t count,
                    int num_threads, Simd simd) {
  const LambConstants c = make_lamb_constants(lp);
  const LambNormsFn kernel = norms_for(simd);
  std::vector<LambSums> chunks((count + kLambChunk - 1) / kLambChunk);
  for_each_task(updater, count, num_threads, [&](size_t begin, size_t end) {
    kernel(c, b, begin, end, chunks.data() + begin / kLambChunk);
  });
  LambSums total{0.0, 0.0};
  for (const LambSums& s : chunks) {
    total.w_sq += s.w_sq;
    total.u_sq += s.u_sq;
  }
  return total;
}

void lamb_apply(Updater& updater, const LambParams& lp, const Buffers& b, size_t count,
                int num_threads, Simd simd) {
  const LambConstants c = make_lamb_constants(lp);
  const LambApplyFn kernel = apply_for(simd);
  for_each_task(updater, count, num_threads,
                [&](size_t begin, size_t end) { kernel(c, b, begin, end); });
}

}  // namespace infinity::adam
