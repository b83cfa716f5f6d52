#include "updater.h"

#include <algorithm>
#include <atomic>

#include "openmp_team.h"

namespace infinity::adam {
namespace {

// Below this many elements per thread, waking another thread (tens of microseconds) costs more
// than it saves; a 64K-element chunk takes about as long as the wake-up.
constexpr size_t kMinPerThread = size_t{1} << 16;
// About this many chunks per thread: enough to even out a late start, few enough that each is
// a long stream for the prefetchers (2 MB of each array for a 16M-element tensor on 2 threads).
constexpr size_t kChunksPerThread = 16;
// Chunks start on multiples of 256 elements of their tensor: a whole block of 8-bit moments,
// whose scale one thread must compute from all of it ([Note: 8-bit moments in the kernels] in
// adam.h), and whole cache lines of every array, so no two threads write the same line.
constexpr size_t kSliceAlign = kBlock;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

template <typename Fn>
void Updater::split(const std::vector<size_t>& counts, int num_threads, const Fn& fn) {
  // The jobs laid end to end, each starting on a multiple of kSliceAlign, so that every chunk
  // boundary (a multiple of the chunk size) falls on a multiple of kSliceAlign of its job.
  std::vector<size_t> starts(counts.size() + 1, 0);
  size_t total = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    starts[j + 1] = starts[j] + round_up(counts[j], kSliceAlign);
    total += counts[j];
  }
  // Every job's elements within [lo, hi) of that layout.
  auto run_range = [&](size_t lo, size_t hi) {
    size_t j = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; j < counts.size() && starts[j] < hi; ++j) {
      const size_t begin = std::max(lo, starts[j]) - starts[j];
      const size_t end = std::min(hi - starts[j], counts[j]);
      if (begin < end) fn(j, begin, end);
    }
  };
  const size_t max_threads = std::max<size_t>(1, total / kMinPerThread);
  const size_t threads = std::min<size_t>(std::max(num_threads, 1), max_threads);
  if (threads == 1) {
    run_range(0, starts.back());
    return;
  }
  // Threads take chunks from a shared counter rather than one fixed slice each: a worker that
  // wakes late, or shares its core for a moment, then does less, and nobody waits for it at
  // the end (+4% at 2 threads against fixed halves).
  const size_t chunk = round_up(std::max(kMinPerThread, total / (threads * kChunksPerThread)),
                                kSliceAlign);
  const size_t num_chunks = (starts.back() + chunk - 1) / chunk;
  std::atomic<size_t> next{0};
  auto take_chunks = [&] {
    for (size_t k = next.fetch_add(1, std::memory_order_relaxed); k < num_chunks;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      run_range(k * chunk, (k + 1) * chunk);
    }
  };
  run_parallel(static_cast<int>(threads), take_chunks);
}

void Updater::run_parallel(int num_threads, const std::function<void()>& task) {
  const OpenMpTeam* team = borrow_openmp_team_ ? OpenMpTeam::for_this_thread() : nullptr;
  if (team != nullptr) {
    using Task = std::function<void()>;
    team->run(num_threads, [](void* f) { (*static_cast<const Task*>(f))(); },
              const_cast<Task*>(&task));
  } else {
    pool_.run(num_threads, task);
  }
}

void Updater::update(const HyperParams& hp, const Buffers& buffers, size_t count,
                     int num_threads, Simd simd) {
  update_many({Job{hp, buffers, count}}, num_threads, simd);
}

void Updater::update_many(const std::vector<Job>& jobs, int num_threads, Simd simd) {
  std::vector<StepConstants> constants;
  std::vector<size_t> counts;
  constants.reserve(jobs.size());
  counts.reserve(jobs.size());
  for (const Job& job : jobs) {
    constants.push_back(make_constants(job.hp));
    counts.push_back(job.count);
  }
  const KernelFn kernel = kernel_for(simd);
  split(counts, num_threads, [&](size_t j, size_t begin, size_t end) {
    kernel(constants[j], jobs[j].buffers, begin, end);
  });
}

void Updater::stream(const Buffers& buffers, size_t count, int num_threads, Simd simd) {
  const StreamFn kernel = stream_for(simd);
  split({count}, num_threads,
        [&](size_t, size_t begin, size_t end) { kernel(buffers, begin, end); });
}

}  // namespace infinity::adam
