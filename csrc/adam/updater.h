// The object Python owns (infinity._adam.Updater): a thread pool and the way one update is cut
// into per-thread ranges. It holds no optimizer state: the moments live in the caller's
// tensors and the hyper-parameters come with each call, so any number of optimizers (or the
// engine's shards) can share one Updater or use one each.
#pragma once

#include <cstddef>

#include "adam.h"
#include "simd.h"
#include "thread_pool.h"

namespace infinity::adam {

class Updater {
 public:
  // Updates elements [0, count) of the buffers (already offset by the caller) on up to
  // num_threads threads, the calling one included. Blocks until done.
  void update(const HyperParams& hp, const Buffers& buffers, size_t count, int num_threads,
              Simd simd);

  // The roofline kernel (adam.h) over [0, count), split the same way as update().
  void stream(const Buffers& buffers, size_t count, int num_threads, Simd simd);

 private:
  template <typename Fn>
  void split(size_t count, int num_threads, const Fn& fn);

  ThreadPool pool_;
};

}  // namespace infinity::adam
