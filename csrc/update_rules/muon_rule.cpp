#include "zeroshard/muon_rule.h"

#include <ATen/ops/addmm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <memory>

namespace zeroshard {
namespace {

std::string adjust_lr_fn_of(const nlohmann::json& h) {
  const auto it = h.find("adjust_lr_fn");
  return it == h.end() || it->is_null() ? "" : it->get<std::string>();
}

// torch.optim._muon._zeropower_via_newtonschulz, op for op.
at::Tensor zeropower_via_newtonschulz(const at::Tensor& grad, const nlohmann::json& h) {
  const auto coefficients = h.at("ns_coefficients");
  const double a = coefficients.at(0).get<double>();
  const double b = coefficients.at(1).get<double>();
  const double c = coefficients.at(2).get<double>();
  at::Tensor ortho = grad.to(at::kBFloat16);
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) {
    ortho = ortho.t();
  }
  ortho.div_(ortho.norm().clamp_min(h.at("eps").get<double>()));
  for (int64_t step = 0; step < h.at("ns_steps").get<int64_t>(); ++step) {
    const at::Tensor gram = ortho.matmul(ortho.t());
    const at::Tensor gram_update = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    ortho = at::addmm(ortho, gram_update, ortho, /*beta=*/a);
  }
  return tall ? ortho.t() : ortho;
}

// torch.optim._muon._adjust_lr.
double adjusted_lr(double lr, const std::string& fn, at::IntArrayRef shape) {
  const auto rows = static_cast<double>(shape[0]);
  const auto cols = static_cast<double>(shape[1]);
  const double ratio = fn == "match_rms_adamw" ? 0.2 * std::sqrt(std::max(rows, cols))
                                               : std::sqrt(std::max(1.0, rows / cols));
  return lr * ratio;
}

}  // namespace

RuleOptions MuonOptions::rule_options() const {
  nlohmann::json h = {{"lr", lr()},
                      {"weight_decay", weight_decay()},
                      {"momentum", momentum()},
                      {"nesterov", nesterov()},
                      {"ns_coefficients", ns_coefficients()},
                      {"eps", eps()},
                      {"ns_steps", ns_steps()},
                      {"adjust_lr_fn", nullptr}};
  if (!adjust_lr_fn().empty()) {
    h["adjust_lr_fn"] = adjust_lr_fn();
  }
  return RuleOptions(std::make_shared<MuonRule>(), std::move(h));
}

std::vector<std::string> MuonRule::state_names(const nlohmann::json& /*hyperparameters*/) const {
  return {"momentum_buffer"};
}

void MuonRule::validate(const nlohmann::json& h) const {
  for (const char* key : {"lr", "weight_decay", "momentum", "eps"}) {
    TORCH_CHECK_VALUE(h.contains(key) && h.at(key).is_number() && h.at(key).get<double>() >= 0,
                      "Muon's ", key, " must be a number >= 0; got ",
                      h.contains(key) ? h.at(key).dump() : "none");
  }
  TORCH_CHECK_VALUE(h.at("ns_steps").get<int64_t>() < 100,
                    "Number of steps must be less than 100 for computational efficiency");
  TORCH_CHECK_VALUE(h.at("ns_coefficients").size() == 3,
                    "Coefficients must be a tuple of exactly 3 values");
  const std::string fn = adjust_lr_fn_of(h);
  TORCH_CHECK_VALUE(fn.empty() || fn == "original" || fn == "match_rms_adamw",
                    "Adjust learning rate function ", fn, " is not supported");
}

void MuonRule::check_parameter(const std::vector<int64_t>& sizes,
                               const nlohmann::json& /*hyperparameters*/) const {
  TORCH_CHECK_VALUE(sizes.size() == 2,
                    "Muon only supports 2D parameters whereas we found a "
                    "parameter with ",
                    sizes.size(), " dimensions");
}

double MuonRule::update_cost(const std::vector<int64_t>& sizes,
                             const nlohmann::json& /*hyperparameters*/) const {
  if (sizes.size() != 2) {
    return UpdateRule::update_cost(sizes, {});  // refused by check_parameter
  }
  const auto rows = static_cast<double>(sizes[0]);
  const auto cols = static_cast<double>(sizes[1]);
  return rows * cols * std::min(rows, cols);
}

// torch.optim._muon._single_tensor_muon, op for op, on each whole matrix.
void MuonRule::update(const nlohmann::json& h, std::vector<ParameterShard>& shards) {
  const double lr = h.at("lr").get<double>();
  const double weight_decay = h.at("weight_decay").get<double>();
  const double momentum = h.at("momentum").get<double>();
  const bool nesterov = h.at("nesterov").get<bool>();
  const std::string fn = adjust_lr_fn_of(h);
  for (ParameterShard& piece : shards) {
    at::Tensor param = piece.param.view(piece.sizes);
    const at::Tensor grad = piece.grad.view(piece.sizes);
    at::Tensor buffer = piece.states.at(0).view(piece.sizes);  // zeros on the first step
    buffer.lerp_(grad, 1 - momentum);
    const at::Tensor update = nesterov ? grad.lerp(buffer, momentum) : buffer;
    const at::Tensor ortho = zeropower_via_newtonschulz(update, h);
    param.mul_(1 - lr * weight_decay);
    param.add_(ortho, -adjusted_lr(lr, fn, param.sizes()));
  }
}

}  // namespace zeroshard
