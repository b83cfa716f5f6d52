// Asynchronous file I/O engine: plain C++17, no Python, no torch.
//
// [Note: request life cycle]
// A request (one buffer, one file, one offset) is cut into `thread_count` contiguous chunks,
// one per worker. Each worker cuts its chunk into pieces of at most `block_size` bytes and keeps
// up to `queue_depth` pieces in flight on its own backend (kernel AIO context or io_uring ring).
// Every completion is checked: a short transfer is continued, an error is kept (first one wins,
// with its errno and file offset) and the request still runs to the end, so that no piece is in
// flight on a buffer the caller may free after wait(). A request is complete when all its chunks
// are; wait(id) blocks on exactly that request.
//
// [Note: O_DIRECT alignment]
// The file offset alignment and buffer alignment are read per file with statx(STATX_DIOALIGN),
// 4096 when the kernel does not say. A request is cut at multiples of the larger of the offset
// alignment and the page size (see [Note: cut at the page] in engine.cpp): the whole pages in
// the middle go through O_DIRECT, the partial pages at an unaligned start or end through a
// second, buffered descriptor. The kernel keeps the two coherent for pages that only one of
// them touches (a direct read writes back dirty pages first, a direct write invalidates them),
// and the page cache merges writes to parts of a page, so two requests that share a page never
// race on a read-modify-write of our own.
// A body whose buffer address is not aligned is bounced through aligned per-worker buffers.
// A file system that refuses O_DIRECT (tmpfs) is served wholly by the buffered descriptor.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace infinity::aio {

enum class Op : uint8_t { kRead, kWrite };

enum class EngineKind : uint8_t { kKernelAio, kIoUring, kPsync };

const char* engine_name(EngineKind kind);
// Parses "aio" | "io_uring" | "psync" | "auto"; "auto" resolves to the best kind this kernel
// offers. Returns false for an unknown name or a kind the kernel refuses.
bool resolve_engine(const std::string& name, EngineKind* out, std::string* why);

struct Config {
  size_t block_size = 1 << 20;
  int queue_depth = 32;
  int thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_direct = true;  // false: every request through the page cache (no O_DIRECT)
  EngineKind engine = EngineKind::kIoUring;
};

// Outcome of one request, filled when it completes.
struct Status {
  int error = 0;           // errno of the first failure, 0 on success
  int64_t error_offset = 0;  // file offset of the piece that failed
  bool direct = true;       // whether O_DIRECT served the aligned body
  double finished_s = 0;    // CLOCK_MONOTONIC seconds when the last piece completed
};

struct Request;

// One chunk of a request handled by one worker: [offset, offset + nbytes) of the file,
// from/to buf. The chunk's pieces are produced lazily by the worker.
struct Chunk {
  std::shared_ptr<Request> request;
  char* buf = nullptr;
  int64_t offset = 0;
  size_t nbytes = 0;
};

// One transfer in flight on a backend.
struct ChunkState;

struct Piece {
  ChunkState* chunk = nullptr;
  int fd = -1;
  char* buf = nullptr;     // where the kernel reads/writes: the caller's memory or a bounce
  char* target = nullptr;  // the caller's memory when bounced (nullptr otherwise)
  int64_t offset = 0;
  size_t nbytes = 0;
  Op op = Op::kRead;
  int bounce_slot = -1;
};

struct Completion {
  Piece* piece;
  int64_t result;  // bytes transferred, or -errno
};

// A kernel interface that moves pieces: kernel AIO, io_uring, or blocking pread/pwrite.
class Backend {
 public:
  virtual ~Backend() = default;
  // Queues `n` pieces (at most 64) and returns how many the kernel took (the first ones), or
  // -errno when it took none. A piece not taken was not sent and never will be: the caller
  // submits it again or fails it. Pieces taken must stay at their addresses until reaped.
  virtual int submit(Piece* const* pieces, int n) = 0;
  // Waits for at least `min_nr` completions; returns how many were written to `out` (at most
  // `max_nr`), or -errno. Every submitted piece completes (with its result or -errno).
  virtual int reap(int min_nr, int max_nr, Completion* out) = 0;
};

// Creates a backend with room for `queue_depth` pieces in flight; nullptr with `why` set when
// the kernel refuses.
std::unique_ptr<Backend> make_backend(EngineKind kind, int queue_depth, std::string* why);

struct Request {
  uint64_t id = 0;
  Op op = Op::kRead;
  std::string path;
  int direct_fd = -1;    // O_DIRECT descriptor, -1 when the file system refuses it
  int buffered_fd = -1;  // plain descriptor for partial pages and the fallback
  size_t mem_align = 4096;  // buffer alignment O_DIRECT needs
  size_t cut_align = 4096;  // where the request is cut: see [Note: cut at the page]

  std::atomic<int> chunks_left{0};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t>* finished_count = nullptr;  // the engine's, counted once `done` is set

  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  Status status;

  ~Request();
  // Keeps the first error; later pieces of a failed request are skipped, not submitted.
  void fail(int err, int64_t offset);
  // Called by a worker when one of its chunks is finished.
  void finish_chunk();
};

class Worker;

class Engine {
 public:
  explicit Engine(const Config& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Opens the file and queues the request; returns its id (> 0), or -errno when the file cannot
  // be opened (nothing is queued then). `direct` tells whether O_DIRECT is in use.
  int64_t submit(Op op, char* buf, size_t nbytes, const std::string& path, int64_t offset,
                 bool* direct);
  enum class Wait : uint8_t { kDone, kInterrupted, kUnknown };
  // Blocks until request `id` completes (kDone, `status` filled). While it waits it asks
  // `interrupted` every few milliseconds; when that says stop, it returns kInterrupted and the
  // request goes on, to be waited for again (so a signal reaches the caller's thread while the
  // disk is slow or stuck). kUnknown if `id` is unknown (already waited for).
  Wait wait(uint64_t id, Status* status, const std::function<bool()>& interrupted = nullptr);
  // Whether request `id` has completed (wait() would not block); false if `id` is unknown.
  bool done(uint64_t id) const;
  // Ids of requests not yet waited for, oldest first.
  std::vector<uint64_t> pending() const;
  // How many requests have completed so far: one that finished after a reading of this count
  // shows in the next, so a caller polling done() over its requests may skip the poll while
  // the count stays the same.
  uint64_t finished_count() const { return finished_.load(std::memory_order_acquire); }

  const Config& config() const { return config_; }

 private:
  std::shared_ptr<Request> find(uint64_t id) const;  // null when unknown

  Config config_;
  std::vector<std::unique_ptr<Worker>> workers_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Request>> requests_;
  uint64_t next_id_ = 1;
  size_t next_worker_ = 0;
  std::atomic<uint64_t> finished_{0};
  int owner_pid_;  // a forked child inherits the object but not the worker threads
};

}  // namespace infinity::aio
