#include "aligned_buffer.h"

#include <errno.h>
#include <sys/mman.h>

#include <cstdlib>
#include <new>

namespace infinity::aio {

AlignedBuffer::AlignedBuffer(size_t nbytes, size_t alignment) : size_(nbytes) {
  size_t page = 4096;
  size_t bytes = (nbytes + page - 1) / page * page;
  if (bytes == 0) bytes = page;
  void* mem = nullptr;
  if (posix_memalign(&mem, alignment < page ? page : alignment, bytes) != 0) throw std::bad_alloc();
  data_ = static_cast<char*>(mem);
  capacity_ = bytes;
}

int AlignedBuffer::lock() {
  if (locked_) return 0;
  if (mlock(data_, capacity_) != 0) return errno;
  locked_ = true;
  return 0;
}

AlignedBuffer::~AlignedBuffer() {
  if (hook_) hook_();
  if (locked_) munlock(data_, capacity_);
  std::free(data_);
}

}  // namespace infinity::aio
