// The three ways pieces reach the kernel. All talk to Linux by raw syscall, so the build needs
// no libaio or liburing package: only the kernel's own UAPI headers that every compiler has.
#include <errno.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>

#include "engine.h"
#include "quiet_thread.h"

namespace infinity::aio {
namespace {

int neg_errno() { return -errno; }

// ---------------------------------------------------------------------------------------------
// Linux kernel AIO (io_setup / io_submit / io_getevents), the interface libaio wraps.
class KernelAio final : public Backend {
 public:
  static std::unique_ptr<Backend> create(int queue_depth, std::string* why) {
    aio_context_t ctx = 0;
    if (syscall(SYS_io_setup, queue_depth, &ctx) < 0) {
      *why = std::string("io_setup: ") + strerror(errno);
      return nullptr;
    }
    return std::unique_ptr<Backend>(new KernelAio(ctx, queue_depth));
  }
  ~KernelAio() override { syscall(SYS_io_destroy, ctx_); }

  int submit(Piece* const* pieces, int n) override {
    struct iocb* ptrs[64];
    n = std::min(n, 64);
    for (int i = 0; i < n; ++i) {
      struct iocb* cb = take_slot();
      std::memset(cb, 0, sizeof(*cb));
      const Piece* p = pieces[i];
      cb->aio_lio_opcode = p->op == Op::kRead ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
      cb->aio_fildes = static_cast<uint32_t>(p->fd);
      cb->aio_buf = reinterpret_cast<uint64_t>(p->buf);
      cb->aio_nbytes = p->nbytes;
      cb->aio_offset = p->offset;
      cb->aio_data = reinterpret_cast<uint64_t>(p);
      ptrs[i] = cb;
    }
    long r;
    do {
      r = syscall(SYS_io_submit, ctx_, n, ptrs);
    } while (r < 0 && errno == EINTR);
    if (r < 0) r = neg_errno();
    // Slots of iocbs the kernel did not take go back to the free list.
    for (int i = std::max<long>(r, 0); i < n; ++i) free_.push_back(ptrs[i]);
    return static_cast<int>(r);
  }

  int reap(int min_nr, int max_nr, Completion* out) override {
    struct io_event events[64];
    max_nr = std::min(max_nr, 64);
    long r;
    do {
      r = syscall(SYS_io_getevents, ctx_, min_nr, max_nr, events, nullptr);
    } while (r < 0 && errno == EINTR);
    if (r < 0) return neg_errno();
    for (long i = 0; i < r; ++i) {
      out[i].piece = reinterpret_cast<Piece*>(events[i].data);
      out[i].result = events[i].res;
      free_.push_back(reinterpret_cast<struct iocb*>(events[i].obj));
    }
    return static_cast<int>(r);
  }

 private:
  KernelAio(aio_context_t ctx, int queue_depth) : ctx_(ctx), slots_(queue_depth) {
    for (auto& s : slots_) free_.push_back(&s);
  }
  struct iocb* take_slot() {
    struct iocb* cb = free_.back();
    free_.pop_back();
    return cb;
  }

  aio_context_t ctx_;
  std::vector<struct iocb> slots_;  // one per piece in flight; the kernel keeps pointers to them
  std::vector<struct iocb*> free_;
};

// ---------------------------------------------------------------------------------------------
// io_uring through io_uring_setup / io_uring_enter and the mmap'ed rings.
class IoUring final : public Backend {
 public:
  static std::unique_ptr<Backend> create(int queue_depth, std::string* why) {
    struct io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    int fd = static_cast<int>(syscall(__NR_io_uring_setup, queue_depth, &params));
    if (fd < 0) {
      *why = std::string("io_uring_setup: ") + strerror(errno);
      return nullptr;
    }
    // IORING_OP_READ/WRITE arrived with the same kernel (5.6) as this feature bit.
    if (!(params.features & IORING_FEAT_RW_CUR_POS)) {
      close(fd);
      *why = "io_uring: kernel older than 5.6 (no IORING_OP_READ)";
      return nullptr;
    }
    std::unique_ptr<IoUring> ring(new IoUring(fd));
    if (!ring->map(params, why)) return nullptr;
    return ring;
  }

  ~IoUring() override {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (cq_ring_ && cq_ring_ != sq_ring_) munmap(cq_ring_, cq_bytes_);
    if (sq_ring_) munmap(sq_ring_, sq_bytes_);
    close(fd_);
  }

  // [Note: a failed submission takes its entries back]
  // Without SQPOLL the kernel consumes submission entries only inside io_uring_enter, and
  // advances the ring's head past each one it takes. So after every submit() the ring holds no
  // entry: what the kernel took is in flight (and completes, with its result or -errno), and
  // what it did not take is taken back by moving the tail back to the head. A failed enter()
  // leaves nothing behind to go out with a later one, pointing at memory the caller has since
  // reused: the caller knows of every piece exactly what happened to it.
  int submit(Piece* const* pieces, int n) override {
    const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    unsigned tail = *sq_tail_;
    n = std::min<int>(n, static_cast<int>(sq_entries_ - (tail - head)));
    for (int i = 0; i < n; ++i) {
      const Piece* p = pieces[i];
      unsigned index = tail & sq_mask_;
      struct io_uring_sqe* sqe = &sqes_[index];
      std::memset(sqe, 0, sizeof(*sqe));
      sqe->opcode = p->op == Op::kRead ? IORING_OP_READ : IORING_OP_WRITE;
      sqe->fd = p->fd;
      sqe->addr = reinterpret_cast<uint64_t>(p->buf);
      sqe->len = static_cast<uint32_t>(p->nbytes);
      sqe->off = static_cast<uint64_t>(p->offset);
      sqe->user_data = reinterpret_cast<uint64_t>(p);
      sq_array_[index] = index;
      ++tail;
    }
    __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
    int r = enter(static_cast<unsigned>(n), 0, 0);
    const unsigned taken = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) - head;
    if (taken < static_cast<unsigned>(n)) __atomic_store_n(sq_tail_, head + taken, __ATOMIC_RELEASE);
    if (taken > 0) return static_cast<int>(taken);
    // EBUSY: completions must be reaped before the kernel takes more; the caller tries again.
    return r == -EBUSY ? -EAGAIN : std::min(r, 0);
  }

  int reap(int min_nr, int max_nr, Completion* out) override {
    int count = drain(max_nr, out);
    while (count < min_nr) {
      int r = enter(0, static_cast<unsigned>(min_nr - count), IORING_ENTER_GETEVENTS);
      if (r < 0 && r != -EAGAIN && r != -EBUSY) return r;
      count += drain(max_nr - count, out + count);
    }
    return count;
  }

 private:
  explicit IoUring(int fd) : fd_(fd) {}

  bool map(const struct io_uring_params& p, std::string* why) {
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ring_ = mmap(nullptr, sq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                    IORING_OFF_SQ_RING);
    if (sq_ring_ == MAP_FAILED) return fail_map(why, &sq_ring_);
    if (single) {
      cq_ring_ = sq_ring_;
    } else {
      cq_ring_ = mmap(nullptr, cq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                      IORING_OFF_CQ_RING);
      if (cq_ring_ == MAP_FAILED) return fail_map(why, &cq_ring_);
    }
    sqes_bytes_ = p.sq_entries * sizeof(struct io_uring_sqe);
    void* sqes = mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      fd_, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) return fail_map(why, &sqes);
    sqes_ = static_cast<struct io_uring_sqe*>(sqes);

    char* sq = static_cast<char*>(sq_ring_);
    char* cq = static_cast<char*>(cq_ring_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_entries_ = p.sq_entries;
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<struct io_uring_cqe*>(cq + p.cq_off.cqes);
    return true;
  }

  bool fail_map(std::string* why, void** slot) {
    *why = std::string("io_uring mmap: ") + strerror(errno);
    *slot = nullptr;
    return false;
  }

  int enter(unsigned to_submit, unsigned min_complete, unsigned flags) {
    for (;;) {
      long r = syscall(__NR_io_uring_enter, fd_, to_submit, min_complete, flags, nullptr, 0);
      if (r >= 0) return static_cast<int>(r);
      if (errno != EINTR) return neg_errno();
    }
  }

  int drain(int max_nr, Completion* out) {
    unsigned head = *cq_head_;
    unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    int count = 0;
    while (head != tail && count < max_nr) {
      const struct io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out[count].piece = reinterpret_cast<Piece*>(cqe.user_data);
      out[count].result = cqe.res;
      ++count;
      ++head;
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return count;
  }

  int fd_;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  struct io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_head_ = nullptr;  // advanced by the kernel past each entry it consumes
  unsigned* sq_tail_ = nullptr;
  unsigned sq_entries_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  struct io_uring_cqe* cqes_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Blocking pread/pwrite on a few helper threads: works on any file and any kernel.
class Psync final : public Backend {
 public:
  explicit Psync(int queue_depth) {
    int n = std::clamp(queue_depth, 1, 8);
    for (int i = 0; i < n; ++i) threads_.push_back(start_quiet_thread("infinity-psync", [this] { run(); }));
  }
  ~Psync() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int submit(Piece* const* pieces, int n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int i = 0; i < n; ++i) todo_.push_back(pieces[i]);
    }
    todo_cv_.notify_all();
    return n;
  }

  int reap(int min_nr, int max_nr, Completion* out) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return static_cast<int>(done_.size()) >= min_nr; });
    int count = 0;
    while (!done_.empty() && count < max_nr) {
      out[count++] = done_.front();
      done_.pop_front();
    }
    return count;
  }

 private:
  void run() {
    for (;;) {
      Piece* p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        todo_cv_.wait(lock, [&] { return stop_ || !todo_.empty(); });
        if (todo_.empty()) return;
        p = todo_.front();
        todo_.pop_front();
      }
      ssize_t r;
      do {
        r = p->op == Op::kRead ? pread(p->fd, p->buf, p->nbytes, p->offset)
                               : pwrite(p->fd, p->buf, p->nbytes, p->offset);
      } while (r < 0 && errno == EINTR);
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back({p, r < 0 ? -static_cast<int64_t>(errno) : r});
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable todo_cv_, done_cv_;
  std::deque<Piece*> todo_;
  std::deque<Completion> done_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

const char* engine_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kKernelAio: return "aio";
    case EngineKind::kIoUring: return "io_uring";
    case EngineKind::kPsync: return "psync";
  }
  return "?";
}

std::unique_ptr<Backend> make_backend(EngineKind kind, int queue_depth, std::string* why) {
  switch (kind) {
    case EngineKind::kKernelAio: return KernelAio::create(queue_depth, why);
    case EngineKind::kIoUring: return IoUring::create(queue_depth, why);
    case EngineKind::kPsync: return std::make_unique<Psync>(queue_depth);
  }
  *why = "unknown engine";
  return nullptr;
}

bool resolve_engine(const std::string& name, EngineKind* out, std::string* why) {
  if (name == "auto") {
    // io_uring first: it also serves buffered files asynchronously, where kernel AIO blocks.
    for (EngineKind kind : {EngineKind::kIoUring, EngineKind::kKernelAio}) {
      std::string ignored;
      if (make_backend(kind, 2, &ignored)) {
        *out = kind;
        return true;
      }
    }
    *out = EngineKind::kPsync;
    return true;
  }
  EngineKind kind;
  if (name == "aio" || name == "libaio") {
    kind = EngineKind::kKernelAio;
  } else if (name == "io_uring") {
    kind = EngineKind::kIoUring;
  } else if (name == "psync") {
    kind = EngineKind::kPsync;
  } else {
    *why = "unknown engine '" + name + "' (expected auto, aio, io_uring or psync)";
    return false;
  }
  if (!make_backend(kind, 2, why)) return false;
  *out = kind;
  return true;
}

}  // namespace infinity::aio
