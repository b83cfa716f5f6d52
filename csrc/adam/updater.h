// The object Python owns (infinity._adam.Updater): the threads an update runs on and the way
// it is cut into per-thread ranges. It holds no optimizer state: the moments live in the
// caller's tensors and the hyper-parameters come with each call, so any number of optimizers
// (or the engine's shards) can share one Updater or use one each.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "adam.h"
#include "simd.h"
#include "thread_pool.h"

namespace infinity::adam {

// One tensor of a batched update: its step's hyper-parameters, its memory (already offset by
// the caller) and how many elements to update.
struct Job {
  HyperParams hp;
  Buffers buffers;
  size_t count;
};

// [Note: one region per batch]
// update_many runs all its jobs in one parallel region: the threads take fixed-size chunks
// of all the tensors, laid end to end, from one counter, so a step over many tensors wakes
// the threads once and waits for the slowest once, instead of once per tensor. The waits
// matter when another process shares the cores: on torch's OpenMP team ([Note: torch's OpenMP
// team] in openmp_team.h) a thread that finishes first spins until one that lost its core
// gets it back, at every end of a region. Measured beside a one-core busy loop, 50M
// parameters in three tensors on 2 cores, as speed relative to torch's fused AdamW in the same
// rounds: one region per tensor on the team 0.94x, one region for all 1.26x (our own pool,
// whose threads sleep while they wait: 1.37x and 1.36x).

class Updater {
 public:
  // borrow_openmp_team: run on the OpenMP team the process already has where it may be
  // used ([Note: torch's OpenMP team] in openmp_team.h), else on this Updater's own pool.
  explicit Updater(bool borrow_openmp_team = false) : borrow_openmp_team_(borrow_openmp_team) {}

  // Updates elements [0, count) of the buffers on up to num_threads threads, the calling one
  // included. Blocks until done.
  void update(const HyperParams& hp, const Buffers& buffers, size_t count, int num_threads,
              Simd simd);

  // Every job's update, in one parallel region ([Note: one region per batch]).
  void update_many(const std::vector<Job>& jobs, int num_threads, Simd simd);

  // The roofline kernel (adam.h) over [0, count), split the same way as update().
  void stream(const Buffers& buffers, size_t count, int num_threads, Simd simd);

  // Calls task() on up to num_threads threads (the calling one among them) of the OpenMP team
  // or this Updater's pool, as the updates run; task() must take its work from a shared source
  // until none is left: a pool worker that starts after the caller's call returned skips it
  // ([Note: late workers are not waited for] in thread_pool.cpp), and the team may give fewer
  // threads. For kernels that cut their work themselves (lamb.h).
  void run_parallel(int num_threads, const std::function<void()>& task);

 private:
  // Calls fn(job, begin, end) over disjoint ranges covering [0, counts[job]) of every job.
  template <typename Fn>
  void split(const std::vector<size_t>& counts, int num_threads, const Fn& fn);

  bool borrow_openmp_team_;
  ThreadPool pool_;
};

}  // namespace infinity::adam
