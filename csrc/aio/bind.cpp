// Python binding of the I/O engine: infinity._aio. Only this file knows about Python.
// Pointers arrive as integers checked by the typed facade in infinity/io/handle.py.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "aligned_buffer.h"
#include "engine.h"

namespace py = pybind11;
using namespace infinity::aio;

namespace {

Engine* make_engine(size_t block_size, int queue_depth, int thread_count, bool single_submit,
                    bool overlap_events, const std::string& engine, bool use_direct) {
  Config config;
  config.block_size = block_size;
  config.queue_depth = queue_depth;
  config.thread_count = thread_count;
  config.single_submit = single_submit;
  config.overlap_events = overlap_events;
  config.use_direct = use_direct;
  std::string why;
  if (!resolve_engine(engine, &config.engine, &why)) throw py::value_error(why);
  return new Engine(config);
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
  m.doc() = "Asynchronous file I/O by raw syscalls: kernel AIO, io_uring, pread fallback.";

  py::class_<Engine>(m, "Engine")
      .def(py::init(&make_engine), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("thread_count"), py::arg("single_submit"), py::arg("overlap_events"),
           py::arg("engine"), py::arg("use_direct") = true)
      .def_property_readonly("engine",
                             [](const Engine& e) { return engine_name(e.config().engine); })
      .def(
          "submit",
          [](Engine& e, bool write, uintptr_t ptr, size_t nbytes, const std::string& path,
             int64_t offset) {
            bool direct = false;
            int64_t id;
            {
              py::gil_scoped_release release;
              id = e.submit(write ? Op::kWrite : Op::kRead, reinterpret_cast<char*>(ptr), nbytes,
                            path, offset, &direct);
            }
            return py::make_tuple(id, direct);
          },
          py::arg("write"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"), py::arg("offset"),
          "Queues a transfer; returns (id, ok) where ok is False when O_DIRECT was refused and the\n"
          "request fell back to buffered I/O, or (-errno, False) when the file cannot be opened.")
      .def(
          "wait",
          [](Engine& e, uint64_t id) {
            Status status;
            Engine::Wait outcome;
            {
              py::gil_scoped_release release;
              // Signal handlers run while it waits (Ctrl-C, SIGTERM): only in the main thread,
              // where PyErr_CheckSignals runs them; elsewhere it returns 0 at once.
              outcome = e.wait(id, &status, [] {
                py::gil_scoped_acquire gil;
                return PyErr_CheckSignals() != 0;
              });
            }
            if (outcome == Engine::Wait::kInterrupted) throw py::error_already_set();
            if (outcome == Engine::Wait::kUnknown)
              throw py::key_error("unknown or already completed request " + std::to_string(id));
            return py::make_tuple(status.error, status.error_offset, status.finished_s);
          },
          py::arg("id"),
          "Blocks until the request completes; returns (errno or 0, failing offset, time.monotonic()\n"
          "seconds at completion). A signal handler that raises while it waits (KeyboardInterrupt)\n"
          "raises here; the request goes on and can be waited for again.")
      .def("done", &Engine::done, py::arg("id"),
           "Whether the request has completed, so that wait() returns at once (never blocks).")
      .def("pending", &Engine::pending)
      .def("finished_count", &Engine::finished_count,
           "How many requests have completed so far (a poll of done() may skip while it stays).");

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, size_t, bool>(), py::arg("nbytes"), py::arg("alignment") = 4096,
           py::arg("huge_pages") = true)
      .def_property_readonly("ptr",
                             [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &AlignedBuffer::size)
      .def("set_release_hook", &AlignedBuffer::set_release_hook)
      .def("lock", &AlignedBuffer::lock, py::call_guard<py::gil_scoped_release>(),
           "mlock the memory; returns 0 or errno")
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def_property_readonly("huge_pages", &AlignedBuffer::huge_pages)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  m.def(
      "available_engines",
      [] {
        std::vector<std::string> names;
        for (const char* name : {"io_uring", "aio", "psync"}) {
          EngineKind kind;
          std::string why;
          if (resolve_engine(name, &kind, &why)) names.push_back(name);
        }
        return names;
      },
      "Engines this kernel accepts, best first.");
}
