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

  // Calls task() on the calling thread and on up to num_threads - 1 workers (started the first
  // time they are needed), for a task that takes its work from a shared source until none is
  // left, so that any one call finishes it: returns once the caller's call has and every worker
  // that started it has; workers that start later skip it ([Note: late workers are not waited
  // for] in thread_pool.cpp). Calls from several threads are served one after the other.
  void run(int num_threads, const std::function<void()>& task);

  int num_workers();

 private:
  void work(int index);  // worker `index` (1-based: the caller is 0) joins the batches that ask for it
  // In a child made by fork() the workers do not exist: forget them (never join them) and
  // start afresh, so the child can run updates and exit.
  void forget_workers_after_fork();

  std::mutex run_mutex_;  // held for a whole run(): one batch of tasks at a time
  std::mutex mutex_;      // guards everything below
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void()>* task_ = nullptr;
  int num_threads_ = 0;
  int num_running_ = 0;       // workers inside the current batch's task
  bool open_ = false;         // workers may still start the current batch
  uint64_t generation_ = 0;   // bumped per batch, so a worker runs each batch once
  bool stop_ = false;
  std::vector<std::thread> workers_;
  int owner_pid_ = -1;  // the process whose threads `workers_` are
};

}  // namespace infinity::adam
