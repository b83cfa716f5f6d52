// Python binding of the CPU optimizer kernels: infinity._adam. Only this file knows about Python.
// Pointers arrive as integers, checked (device, dtype, contiguity, lengths) by the typed facade
// in infinity/optim/functional.py before they get here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "adam.h"
#include "lamb.h"
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

// The scales matter only to kE4M3Block moments ([Note: 8-bit moments in the kernels] in adam.h).
struct Scales {
  uintptr_t exp_avg = 0;
  uintptr_t exp_avg_sq = 0;
};

Buffers make_buffers(uintptr_t param, uintptr_t grad, DType grad_dtype, uintptr_t exp_avg,
                     uintptr_t exp_avg_sq, uintptr_t half_out, DType half_dtype,
                     DType moment_dtype, Scales scales = {}) {
  return Buffers{reinterpret_cast<float*>(param),      reinterpret_cast<const void*>(grad),
                 reinterpret_cast<void*>(exp_avg),     reinterpret_cast<void*>(exp_avg_sq),
                 reinterpret_cast<void*>(half_out),    grad_dtype,
                 half_dtype,                           moment_dtype,
                 reinterpret_cast<float*>(scales.exp_avg), reinterpret_cast<float*>(scales.exp_avg_sq)};
}

// The few things the kernels cannot survive, for callers that bypass the facade: a missing
// buffer of the rule, or a dtype in a slot that does not take it.
Job checked_job(const HyperParams& hp, const Buffers& b, size_t count) {
  auto fail = [](const std::string& what) { throw py::value_error("Job: " + what); };
  const bool exp_avg = hp.rule != Rule::kAdagrad, exp_avg_sq = hp.rule != Rule::kLion;
  if (count > 0 && (b.param == nullptr || b.grad == nullptr)) fail("param and grad are required");
  if (count > 0 && exp_avg && b.exp_avg == nullptr) fail("this rule needs exp_avg");
  if (count > 0 && exp_avg_sq && b.exp_avg_sq == nullptr) fail("this rule needs exp_avg_sq");
  if (b.grad_dtype == DType::kNone) fail("grad_dtype must be float32, bfloat16 or float16");
  if (b.moment_dtype == DType::kNone || b.moment_dtype == DType::kF16) {
    fail("moment_dtype must be float32, bfloat16 or e4m3_block");
  }
  if (b.grad_dtype == DType::kE4M3Block) fail("grad_dtype must be float32, bfloat16 or float16");
  if (count > 0 && b.moment_dtype == DType::kE4M3Block &&
      ((exp_avg && b.exp_avg_scales == nullptr) || (exp_avg_sq && b.exp_avg_sq_scales == nullptr))) {
    fail("e4m3_block moments need their scales");
  }
  if (b.half_dtype == DType::kF32 || b.half_dtype == DType::kE4M3Block) {
    fail("half_dtype must be none, bfloat16 or float16");
  }
  if (count > 0 && b.half_dtype != DType::kNone && b.half_out == nullptr) {
    fail("half_out is required with a half_dtype");
  }
  return Job{hp, b, count};
}

}  // namespace

PYBIND11_MODULE(_adam, m) {
  m.doc() = "CPU Adam/AdamW, Adagrad and Lion over flat fp32 shards, SIMD path chosen at run time.";

  py::enum_<DType>(m, "DType")
      .value("none", DType::kNone)
      .value("float32", DType::kF32)
      .value("bfloat16", DType::kBF16)
      .value("float16", DType::kF16)
      .value("e4m3_block", DType::kE4M3Block);

  py::enum_<Rule>(m, "Rule")
      .value("adam", Rule::kAdam)
      .value("adagrad", Rule::kAdagrad)
      .value("lion", Rule::kLion);

  py::class_<HyperParams>(m, "HyperParams")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       double grad_scale, int64_t step, bool adamw_mode, bool bias_correction,
                       Rule rule, double lr_decay) {
             return HyperParams{lr,         beta1, beta2,      eps,  weight_decay,   grad_scale,
                                step,       adamw_mode, bias_correction, rule, lr_decay};
           }),
           py::kw_only(), py::arg("lr"), py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("grad_scale") = 1.0,
           py::arg("step") = 1, py::arg("adamw_mode") = true, py::arg("bias_correction") = true,
           py::arg("rule") = Rule::kAdam, py::arg("lr_decay") = 0.0)
      .def_readwrite("lr", &HyperParams::lr)
      .def_readwrite("beta1", &HyperParams::beta1)
      .def_readwrite("beta2", &HyperParams::beta2)
      .def_readwrite("eps", &HyperParams::eps)
      .def_readwrite("weight_decay", &HyperParams::weight_decay)
      .def_readwrite("grad_scale", &HyperParams::grad_scale)
      .def_readwrite("step", &HyperParams::step)
      .def_readwrite("adamw_mode", &HyperParams::adamw_mode)
      .def_readwrite("bias_correction", &HyperParams::bias_correction)
      .def_readwrite("rule", &HyperParams::rule)
      .def_readwrite("lr_decay", &HyperParams::lr_decay);

  py::class_<Job>(m, "Job")
      .def(py::init([](const HyperParams& hp, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
                       uintptr_t exp_avg_sq, size_t count, DType grad_dtype, uintptr_t half_out,
                       DType half_dtype, DType moment_dtype, uintptr_t exp_avg_scales,
                       uintptr_t exp_avg_sq_scales) {
             return checked_job(hp,
                                make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq,
                                             half_out, half_dtype, moment_dtype,
                                             Scales{exp_avg_scales, exp_avg_sq_scales}),
                                count);
           }),
           py::arg("hyper"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
           py::arg("half_out") = 0, py::arg("half_dtype") = DType::kNone,
           py::arg("moment_dtype") = DType::kF32, py::arg("exp_avg_scales") = 0,
           py::arg("exp_avg_sq_scales") = 0,
           "One tensor of Updater.update_many: the arguments of Updater.update, and for "
           "e4m3_block moments the address of each one's first scale.")
      .def_readonly("count", &Job::count);

  py::class_<Updater>(m, "Updater")
      .def(py::init<bool>(), py::kw_only(), py::arg("borrow_openmp_team") = false,
           "borrow_openmp_team: run on the OpenMP team of the runtime torch loaded, from the "
           "main thread, instead of this Updater's own threads.")
      .def(
          "update",
          [](Updater& u, const HyperParams& hp, uintptr_t param, uintptr_t grad,
             uintptr_t exp_avg, uintptr_t exp_avg_sq, size_t count, DType grad_dtype,
             uintptr_t half_out, DType half_dtype, int num_threads, const std::string& simd,
             DType moment_dtype) {
            const Simd path = resolve_or_throw(simd);
            const Job job = checked_job(hp,
                                        make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq,
                                                     half_out, half_dtype, moment_dtype),
                                        count);
            py::gil_scoped_release release;
            u.update(job.hp, job.buffers, job.count, num_threads, path);
          },
          py::arg("hyper"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
          py::arg("half_out") = 0, py::arg("half_dtype") = DType::kNone,
          py::arg("num_threads") = 1, py::arg("simd") = "", py::arg("moment_dtype") = DType::kF32,
          "One step of hyper.rule over `count` elements at the given addresses; the GIL is "
          "released.")
      .def(
          "update_many",
          [](Updater& u, const std::vector<Job>& jobs, int num_threads, const std::string& simd) {
            const Simd path = resolve_or_throw(simd);
            py::gil_scoped_release release;
            u.update_many(jobs, num_threads, path);
          },
          py::arg("jobs"), py::arg("num_threads") = 1, py::arg("simd") = "",
          "Every job's step in one parallel region; the GIL is released.")
      .def(
          "stream_inplace",
          [](Updater& u, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
             uintptr_t exp_avg_sq, size_t count, int num_threads, const std::string& simd) {
            const Simd path = resolve_or_throw(simd);
            const Buffers b = make_buffers(param, grad, DType::kF32, exp_avg, exp_avg_sq, 0,
                                           DType::kNone, DType::kF32);
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
  m.def("prefetch_bytes", &prefetch_bytes,
        "How far ahead the kernels prefetch, in bytes of an fp32 stream (0: not at all).");
  m.def("set_prefetch_bytes", &set_prefetch_bytes, py::arg("bytes"),
        "Sets the prefetch distance of every later kernel call, process-wide.");

  // --- LAMB's two passes (lamb.h) ----------------------------------------------------------
  // The buffers of a LAMB call, refused where the kernels could not run on them (the facade,
  // infinity/optim/lamb_kernel.py, checks the tensors before).
  auto lamb_buffers = [](uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                         size_t count, DType grad_dtype, DType moment_dtype, uintptr_t half_out,
                         DType half_dtype) {
    auto fail = [](const std::string& what) { throw py::value_error("lamb: " + what); };
    if (count > 0 && (param == 0 || grad == 0 || exp_avg == 0 || exp_avg_sq == 0)) {
      fail("param, grad, exp_avg and exp_avg_sq are required");
    }
    if (grad_dtype == DType::kNone) fail("grad_dtype must be float32, bfloat16 or float16");
    if (moment_dtype != DType::kF32 && moment_dtype != DType::kBF16) {
      fail("moment_dtype must be float32 or bfloat16");
    }
    if (half_dtype == DType::kF32) fail("half_dtype must be none, bfloat16 or float16");
    if (count > 0 && half_dtype != DType::kNone && half_out == 0) {
      fail("half_out is required with a half_dtype");
    }
    return make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, half_out, half_dtype,
                        moment_dtype);
  };
  m.def(
      "lamb_norms",
      [lamb_buffers](Updater& u, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
                     uintptr_t exp_avg_sq, size_t count, DType grad_dtype, DType moment_dtype,
                     double beta1, double beta2, double eps, double weight_decay,
                     double grad_scale, int num_threads, const std::string& simd) {
        const Simd path = resolve_or_throw(simd);
        const Buffers b = lamb_buffers(param, grad, exp_avg, exp_avg_sq, count, grad_dtype,
                                       moment_dtype, 0, DType::kNone);
        LambParams lp;
        lp.beta1 = beta1, lp.beta2 = beta2, lp.eps = eps, lp.weight_decay = weight_decay;
        lp.grad_scale = grad_scale;
        LambSums sums;
        {
          py::gil_scoped_release release;
          sums = lamb_norms(u, lp, b, count, num_threads, path);
        }
        return py::make_tuple(sums.w_sq, sums.u_sq);
      },
      py::arg("updater"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
      py::arg("moment_dtype") = DType::kF32, py::kw_only(), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale") = 1.0,
      py::arg("num_threads") = 1, py::arg("simd") = "",
      "LAMB's first pass over `count` elements: (sum p^2, sum u^2) in float64, nothing written; "
      "the same sums on every path and thread count. The GIL is released.");
  m.def(
      "lamb_apply",
      [lamb_buffers](Updater& u, uintptr_t param, uintptr_t grad, uintptr_t exp_avg,
                     uintptr_t exp_avg_sq, size_t count, DType grad_dtype, DType moment_dtype,
                     uintptr_t half_out, DType half_dtype, double lr, double beta1, double beta2,
                     double eps, double weight_decay, double grad_scale, int64_t step,
                     bool bias_correction, double ratio, int num_threads, const std::string& simd) {
        const Simd path = resolve_or_throw(simd);
        const Buffers b = lamb_buffers(param, grad, exp_avg, exp_avg_sq, count, grad_dtype,
                                       moment_dtype, half_out, half_dtype);
        const LambParams lp{lr, beta1, beta2, eps, weight_decay, grad_scale, step,
                            bias_correction, ratio};
        py::gil_scoped_release release;
        lamb_apply(u, lp, b, count, num_threads, path);
      },
      py::arg("updater"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("count"), py::arg("grad_dtype"),
      py::arg("moment_dtype") = DType::kF32, py::arg("half_out") = 0,
      py::arg("half_dtype") = DType::kNone, py::kw_only(), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale") = 1.0,
      py::arg("step") = 1, py::arg("bias_correction") = true, py::arg("ratio") = 1.0,
      py::arg("num_threads") = 1, py::arg("simd") = "",
      "LAMB's second pass over `count` elements: p -= float(step_size * ratio) * u, the moments "
      "and the half copy written. The GIL is released.");
}
