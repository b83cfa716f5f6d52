// Python binding of the CPU Adam kernels: infinity._adam. Only this file knows about Python.
// Pointers arrive as integers, checked (device, dtype, contiguity, lengths) by the typed facade
// in infinity/optim/functional.py before they get here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "adam.h"
#include "simd.h"
#include "updater.h"

namespace py = pybind11;
using namespace infinity::adam;

namespace {

Simd resolve_or_throw(const std::string& name) {
  Simd simd;
  std::string why;
  if (!resolve_simd(name, &simd, &why)) throw py::value_error(why);
  return simd;
}

Buffers make_buffers(uintptr_t param, uintptr_t grad, DType grad_dtype, uintptr_t exp_avg,
                     uintptr_t exp_avg_sq, uintptr_t half_out, DType half_dtype) {
  return Buffers{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                 reinterpret_cast<float*>(exp_avg), reinterpret_cast<float*>(exp_avg_sq),
                 reinterpret_cast<void*>(half_out), grad_dtype, half_dtype};
}

}  // namespace

PYBIND11_MODULE(_adam, m) {
  m.doc() = "CPU Adam/AdamW over flat fp32 shards, SIMD path chosen at run time.";

  py::enum_<DType>(m, "DType")
      .value("none", DType::kNone)
      .value("float32", DType::kF32)
      .value("bfloat16", DType::kBF16)
      .value("float16", DType::kF16);

  py::class_<HyperParams>(m, "HyperParams")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       double grad_scale, int64_t step, bool adamw_mode, bool bias_correction) {
             return HyperParams{lr,         beta1, beta2,      eps,           weight_decay,
                                grad_scale, step,  adamw_mode, bias_correction};
           }),
           py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("grad_scale") = 1.0, py::arg("step") = 1,
           py::arg("adamw_mode") = true, py::arg("bias_correction") = true)
      .def_readwrite("lr", &HyperParams::lr)
      .def_readwrite("beta1", &HyperParams::beta1)
      .def_readwrite("beta2", &HyperParams::beta2)
      .def_readwrite("eps", &HyperParams::eps)
      .def_readwrite("weight_decay", &HyperParams::weight_decay)
      .def_readwrite("grad_scale", &HyperParams::grad_scale)
      .def_readwrite("step", &HyperParams::step)
      .def_readwrite("adamw_mode", &HyperParams::adamw_mode)
      .def_readwrite("bias_correction", &HyperParams::bias_correction);

  py::class_<Job>(m, "Job")
      .def(py::init([](const HyperParams& hp, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
                       uintptr_t exp_avg_sq, size_t count, DType grad_dtype, uintptr_t half_out,
                       DType half_dtype) {
             return Job{hp,
                        make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, half_out,
                                     half_dtype),
                        count};
           }),
           py::arg("hyper"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
           py::arg("half_out") = 0, py::arg("half_dtype") = DType::kNone,
           "One tensor of Updater.update_many: the arguments of Updater.update.")
      .def_readonly("count", &Job::count);

  py::class_<Updater>(m, "Updater")
      .def(py::init<bool>(), py::kw_only(), py::arg("borrow_openmp_team") = false,
           "borrow_openmp_team: run on the OpenMP team of the runtime torch loaded, from the "
           "main thread, instead of this Updater's own threads.")
      .def(
          "update",
          [](Updater& u, const HyperParams& hp, uintptr_t param, uintptr_t grad,
             uintptr_t exp_avg, uintptr_t exp_avg_sq, size_t count, DType grad_dtype,
             uintptr_t half_out, DType half_dtype, int num_threads, const std::string& simd) {
            const Simd path = resolve_or_throw(simd);
            const Buffers b = make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq,
                                           half_out, half_dtype);
            py::gil_scoped_release release;
            u.update(hp, b, count, num_threads, path);
          },
          py::arg("hyper"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
          py::arg("half_out") = 0, py::arg("half_dtype") = DType::kNone,
          py::arg("num_threads") = 1, py::arg("simd") = "",
          "Adam step over `count` elements at the given addresses; the GIL is released.")
      .def(
          "update_many",
          [](Updater& u, const std::vector<Job>& jobs, int num_threads, const std::string& simd) {
            const Simd path = resolve_or_throw(simd);
            py::gil_scoped_release release;
            u.update_many(jobs, num_threads, path);
          },
          py::arg("jobs"), py::arg("num_threads") = 1, py::arg("simd") = "",
          "Every job's Adam step in one parallel region; the GIL is released.")
      .def(
          "stream_inplace",
          [](Updater& u, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
             uintptr_t exp_avg_sq, size_t count, int num_threads, const std::string& simd) {
            const Simd path = resolve_or_throw(simd);
            const Buffers b = make_buffers(param, grad, DType::kF32, exp_avg, exp_avg_sq, 0,
                                           DType::kNone);
            py::gil_scoped_release release;
            u.stream(b, count, num_threads, path);
          },
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("count"), py::arg("num_threads") = 1, py::arg("simd") = "",
          "param += grad; exp_avg += grad; exp_avg_sq += grad (fp32): the update's memory "
          "roofline.");

  m.def(
      "available_simd",
      [] {
        std::vector<std::string> names;
        for (Simd s : available_simd()) names.emplace_back(simd_name(s));
        return names;
      },
      "SIMD paths this CPU and OS can run, best first.");
  m.def(
      "resolve_simd", [](const std::string& name) { return simd_name(resolve_or_throw(name)); },
      py::arg("name") = "",
      "The path a call with `simd=name` runs: '' reads INFINITY_SIMD, then picks the best.");
}
