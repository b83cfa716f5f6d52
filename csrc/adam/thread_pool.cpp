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
  num_pending_ = 0;
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

void ThreadPool::run(int num_tasks, const std::function<void(int)>& task) {
  if (num_tasks <= 1) {
    if (num_tasks == 1) task(0);
    return;
  }
  forget_workers_after_fork();
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owner_pid_ = getpid();
    while (static_cast<int>(workers_.size()) < num_tasks - 1) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.push_back(start_quiet_thread("infinity-adam", [this, index] { work(index); }));
    }
    task_ = &task;
    num_tasks_ = num_tasks;
    num_pending_ = num_tasks - 1;
    ++generation_;
  }
  start_.notify_all();
  task(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return num_pending_ == 0; });
  task_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  {
    // A worker started during a run must take part in that run, not wait for the next one.
    std::lock_guard<std::mutex> lock(mutex_);
    seen = generation_ - 1;
  }
  for (;;) {
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= num_tasks_) continue;  // this batch needs fewer workers
      task = task_;
    }
    (*task)(index);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--num_pending_ == 0) done_.notify_one();
  }
}

}  // namespace infinity::adam
