// Exact-size, page-aligned host memory owned by a Python object. Python's buffer protocol
// exposes it (torch.frombuffer wraps it without a copy); the memory lives as long as the
// object, so a tensor made from it keeps it alive.
#pragma once

#include <cstddef>
#include <functional>

namespace infinity::aio {

class AlignedBuffer {
 public:
  // Maps `nbytes` (rounded up to whole pages internally) aligned to `alignment`; from 2 MiB up
  // on a huge-page boundary with MADV_HUGEPAGE. huge_pages=false asks for ordinary pages
  // (MADV_NOHUGEPAGE), the control in the huge-page A/B of bench/bench_aio.py --buffers-ab.
  // See [Note: huge pages for I/O buffers].
  AlignedBuffer(size_t nbytes, size_t alignment, bool huge_pages = true);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Page-locks the memory (mlock). Not a speed-up for O_DIRECT into touched pages (see
  // [Note: page-locked even without a GPU] in infinity/io/memory.py). Returns 0 or errno
  // (RLIMIT_MEMLOCK).
  int lock();
  bool locked() const { return locked_; }
  bool huge_pages() const { return huge_; }  // whether huge pages were asked for (the kernel may refuse)
  // Runs once, just before the memory is freed (e.g. cudaHostUnregister).
  void set_release_hook(std::function<void()> hook) { hook_ = std::move(hook); }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  bool locked_ = false;
  bool huge_ = false;
  std::function<void()> hook_;
};

}  // namespace infinity::aio
