#include "updater.h"

#include <algorithm>

namespace infinity::adam {
namespace {

// Below this many elements per thread, waking another thread (tens of microseconds) costs more
// than it saves; a 64K-element slice takes about as long as the wake-up.
constexpr size_t kMinPerThread = size_t{1} << 16;
// Slices start on multiples of 64 elements: a whole 256-byte span of every fp32 array and a
// whole 128-byte span of the half-precision ones, so no two threads write the same cache line.
constexpr size_t kSliceAlign = 64;

}  // namespace

template <typename Fn>
void Updater::split(size_t count, int num_threads, const Fn& fn) {
  const size_t max_threads = std::max<size_t>(1, count / kMinPerThread);
  const size_t threads = std::min<size_t>(std::max(num_threads, 1), max_threads);
  size_t per = (count + threads - 1) / threads;
  per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const int num_tasks = static_cast<int>((count + per - 1) / per);
  pool_.run(num_tasks, [&](int task) {
    const size_t begin = static_cast<size_t>(task) * per;
    fn(begin, std::min(count, begin + per));
  });
}

void Updater::update(const HyperParams& hp, const Buffers& buffers, size_t count,
                     int num_threads, Simd simd) {
  if (count == 0) return;
  const StepConstants constants = make_constants(hp);
  const KernelFn kernel = kernel_for(simd);
  split(count, num_threads,
        [&](size_t begin, size_t end) { kernel(constants, buffers, begin, end); });
}

void Updater::stream(const Buffers& buffers, size_t count, int num_threads, Simd simd) {
  if (count == 0) return;
  const StreamFn kernel = stream_for(simd);
  split(count, num_threads, [&](size_t begin, size_t end) { kernel(buffers, begin, end); });
}

}  // namespace infinity::adam
