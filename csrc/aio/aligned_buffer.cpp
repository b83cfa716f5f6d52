#include "aligned_buffer.h"

#include <errno.h>
#include <sys/mman.h>

#include <cstdint>
#include <new>

namespace infinity::aio {

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

// [Note: huge pages for I/O buffers]
// The kernel pins the user pages of every O_DIRECT request and builds one scatter-gather entry
// per physically contiguous run. With 4 KiB pages an 8 MiB piece is 2048 pages to pin and as
// many segments as the pages are scattered (this machine's virtio disk takes at most 254 per
// request); with 2 MiB transparent huge pages it is 4 of each. `bench/bench_aio.py
// --buffers-ab` measures our handle both ways (bench/results/aio.md has the figures and what
// they depend on). So buffers of at least one huge page are mapped on a huge-page
// boundary and advised MADV_HUGEPAGE before any page is touched; the kernel may still say no
// (THP "never", fragmentation), and then the memory is simply ordinary pages. Smaller buffers
// stay page-granular so that a pool of small shards does not cost 2 MiB each. Only whole 2 MiB
// inside a mapping can be huge: a buffer of 4,096,000 bytes has one huge page and then ordinary
// ones, so a pool cuts its buffers from one mapping ([Note: one mapping a class] in
// infinity/offload/pool.py).
AlignedBuffer::AlignedBuffer(size_t nbytes, size_t alignment, bool huge_pages) : size_(nbytes) {
  const size_t align = round_up(alignment < kPage ? kPage : alignment, kPage);
  capacity_ = round_up(nbytes == 0 ? 1 : nbytes, kPage);
  huge_ = huge_pages && capacity_ >= kHugePage;
  const size_t boundary = huge_ && align < kHugePage ? kHugePage : align;
  // Over-map by the alignment, then give back the unaligned head and the spare tail.
  const size_t span = capacity_ + boundary - kPage;
  void* mem = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(mem);
  char* start = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(base), boundary));
  if (start > base) munmap(base, static_cast<size_t>(start - base));
  char* end = start + capacity_;
  if (base + span > end) munmap(end, static_cast<size_t>(base + span - end));
  data_ = start;
  // Advice only: failure is harmless. NOHUGEPAGE keeps the control ordinary under THP "always".
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  if (huge_) madvise(data_, capacity_, MADV_HUGEPAGE);
  else if (!huge_pages) madvise(data_, capacity_, MADV_NOHUGEPAGE);
#endif
}

int AlignedBuffer::lock() {
  if (locked_) return 0;
  if (mlock(data_, capacity_) != 0) return errno;
  locked_ = true;
  return 0;
}

AlignedBuffer::~AlignedBuffer() {
  // A destructor must not throw (std::terminate): a hook that fails leaves the memory registered,
  // which matters only to a process that is ending anyway (the failure seen: Python shutting down).
  try {
    if (hook_) hook_();
  } catch (...) {
  }
  if (locked_) munlock(data_, capacity_);
  munmap(data_, capacity_);
}

}  // namespace infinity::aio
