#include "updater.h"

#include <algorithm>
#include <atomic>

namespace infinity::adam {
namespace {

// Below this many elements per thread, waking another thread (tens of microseconds) costs more
// than it saves; a 64K-element chunk takes about as long as the wake-up.
constexpr size_t kMinPerThread = size_t{1} << 16;
// About this many chunks per thread: enough to even out a late start, few enough that each is
// a long stream for the prefetchers (2 MB of each array for a 16M-element tensor on 2 threads).
constexpr size_t kChunksPerThread = 16;
// Chunks start on multiples of 64 elements: a whole 256-byte span of every fp32 array and a
// whole 128-byte span of the half-precision ones, so no two threads write the same cache line.
constexpr size_t kSliceAlign = 64;

}  // namespace

template <typename Fn>
void Updater::split(size_t count, int num_threads, const Fn& fn) {
  const size_t max_threads = std::max<size_t>(1, count / kMinPerThread);
  const size_t threads = std::min<size_t>(std::max(num_threads, 1), max_threads);
  if (threads == 1) {
    fn(0, count);
    return;
  }
  // Threads take chunks from a shared counter rather than one fixed slice each: a worker that
  // wakes late, or shares its core for a moment, then does less, and nobody waits for it at
  // the end (+4% at 2 threads against fixed halves).
  size_t chunk = std::max(kMinPerThread, count / (threads * kChunksPerThread));
  chunk = (chunk + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const size_t num_chunks = (count + chunk - 1) / chunk;
  std::atomic<size_t> next{0};
  pool_.run(static_cast<int>(threads), [&](int) {
    for (size_t k = next.fetch_add(1, std::memory_order_relaxed); k < num_chunks;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(k * chunk, std::min(count, (k + 1) * chunk));
    }
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
