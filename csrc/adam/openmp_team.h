// The OpenMP thread team that torch's CPU operators run on, borrowed for our updates.
//
// [Note: torch's OpenMP team]
// After each parallel region torch's OpenMP workers spin for a while before they sleep
// (libgomp's default wait policy: about 10 ms of a core, measured as this process's CPU time
// during a sleep right after one torch operator). An update that starts on our own pool in
// that window has three busy threads on two cores: an optimizer step over 100M parameters
// right after torch's fused AdamW step took about 10% longer than right after another of
// ours, and the difference went away with OMP_WAIT_POLICY=passive. Running the update on that
// same team, as torch's own kernels do, makes the spinning workers the ones that take our
// chunks.
//
// The team is found at run time, not linked ([Note: not OpenMP] in thread_pool.h): this takes
// GOMP_parallel, the entry point GCC emits for `#pragma omp parallel` (libgomp's; Intel's and
// LLVM's runtimes export it too), from the OpenMP runtime already loaded in the process. It is
// used only
// - from the process's main thread: a team belongs to the thread that starts a parallel
//   region, so torch's is (almost always) the main thread's; from another thread it would be
//   a second team, spinning against the main thread's work where our pool's workers sleep;
// - when exactly one OpenMP runtime is loaded: with two, which one is torch's?
// - never in a child made by fork(): an OpenMP team does not survive fork() (torch's
//   operators hang there too, unless torch.set_num_threads(1)); our pool does.
// Elsewhere, and by default, updates run on the Updater's own pool. The cost: a team's
// threads spin-wait for each other at the end of a region where our pool's sleep, so on cores
// shared with other busy processes a region on the team ends later ([Note: one region per
// batch] in updater.h).
#pragma once

namespace infinity::adam {

class OpenMpTeam {
 public:
  using Task = void (*)(void* data);

  // The team the calling thread may borrow (see the note), else null. Looks for the OpenMP
  // runtime once per process, at the first call from the main thread.
  static const OpenMpTeam* for_this_thread();

  // Runs task(data) on up to num_threads threads of the team (the caller is one of them) and
  // returns once all have returned. The runtime may give fewer threads than asked.
  void run(int num_threads, Task task, void* data) const;

 private:
  using ParallelFn = void (*)(Task, void*, unsigned num_threads, unsigned flags);
  explicit OpenMpTeam(ParallelFn parallel) : parallel_(parallel) {}
  static const OpenMpTeam* find();

  ParallelFn parallel_;
};

}  // namespace infinity::adam
