// Python access to the host optimizer kernel (host_optimizer_kernel.h), for
// the kernel's tests and benchmarks/bench_host_adam.py.
#include "zeroshard/host_optimizer_kernel.h"

#include <torch/csrc/utils/pybind.h>

#include <optional>

namespace py = pybind11;

namespace zeroshard {
namespace {

float* float_data(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                        t.numel() == numel,
                    name, " must be a contiguous float32 CPU tensor of ", numel, " elements; got ",
                    t.scalar_type(), " on ", t.device(), " with ", t.numel());
  return t.data_ptr<float>();
}

void* out_data(const std::optional<at::Tensor>& out, int64_t numel) {
  if (!out) {
    return nullptr;
  }
  TORCH_CHECK_VALUE(out->device().is_cpu() && out->is_contiguous() && out->numel() == numel,
                    "param_out must be a contiguous CPU tensor of ", numel, " elements");
  return out->data_ptr();
}

}  // namespace

void bind_host_kernel(py::module_& m) {
  m.def(
      "host_adam_step",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
         const std::optional<at::Tensor>& param_out, int64_t step, double lr, double beta1,
         double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
         double grad_scale, const std::string& variant) {
        const int64_t n = param.numel();
        HostAdamArgs args;
        args.param = float_data(param, "param", n);
        args.grad = float_data(grad, "grad", n);
        args.exp_avg = float_data(exp_avg, "exp_avg", n);
        args.exp_avg_sq = float_data(exp_avg_sq, "exp_avg_sq", n);
        args.max_exp_avg_sq =
            max_exp_avg_sq ? float_data(*max_exp_avg_sq, "max_exp_avg_sq", n) : nullptr;
        args.param_out = out_data(param_out, n);
        args.out_dtype = param_out ? param_out->scalar_type() : at::kFloat;
        args.numel = n;
        args.step = step;
        args.lr = lr;
        args.beta1 = beta1;
        args.beta2 = beta2;
        args.eps = eps;
        args.weight_decay = weight_decay;
        args.decoupled_weight_decay = decoupled_weight_decay;
        args.grad_scale = static_cast<float>(grad_scale);
        const HostKernelVariant chosen = parse_host_kernel_variant(variant);
        py::gil_scoped_release no_gil;
        host_adam_step(args, chosen);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      // The hyper-parameters have no defaults here: a benchmark states them.
      py::arg("max_exp_avg_sq") = py::none(), py::arg("param_out") = py::none(), py::kw_only(),
      py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("decoupled_weight_decay") = true,
      py::arg("grad_scale") = 1.0, py::arg("variant") = "auto",
      "One fused host Adam/AdamW pass over fp32 CPU tensors (see host_optimizer_kernel.h).");
  m.def(
      "host_sgd_step",
      [](const at::Tensor& param, const at::Tensor& grad,
         const std::optional<at::Tensor>& momentum_buffer,
         const std::optional<at::Tensor>& param_out, int64_t step, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, double grad_scale,
         const std::string& variant) {
        const int64_t n = param.numel();
        HostSgdArgs args;
        args.param = float_data(param, "param", n);
        args.grad = float_data(grad, "grad", n);
        args.momentum_buffer =
            momentum_buffer ? float_data(*momentum_buffer, "momentum_buffer", n) : nullptr;
        args.param_out = out_data(param_out, n);
        args.out_dtype = param_out ? param_out->scalar_type() : at::kFloat;
        args.numel = n;
        args.step = step;
        args.lr = lr;
        args.momentum = momentum;
        args.dampening = dampening;
        args.weight_decay = weight_decay;
        args.nesterov = nesterov;
        args.grad_scale = static_cast<float>(grad_scale);
        const HostKernelVariant chosen = parse_host_kernel_variant(variant);
        py::gil_scoped_release no_gil;
        host_sgd_step(args, chosen);
      },
      py::arg("param"), py::arg("grad"), py::arg("momentum_buffer") = py::none(),
      py::arg("param_out") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"),
      py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
      py::arg("grad_scale") = 1.0, py::arg("variant") = "auto",
      "One fused host SGD pass over fp32 CPU tensors.");
  m.def(
      "host_kernel_variant_supported",
      [](const std::string& name) {
        return host_kernel_variant_supported(parse_host_kernel_variant(name));
      },
      py::arg("variant"));
  m.def("host_kernel_capability", &host_kernel_capability,
        "The CPU capability variant the host kernel runs: DEFAULT, AVX2 or AVX512.");
}

}  // namespace zeroshard
