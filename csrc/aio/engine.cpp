// Request splitting, workers and completion checking. See [Note: request life cycle] and
// [Note: O_DIRECT alignment] in engine.h.
#include "engine.h"
#include "quiet_thread.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace infinity::aio {

namespace {

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
size_t round_down(size_t x, size_t a) { return x / a * a; }
bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// [Note: cut at the page]
// The file offset where O_DIRECT may start or end (stx_dio_offset_align, often the 512-byte
// sector) is not the unit the page cache works in: that is the page. Were a request cut at the
// sector, its buffered head or tail would share a page with its O_DIRECT body. To write part of
// a page that is not cached, the kernel first reads the whole page from disk. While the body's
// direct write is still in flight (more often so on a busy disk) that read returns the old
// bytes of the body's share of the page; the page is dirtied with them, the direct write's
// invalidation cannot drop a dirty page ("Page cache invalidation failure on direct I/O" in the
// kernel log), and writeback later puts the old bytes back over the body: up to a page less one
// sector of it is lost on disk, with no error from the write (a later fsync may see EIO).
// So a request is cut at multiples of max(offset alignment, page size): within one request,
// every page is written either wholly through O_DIRECT or wholly through the page cache. Every
// O_DIRECT piece starts and ends on a page boundary, and so does what follows from the cut:
// chunk boundaries between workers, bounced pieces (same offsets, other memory), and the
// buffered rest of a short direct transfer, whose pages belong to no other piece and whose
// direct part has landed before the rest is submitted.

// Reads the O_DIRECT alignment of an open file and where requests on it are cut (see
// [Note: cut at the page]); false when the file system says it has no O_DIRECT.
bool dio_alignment(int fd, size_t* mem_align, size_t* cut_align) {
  size_t offset_align = 4096;
  *mem_align = 4096;
#ifdef STATX_DIOALIGN
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
    if (stx.stx_dio_offset_align == 0) return false;
    *mem_align = std::max<size_t>(stx.stx_dio_mem_align, 1);
    offset_align = stx.stx_dio_offset_align;
  }
#else
  (void)fd;
#endif
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  *cut_align = std::max(offset_align, page);
  return true;
}

}  // namespace

Request::~Request() {
  if (direct_fd >= 0) close(direct_fd);
  if (buffered_fd >= 0) close(buffered_fd);
}

void Request::fail(int err, int64_t offset) {
  std::lock_guard<std::mutex> lock(mu);
  if (status.error == 0) {
    status.error = err;
    status.error_offset = offset;
  }
  failed.store(true, std::memory_order_release);
}

void Request::finish_chunk() {
  if (chunks_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);  // Python's time.monotonic() reads the same clock
  {
    std::lock_guard<std::mutex> lock(mu);
    status.finished_s = static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
    done = true;
  }
  if (finished_count) finished_count->fetch_add(1, std::memory_order_release);
  done_cv.notify_all();
}

// Pieces of one chunk still to finish; the chunk is done when the count reaches zero.
struct ChunkState {
  std::shared_ptr<Request> request;
  int pieces_left = 0;
};

// [Note: worker loop]
// One thread per worker, one backend each. `ready_` holds pieces cut from queued chunks; up to
// queue_depth of them sit in `slots_` while in flight (the kernel holds their addresses). With
// overlap_events the worker refills the queue after every completion it reaps; without it, it
// submits a batch and reaps the whole batch before the next one.
class Worker {
 public:
  Worker(const Config& config, std::unique_ptr<Backend> backend)
      : config_(config), backend_(std::move(backend)), slots_(config.queue_depth),
        bounce_(config.queue_depth, nullptr) {
    for (int i = config.queue_depth - 1; i >= 0; --i) free_slots_.push_back(i);
    thread_ = start_quiet_thread("infinity-aio", [this] { run(); });  // [Note: workers block signals]
  }

  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    for (char* b : bounce_) std::free(b);
  }

  void enqueue(Chunk chunk) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(chunk));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    std::vector<Completion> completions(config_.queue_depth);
    for (;;) {
      std::deque<Chunk> fresh;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (ready_.empty() && in_flight_ == 0) {
          cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
          if (queue_.empty()) return;  // stopping, and everything queued is done
        }
        fresh.swap(queue_);
      }
      for (Chunk& c : fresh) expand(c);

      if (config_.overlap_events || in_flight_ == 0) submit_ready();
      if (in_flight_ == 0) {
        if (!ready_.empty()) pause();  // the kernel took nothing (EAGAIN): try again shortly
        continue;
      }
      int min_nr = config_.overlap_events ? 1 : in_flight_;
      int n = backend_->reap(min_nr, config_.queue_depth, completions.data());
      if (n < 0) {  // a failed reap: every piece is still the kernel's and completes later
        pause();
        continue;
      }
      for (int i = 0; i < n; ++i) complete(completions[i].piece, completions[i].result);
    }
  }

  // A millisecond's rest before trying the kernel again, so that a refusal that lasts (a full
  // queue, a failing syscall) does not spin a core the compute threads need.
  static void pause() {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, nullptr);
  }

  // Cuts a chunk into pieces: buffered partial pages at an unaligned start or end, and the
  // whole pages between in block_size pieces through O_DIRECT (bounced if the buffer is
  // misaligned). See [Note: cut at the page].
  void expand(Chunk& c) {
    Request& r = *c.request;
    auto* state = new ChunkState{c.request, 0};
    auto add = [&](int fd, int64_t off, size_t n, bool bounce) {
      Piece p;
      p.chunk = state;
      p.fd = fd;
      p.op = r.op;
      p.offset = off;
      p.nbytes = n;
      p.buf = c.buf + (off - c.offset);
      if (bounce) p.target = p.buf;
      ready_.push_back(p);
      ++state->pieces_left;
    };
    const size_t begin = static_cast<size_t>(c.offset);
    const size_t end = begin + c.nbytes;
    if (r.direct_fd < 0) {
      for (size_t off = begin; off < end; off += config_.block_size)
        add(r.buffered_fd, off, std::min(config_.block_size, end - off), false);
    } else {
      const size_t a = r.cut_align;
      const size_t block = round_up(config_.block_size, a);
      const size_t body_begin = std::min(round_up(begin, a), end);
      const size_t body_end = std::max(round_down(end, a), body_begin);
      if (body_begin > begin) add(r.buffered_fd, begin, body_begin - begin, false);
      const bool bounce = !aligned(c.buf + (body_begin - begin), r.mem_align);
      for (size_t off = body_begin; off < body_end; off += block)
        add(r.direct_fd, off, std::min(block, body_end - off), bounce);
      if (end > body_end) add(r.buffered_fd, body_end, end - body_end, false);
    }
    if (state->pieces_left == 0) finish(state);
  }

  void submit_ready() {
    while (!ready_.empty() && !free_slots_.empty()) {
      Piece* batch[64];
      int n = 0;
      const int limit = config_.single_submit ? 1 : 64;
      while (n < limit && !ready_.empty() && !free_slots_.empty()) {
        Piece p = ready_.front();
        ready_.pop_front();
        if (p.chunk->request->failed.load(std::memory_order_acquire)) {
          done(p);  // the request already failed: its remaining pieces are not worth doing
          continue;
        }
        int slot = free_slots_.back();
        free_slots_.pop_back();
        Piece* s = &slots_[slot];
        *s = p;
        if (s->target) attach_bounce(s, slot);
        batch[n++] = s;
      }
      if (n == 0) continue;
      int taken = backend_->submit(batch, n);  // what it did not take was not sent
      if (taken < 0) {
        if (taken == -EAGAIN || taken == -EINTR) taken = 0;
        else {  // the submission failed: its pieces fail, once, and their slots are free
          for (int i = 0; i < n; ++i) {
            batch[i]->chunk->request->fail(-taken, batch[i]->offset);
            release(batch[i]);
          }
          continue;
        }
      }
      in_flight_ += taken;
      // What the kernel did not take goes back to the front, in order, for the next round.
      for (int i = n - 1; i >= taken; --i) {
        Piece p = *batch[i];
        release_slot(batch[i]);
        if (p.target) p.buf = p.target;
        ready_.push_front(p);
      }
      if (taken < n) return;
    }
  }

  void attach_bounce(Piece* p, int slot) {
    if (!bounce_[slot]) {
      void* mem = nullptr;
      // Pieces are block_size rounded up to the cut alignment (<= 64 KiB in practice).
      size_t bytes = round_up(config_.block_size, 65536);
      if (posix_memalign(&mem, 4096, bytes) != 0) std::abort();
      bounce_[slot] = static_cast<char*>(mem);
    }
    p->buf = bounce_[slot];
    p->bounce_slot = slot;
    if (p->op == Op::kWrite) std::memcpy(p->buf, p->target, p->nbytes);
  }

  void complete(Piece* p, int64_t result) {
    --in_flight_;
    Request& r = *p->chunk->request;
    if (result == -EINTR || result == -EAGAIN) {
      retry(p, 0);
      return;
    }
    if (result < 0) {
      r.fail(static_cast<int>(-result), p->offset);
      release(p);
      return;
    }
    size_t moved = static_cast<size_t>(result);
    if (p->target && p->op == Op::kRead) std::memcpy(p->target, p->buf, moved);
    if (moved == 0 && p->nbytes > 0) {
      // A read that returns 0 bytes hit the end of the file; a write that moves nothing is
      // a device refusing without an errno.
      r.fail(p->op == Op::kRead ? ENODATA : EIO, p->offset);
      release(p);
    } else if (moved < p->nbytes) {
      retry(p, moved);
    } else {
      release(p);
    }
  }

  // Continues a piece after `moved` bytes. The remainder of a short O_DIRECT transfer is rarely
  // aligned, so it goes through the buffered descriptor. That shares at most one page with the
  // direct part, which has completed by now, and no page with any other piece, so no page is
  // ever written both ways at once (see [Note: cut at the page]).
  void retry(Piece* p, size_t moved) {
    Piece next = *p;
    char* user = p->target ? p->target : p->buf;
    next.offset += static_cast<int64_t>(moved);
    next.nbytes -= moved;
    next.buf = user + moved;
    next.target = nullptr;
    next.bounce_slot = -1;
    if (moved > 0) next.fd = p->chunk->request->buffered_fd;
    else if (p->target) next.target = next.buf;
    release_slot(p);
    ready_.push_front(next);
  }

  void release(Piece* p) {
    Piece copy = *p;
    release_slot(p);
    done(copy);
  }

  void release_slot(Piece* p) {
    free_slots_.push_back(static_cast<int>(p - slots_.data()));
  }

  void done(const Piece& p) {
    if (--p.chunk->pieces_left == 0) finish(p.chunk);
  }

  void finish(ChunkState* state) {
    std::shared_ptr<Request> request = std::move(state->request);
    delete state;
    request->finish_chunk();
  }

  const Config config_;
  std::unique_ptr<Backend> backend_;
  std::vector<Piece> slots_;        // pieces in flight; the kernel holds their addresses
  std::vector<int> free_slots_;
  std::vector<char*> bounce_;       // one aligned block per slot, allocated on first use
  std::deque<Piece> ready_;         // cut, not yet submitted
  int in_flight_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> queue_;
  bool stop_ = false;
  std::thread thread_;
};

Engine::Engine(const Config& config) : config_(config), owner_pid_(getpid()) {
  for (int i = 0; i < config_.thread_count; ++i) {
    std::string why;
    auto backend = make_backend(config_.engine, config_.queue_depth, &why);
    if (!backend) throw std::runtime_error(why);
    workers_.push_back(std::make_unique<Worker>(config_, std::move(backend)));
  }
}

Engine::~Engine() {
  if (getpid() != owner_pid_) {
    // In a forked child the workers' threads do not exist: joining them would fail. Leak the
    // objects; the child's memory goes away with it.
    for (auto& w : workers_) w.release();
    return;
  }
  workers_.clear();  // each worker drains its queue before joining
}

int64_t Engine::submit(Op op, char* buf, size_t nbytes, const std::string& path, int64_t offset,
                       bool* direct) {
  auto req = std::make_shared<Request>();
  req->finished_count = &finished_;
  req->op = op;
  req->path = path;
  int flags = op == Op::kRead ? O_RDONLY : (O_WRONLY | O_CREAT);
  req->buffered_fd = open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (req->buffered_fd < 0) return -errno;
  // A directory opens for reading (and then refuses O_DIRECT, which would read as a file system
  // without it); for writing, open() itself refuses it with EISDIR. Refused here alike.
  struct stat st;
  if (fstat(req->buffered_fd, &st) == 0 && S_ISDIR(st.st_mode)) return -EISDIR;
  if (config_.use_direct) {
    req->direct_fd = open(path.c_str(), (flags & ~O_CREAT) | O_DIRECT | O_CLOEXEC);
    if (req->direct_fd < 0) {
      if (errno != EINVAL) return -errno;  // EINVAL: the file system refuses O_DIRECT
    } else if (!dio_alignment(req->direct_fd, &req->mem_align, &req->cut_align)) {
      close(req->direct_fd);
      req->direct_fd = -1;
    }
  }
  // Reported back so that the caller can warn once about a fallback it did not ask for.
  *direct = req->direct_fd >= 0 || !config_.use_direct;
  req->status.direct = *direct;

  // Contiguous chunks, one per worker, cut on block boundaries (multiples of the cut alignment)
  // so that only the first and last chunk can hold partial pages.
  const size_t workers = workers_.size();
  const size_t block = round_up(config_.block_size, req->cut_align);
  const size_t start = static_cast<size_t>(offset);
  const size_t aligned_start = std::min(round_up(start, req->cut_align), start + nbytes);
  const size_t per_worker = round_up((nbytes + workers - 1) / workers, block);
  std::vector<Chunk> chunks;
  size_t from = start;
  while (from < start + nbytes || chunks.empty()) {
    size_t to = std::min(aligned_start + (chunks.size() + 1) * per_worker, start + nbytes);
    chunks.push_back({req, buf + (from - start), static_cast<int64_t>(from), to - from});
    from = to;
  }
  req->chunks_left.store(static_cast<int>(chunks.size()));

  size_t first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    req->id = next_id_++;
    requests_[req->id] = req;
    first = next_worker_;
    next_worker_ = (next_worker_ + 1) % workers;
  }
  for (size_t i = 0; i < chunks.size(); ++i)
    workers_[(first + i) % workers]->enqueue(std::move(chunks[i]));
  return static_cast<int64_t>(req->id);
}

std::shared_ptr<Request> Engine::find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second;
}

Engine::Wait Engine::wait(uint64_t id, Status* status, const std::function<bool()>& interrupted) {
  std::shared_ptr<Request> req = find(id);
  if (!req) return Wait::kUnknown;
  {
    std::unique_lock<std::mutex> lock(req->mu);
    while (!req->done_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return req->done; })) {
      if (!interrupted) continue;
      lock.unlock();  // the check may take other locks (Python's)
      const bool stop = interrupted();
      lock.lock();
      if (stop && !req->done) return Wait::kInterrupted;
    }
    *status = req->status;
  }
  std::lock_guard<std::mutex> lock(mu_);
  requests_.erase(id);
  return Wait::kDone;
}

bool Engine::done(uint64_t id) const {
  std::shared_ptr<Request> req = find(id);
  if (!req) return false;
  std::lock_guard<std::mutex> lock(req->mu);
  return req->done;
}

std::vector<uint64_t> Engine::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  ids.reserve(requests_.size());
  for (const auto& kv : requests_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace infinity::aio
