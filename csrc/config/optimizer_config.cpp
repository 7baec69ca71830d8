// The "optimizer" section of a DeepSpeed config: which optimizer DeepSpeed
// would run, its hyper-parameters with DeepSpeed's defaults, and the LibTorch
// options for it.
#include "config_section.h"
#include "zeroshard/builtin_rule.h"
#include "zeroshard/deepspeed_config.h"
#include "zeroshard/inner_optimizer.h"
#include "zeroshard/muon_rule.h"
#include "zeroshard/text.h"

#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <optional>
#include <string>
#include <tuple>

namespace zeroshard {

using nlohmann::json;
namespace config_detail {
namespace {

// clang-format off
const Keys kOptimizerKeys = {"type", "params", "legacy_fusion"};
// DeepSpeed's own parameters of FusedAdam/CPUAdam (bias_correction, set_grad_none) and of its
// Adam selection (torch_adam, adam_w_mode) besides torch.optim.Adam's.
const Keys kAdamParams = {
    "lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode",
    "bias_correction", "set_grad_none", "max_grad_norm"};
const Keys kSgdParams = {"lr", "momentum", "dampening", "weight_decay", "nesterov"};
// DeepSpeed's Muon (MuonWithAuxAdam): the matrices' half and the auxiliary
// Adam's, with muon_lr / adam_lr over the shared lr.
const Keys kMuonParams = {
    "lr", "momentum", "weight_decay", "ns_method", "muon_lr", "adam_lr", "betas", "eps",
    "adam_w_mode", "torch_adam", "per_head_muon"};
const Keys kSupportedOptimizers = {"Adam", "AdamW", "SGD", "Muon"};
// DeepSpeed's optimizers, and torch.optim classes, which DeepSpeed looks up by name.
const Keys kOtherOptimizers = {
    "Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion", "MuAdam", "MuAdamW",
    "MuSGD", "Adadelta", "Adafactor", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam",
    "RMSprop", "Rprop", "SparseAdam"};
// clang-format on

json read_betas(const Section& params, const json& fallback) {
  const json* betas = params.find("betas");
  if (betas == nullptr) {
    return fallback;
  }
  bool ok = betas->is_array() && betas->size() == 2;
  for (size_t i = 0; ok && i < 2; ++i) {
    const json& beta = (*betas)[i];
    ok = beta.is_number() && beta.get<double>() >= 0 && beta.get<double>() < 1;
  }
  TORCH_CHECK_VALUE(ok, params.path("betas"), " must be a list of two numbers in [0, 1), got ",
                    *betas);
  return json::array({(*betas)[0].get<double>(), (*betas)[1].get<double>()});
}

// [Note: DeepSpeed's Muon]
// DeepSpeed's "Muon" is MuonWithAuxAdam: parameters marked use_muon (by
// default those with two or more dimensions whose name holds neither "embed"
// nor "lm_head") take Muon, the rest an Adam. Its defaults are the ones
// MuonWithAuxAdam writes into each group (lr 0.02, momentum 0.95; Adam lr
// 3e-4, betas (0.9, 0.95), eps 1e-10; weight decay 0), muon_lr / adam_lr over
// the shared lr. The Muon half is torch.optim.Muon with nesterov and the
// "original" lr adjustment (sqrt(max(1, rows / cols))), which is DeepSpeed's
// muon_update; its Newton-Schulz is torch's quintic one (DeepSpeed's
// ns_method "standard"); "gram", DeepSpeed's default, computes the same
// iteration through the Gram matrix for speed (nothing here compares the
// two's values).
void read_muon(const Section& params, DeepSpeedConfig& out) {
  TORCH_CHECK_VALUE(!params.boolean("per_head_muon", false), params.path("per_head_muon"),
                    " = true is not supported yet by zeroshard: each matrix is orthogonalised "
                    "whole; remove it");
  const std::string ns_method = params.string("ns_method", "gram");
  TORCH_CHECK_VALUE(ns_method == "gram" || ns_method == "standard", params.path("ns_method"),
                    " must be \"gram\" or \"standard\", got \"", ns_method, "\"");
  params.boolean("torch_adam", false);  // which Adam kernel DeepSpeed picks: the values agree
  const double weight_decay = params.number("weight_decay", 0, 0);
  const std::optional<double> lr = params.optional_number("lr", 0);
  json muon = json::object();
  muon["lr"] = params.number("muon_lr", lr.value_or(0.02), 0);
  muon["momentum"] = params.number("momentum", 0.95, 0);
  TORCH_CHECK_VALUE(muon["momentum"].get<double>() < 1, params.path("momentum"),
                    " must be in [0, 1), got ", muon["momentum"]);
  muon["weight_decay"] = weight_decay;
  json adam = json::object();
  adam["lr"] = params.number("adam_lr", lr.value_or(3e-4), 0);
  adam["betas"] = read_betas(params, json::array({0.9, 0.95}));
  adam["eps"] = params.number("eps", 1e-10, 0);
  adam["weight_decay"] = weight_decay;
  out.optimizer_type = "Muon";
  out.optimizer_params = json::object();
  out.optimizer_params["lr"] = muon["lr"];
  out.optimizer_params["weight_decay"] = weight_decay;
  out.optimizer_params["muon"] = std::move(muon);
  out.optimizer_params["adam"] = std::move(adam);
  out.optimizer_params["adam_w_mode"] = params.boolean("adam_w_mode", true);
}

}  // namespace

void read_optimizer(const Section& top, DeepSpeedConfig& out) {
  if (!top.has("optimizer")) {
    return;
  }
  const Section optimizer = top.section("optimizer", kOptimizerKeys);
  optimizer.boolean("legacy_fusion", false);
  TORCH_CHECK_VALUE(optimizer.has("type"), "optimizer.type is missing; expected ",
                    quoted_list(kSupportedOptimizers));
  const std::string written = optimizer.string("type", "");
  const std::string type = find_name(written, kSupportedOptimizers);
  if (type.empty()) {
    const std::string other = find_name(written, kOtherOptimizers);
    TORCH_CHECK_VALUE(other.empty(), "optimizer.type = \"", written,
                      "\" is not supported yet by zeroshard; it runs ",
                      quoted_list(kSupportedOptimizers));
    Keys all = kSupportedOptimizers;
    all.insert(all.end(), kOtherOptimizers.begin(), kOtherOptimizers.end());
    TORCH_CHECK_VALUE(false, "optimizer.type = \"", written,
                      "\" is not an optimizer DeepSpeed knows; did you mean \"",
                      closest(written, all), "\"?");
  }

  if (type == "Muon") {
    read_muon(optimizer.section("params", kMuonParams), out);
    return;
  }
  const bool sgd = type == "SGD";
  const Section params = optimizer.section("params", sgd ? kSgdParams : kAdamParams);
  json& resolved = out.optimizer_params;
  resolved = json::object();
  // torch.optim's defaults (inner_optimizer.h), but for weight_decay, whose
  // DeepSpeed default is 0 (FusedAdam, CPUAdam) where torch.optim.AdamW's is 0.01.
  const nlohmann::json defaults =
      inner_optimizer_defaults(sgd ? InnerOptimizerKind::kSGD : InnerOptimizerKind::kAdamW);
  resolved["lr"] = params.number("lr", defaults.at("lr").get<double>(), 0);
  resolved["weight_decay"] = params.number("weight_decay", 0, 0);
  if (sgd) {
    out.optimizer_type = "SGD";
    resolved["momentum"] = params.number("momentum", defaults.at("momentum").get<double>(), 0);
    resolved["dampening"] = params.number("dampening", defaults.at("dampening").get<double>());
    resolved["nesterov"] = params.boolean("nesterov", defaults.at("nesterov").get<bool>());
    TORCH_CHECK_VALUE(
        !resolved["nesterov"].get<bool>() ||
            (resolved["momentum"].get<double>() > 0 && resolved["dampening"].get<double>() == 0),
        "optimizer.params.nesterov needs momentum > 0 and dampening 0 (as "
        "torch.optim.SGD), got momentum ",
        resolved["momentum"], " and dampening ", resolved["dampening"]);
    return;
  }

  TORCH_CHECK_VALUE(!params.has("max_grad_norm"),
                    "optimizer.params.max_grad_norm is not an optimizer parameter in DeepSpeed; "
                    "use the top-level \"gradient_clipping\" instead");
  // DeepSpeed runs "Adam" with decoupled weight decay too unless adam_w_mode is false; see
  // _configure_basic_optimizer in deepspeed/runtime/engine.py.
  const bool torch_adam = params.boolean("torch_adam", false);
  const bool adam_w_mode = params.boolean("adam_w_mode", true);
  const bool adamw = type == "AdamW" || adam_w_mode;
  out.optimizer_type = adamw ? "AdamW" : "Adam";
  // torch_adam hands the params to torch.optim.AdamW, whose weight_decay default is 0.01;
  // DeepSpeed's FusedAdam and CPUAdam default to 0.
  if (torch_adam && adamw && !params.has("weight_decay")) {
    resolved["weight_decay"] = defaults.at("weight_decay");
  }
  resolved["eps"] = params.number("eps", defaults.at("eps").get<double>(), 0);
  resolved["amsgrad"] = params.boolean("amsgrad", defaults.at("amsgrad").get<bool>());
  params.boolean("set_grad_none", true);
  TORCH_CHECK_VALUE(params.boolean("bias_correction", true),
                    "optimizer.params.bias_correction = false is not supported by zeroshard "
                    "(its Adam always corrects bias, as torch.optim.Adam does)");
  resolved["betas"] = read_betas(params, defaults.at("betas"));
}

}  // namespace config_detail

namespace {

// Adam's or AdamW's options from resolved hyper-parameters (lr, betas, eps,
// weight_decay; amsgrad where given): the config's optimizer, or Muon's Adam
// half.
template <typename Options>
std::unique_ptr<Options> adam_options(const json& h) {
  auto options = std::make_unique<Options>(h.at("lr").get<double>());
  options->betas(std::make_tuple(h.at("betas")[0].get<double>(), h.at("betas")[1].get<double>()))
      .eps(h.at("eps").get<double>())
      .weight_decay(h.at("weight_decay").get<double>())
      .amsgrad(h.value("amsgrad", false));
  return options;
}

}  // namespace

std::unique_ptr<torch::optim::OptimizerOptions> make_optimizer_options(
    const DeepSpeedConfig& config) {
  TORCH_CHECK_VALUE(!config.optimizer_type.empty(),
                    "the DeepSpeed config has no \"optimizer\" section; build the optimizer "
                    "options in the program instead");
  TORCH_CHECK_VALUE(config.optimizer_type != "Muon",
                    "optimizer.type \"Muon\" trains two parameter groups (Muon for the hidden "
                    "matrices, Adam for the rest), which one options object cannot describe; in "
                    "C++ call make_optimizer with model->named_parameters().pairs(), or build "
                    "the groups with deepspeed_muon_groups (deepspeed_config.h)");
  const json& p = config.optimizer_params;
  const double lr = p.at("lr").get<double>();
  if (config.optimizer_type == "SGD") {
    auto options = std::make_unique<torch::optim::SGDOptions>(lr);
    options->momentum(p.at("momentum").get<double>())
        .dampening(p.at("dampening").get<double>())
        .weight_decay(p.at("weight_decay").get<double>())
        .nesterov(p.at("nesterov").get<bool>());
    return options;
  }
  if (config.optimizer_type == "AdamW") {
    return adam_options<torch::optim::AdamWOptions>(p);
  }
  TORCH_INTERNAL_ASSERT(config.optimizer_type == "Adam", "unexpected optimizer_type ",
                        config.optimizer_type);
  return adam_options<torch::optim::AdamOptions>(p);
}

bool uses_deepspeed_muon(const std::string& name, int64_t dim) {
  const std::string lowered = lowercase(name);
  return dim >= 2 && lowered.find("embed") == std::string::npos &&
         lowered.find("lm_head") == std::string::npos;
}

std::vector<torch::optim::OptimizerParamGroup> deepspeed_muon_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
    const DeepSpeedConfig& config) {
  TORCH_CHECK_VALUE(config.optimizer_type == "Muon",
                    "deepspeed_muon_groups needs optimizer.type \"Muon\"; the config's is \"",
                    config.optimizer_type, "\"");
  const json& p = config.optimizer_params;
  std::vector<at::Tensor> muon;
  std::vector<at::Tensor> adam;
  for (const auto& [name, param] : named_parameters) {
    if (!uses_deepspeed_muon(name, param.dim())) {
      adam.push_back(param);
      continue;
    }
    TORCH_CHECK_VALUE(param.dim() == 2, "optimizer.type \"Muon\": ", name, " has shape ",
                      param.sizes(),
                      "; zeroshard orthogonalises 2-D parameters only (DeepSpeed reshapes others "
                      "to a matrix). Give it to the Adam half: build the groups yourself with "
                      "MuonOptions().rule_options() and builtin_rule_options(...)");
    muon.push_back(param);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!muon.empty()) {
    const json& h = p.at("muon");
    const RuleOptions options = MuonOptions()
                                    .lr(h.at("lr").get<double>())
                                    .momentum(h.at("momentum").get<double>())
                                    .weight_decay(h.at("weight_decay").get<double>())
                                    .nesterov(true)
                                    .adjust_lr_fn("original")
                                    .rule_options();
    groups.emplace_back(std::move(muon), std::make_unique<RuleOptions>(options));
  }
  if (!adam.empty()) {
    const json& h = p.at("adam");
    const RuleOptions options =
        p.at("adam_w_mode").get<bool>()
            ? builtin_rule_options(*adam_options<torch::optim::AdamWOptions>(h))
            : builtin_rule_options(*adam_options<torch::optim::AdamOptions>(h));
    groups.emplace_back(std::move(adam), std::make_unique<RuleOptions>(options));
  }
  return groups;
}

}  // namespace zeroshard
