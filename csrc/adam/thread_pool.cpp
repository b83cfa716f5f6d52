#include "thread_pool.h"

#include "../aio/quiet_thread.h"  // [Note: workers block signals]

#include <unistd.h>

#include <new>

namespace infinity::adam {

void ThreadPool::forget_workers_after_fork() {
  if (workers_.empty() || owner_pid_ == getpid()) return;
  // The parent's threads (and whoever held these locks) are gone in the child: leak their
  // handles rather than join them, and re-create the synchronisation objects.
  new std::vector<std::thread>(std::move(workers_));
  workers_.clear();
  new (&run_mutex_) std::mutex();
  new (&mutex_) std::mutex();
  new (&start_) std::condition_variable();
  new (&done_) std::condition_variable();
  task_ = nullptr;
  num_running_ = 0;
  open_ = false;
  stop_ = false;
}

ThreadPool::~ThreadPool() {
  forget_workers_after_fork();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int ThreadPool::num_workers() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(workers_.size());
}

// [Note: late workers are not waited for]
// On a machine with as many cores as update threads, a worker's core is often busy for a moment
// when the batch starts (the aio threads, the kernel completing I/O), and the scheduler may not
// run the worker for a time slice, milliseconds. A task that shares its work out (the updater's
// chunks, LAMB's tasks) is then done by the threads that did run, but a pool that waited for
// every worker would still wait for the late one to wake, find nothing left and return: 1 ms
// updates of a piece took 3-4 ms in the streaming step's timelines. So a batch closes once the
// caller's own call returns, which is when no work is left to take: workers that start it from
// then on skip it, and the caller waits only for those already inside.
void ThreadPool::run(int num_threads, const std::function<void()>& task) {
  if (num_threads <= 1) {
    task();
    return;
  }
  forget_workers_after_fork();
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owner_pid_ = getpid();
    while (static_cast<int>(workers_.size()) < num_threads - 1) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.push_back(start_quiet_thread("infinity-adam", [this, index] { work(index); }));
    }
    task_ = &task;
    num_threads_ = num_threads;
    open_ = true;
    ++generation_;
  }
  start_.notify_all();
  task();
  std::unique_lock<std::mutex> lock(mutex_);
  open_ = false;
  done_.wait(lock, [this] { return num_running_ == 0; });
  task_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  {
    // A worker started during a run joins that run (if it is still open), not only the next one.
    std::lock_guard<std::mutex> lock(mutex_);
    seen = generation_ - 1;
  }
  for (;;) {
    const std::function<void()>* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= num_threads_ || !open_) continue;  // this batch needs fewer workers, or is done
      task = task_;
      ++num_running_;
    }
    (*task)();
    std::lock_guard<std::mutex> lock(mutex_);
    if (--num_running_ == 0 && !open_) done_.notify_one();
  }
}

}  // namespace infinity::adam
