#include "openmp_team.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace infinity::adam {
namespace {

std::atomic<bool> forked_child{false};

void mark_forked_child() { forked_child.store(true, std::memory_order_relaxed); }

// Registered when the module is loaded, so that a fork() before the first update counts too.
const bool fork_handler_registered = pthread_atfork(nullptr, nullptr, mark_forked_child) == 0;

bool on_main_thread() { return syscall(SYS_gettid) == getpid(); }

// Collects the paths of loaded objects whose file name is an OpenMP runtime's.
int collect_runtime(struct dl_phdr_info* info, size_t, void* out) {
  const char* path = info->dlpi_name;
  if (path == nullptr || *path == '\0') return 0;
  const char* slash = std::strrchr(path, '/');
  const char* base = slash ? slash + 1 : path;
  for (const char* prefix : {"libgomp", "libiomp", "libomp"}) {
    if (std::strncmp(base, prefix, std::strlen(prefix)) == 0) {
      static_cast<std::vector<std::string>*>(out)->emplace_back(path);
      break;
    }
  }
  return 0;
}

}  // namespace

const OpenMpTeam* OpenMpTeam::find() {
  std::vector<std::string> runtimes;
  dl_iterate_phdr(collect_runtime, &runtimes);
  if (runtimes.size() != 1) return nullptr;
  // RTLD_NOLOAD: a handle on the runtime already there, never a second copy of it.
  void* handle = dlopen(runtimes[0].c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  void* parallel = dlsym(handle, "GOMP_parallel");
  if (parallel == nullptr) return nullptr;
  return new OpenMpTeam(reinterpret_cast<ParallelFn>(parallel));  // kept until the process ends
}

const OpenMpTeam* OpenMpTeam::for_this_thread() {
  if (!fork_handler_registered || forked_child.load(std::memory_order_relaxed) ||
      !on_main_thread()) {
    return nullptr;
  }
  static const OpenMpTeam* const team = find();
  return team;
}

void OpenMpTeam::run(int num_threads, Task task, void* data) const {
  parallel_(task, data, static_cast<unsigned>(num_threads), 0);
}

}  // namespace infinity::adam
