// A small persistent pool of std::threads for the update kernels.
//
// [Note: not OpenMP]
// This module links no OpenMP runtime: torch ships its own libgomp, and a second OpenMP
// runtime in the same process makes the two fight over cores (each spins its own workers).
// Plain threads that sleep on a condition variable between calls cost nothing while torch
// computes. An Updater may instead borrow the team of the runtime torch loaded ([Note:
// torch's OpenMP team] in openmp_team.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity::adam {

class ThreadPool {
 public:
  ThreadPool() = default;
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Calls task(i) for every i in [0, num_tasks): task 0 on the calling thread, the others on
  // workers (started the first time they are needed), and returns once all have returned.
  // Calls from several threads are served one after the other.
  void run(int num_tasks, const std::function<void(int)>& task);

  int num_workers();

 private:
  void work(int index);  // worker `index` runs task `index` (1-based: task 0 is the caller's)
  // In a child made by fork() the workers do not exist: forget them (never join them) and
  // start afresh, so the child can run updates and exit.
  void forget_workers_after_fork();

  std::mutex run_mutex_;  // held for a whole run(): one batch of tasks at a time
  std::mutex mutex_;      // guards everything below
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(int)>* task_ = nullptr;
  int num_tasks_ = 0;
  int num_pending_ = 0;       // workers that still have to finish the current batch
  uint64_t generation_ = 0;   // bumped per batch, so a worker runs each batch once
  bool stop_ = false;
  std::vector<std::thread> workers_;
  int owner_pid_ = -1;  // the process whose threads `workers_` are
};

}  // namespace infinity::adam
