// Threads that leave signals to the main thread. Used by both extensions (csrc/adam includes it).
//
// [Note: workers block signals]
// A signal sent to the process is handed by the kernel to any one thread that does not block
// it, and only that thread is woken from a system call. Python runs its handlers in the main
// thread, at its next bytecode: a SIGINT or SIGTERM taken by one of our workers leaves a main
// thread asleep in `time.sleep` or a wait until that call returns by itself (minutes, or
// never). So every worker starts with the asynchronous signals blocked, a mask it inherits from
// the one in force while it is created, and the process's signals reach the main thread. The
// signals a fault raises in the thread itself (SIGSEGV, SIGBUS, ...) stay unblocked: blocking
// them would hide a crash. Each thread is named, so that `top -H` and a debugger tell them apart.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace infinity {

template <class F>
std::thread start_quiet_thread(const char* name, F&& body) {
  sigset_t quiet, before;
  sigfillset(&quiet);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS}) sigdelset(&quiet, s);
  pthread_sigmask(SIG_BLOCK, &quiet, &before);
  struct Restore {
    sigset_t* mask;
    ~Restore() { pthread_sigmask(SIG_SETMASK, mask, nullptr); }
  } restore{&before};
  return std::thread([name, body = std::forward<F>(body)]() mutable {
    pthread_setname_np(pthread_self(), name);  // at most 15 characters
    body();
  });
}

}  // namespace infinity
