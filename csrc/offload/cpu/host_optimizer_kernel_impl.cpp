// One variant of the host optimizer kernel. The build compiles this file once
// per CPU capability, with CPU_CAPABILITY set to DEFAULT, AVX2 or AVX512 and
// that capability's instruction flags (setup.py, CMakeLists.txt), as ATen
// compiles its own kernels: ATen's Vectorized<float> then is 8 or 16 lanes
// wide, and everything here lives in a namespace named after the capability,
// so the variants never collide. host_optimizer_kernel.cpp picks one at run
// time.
//
// The math mirrors torch.optim's single-tensor Adam/AdamW/SGD operation for
// operation (same constants, same order). It is not bit-identical: ATen's
// kernels and this one may contract a*b+c into an FMA in different places,
// and 1 / (world size x loss scale) is folded into one multiply. Each of those
// moves a value by at most an ulp per step; tests/cpp/test_host_optimizer_kernel.cpp
// states the resulting bound.
#include "zeroshard/host_optimizer_kernel.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#ifndef CPU_CAPABILITY
#error "compile host_optimizer_kernel_impl.cpp with -DCPU_CAPABILITY=DEFAULT|AVX2|AVX512"
#endif

namespace zeroshard::host_kernels {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Elements per parallel task: small tasks cost more in scheduling than they
// gain (ATen's GRAIN_SIZE).
constexpr int64_t kGrainElements = 32768;

struct NoOut {};  // the caller wants no parameter copy

struct AdamConstants {
  Vec grad_scale, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2,
      inv_bias_correction2_sqrt, eps, neg_step_size;
  bool has_weight_decay;
};

AdamConstants adam_constants(const HostAdamArgs& a) {
  // torch.optim computes these in Python floats (double) from a float32 step
  // tensor; ATen then casts each scalar to float for fp32 tensors.
  const double step = static_cast<double>(static_cast<float>(a.step));
  const double bias_correction1 = 1 - std::pow(a.beta1, step);
  const double bias_correction2 = 1 - std::pow(a.beta2, step);
  AdamConstants c;
  c.grad_scale = Vec(a.grad_scale);
  c.decay = Vec(static_cast<float>(1 - a.lr * a.weight_decay));
  c.weight_decay = Vec(static_cast<float>(a.weight_decay));
  c.one_minus_beta1 = Vec(static_cast<float>(1 - a.beta1));
  c.beta2 = Vec(static_cast<float>(a.beta2));
  c.one_minus_beta2 = Vec(static_cast<float>(1 - a.beta2));
  c.inv_bias_correction2_sqrt = Vec(static_cast<float>(1 / std::pow(bias_correction2, 0.5)));
  c.eps = Vec(static_cast<float>(a.eps));
  c.neg_step_size = Vec(static_cast<float>(-(a.lr / bias_correction1)));
  c.has_weight_decay = a.weight_decay != 0;
  return c;
}

// The update of one vector of elements, already loaded. Loads and stores
// are the caller's: it loads a whole chunk before computing, so the loads of
// several vectors are in flight together (the pointers may alias as far as
// the compiler knows, so it would not move a load above an earlier store).
template <bool kAmsgrad, bool kDecoupled>
inline void adam_math(const AdamConstants& c, Vec& param, Vec grad, Vec& exp_avg, Vec& exp_avg_sq,
                      Vec& max_exp_avg_sq) {
  grad = grad * c.grad_scale;
  if (c.has_weight_decay) {
    if constexpr (kDecoupled) {
      param = param * c.decay;  // param.mul_(1 - lr * weight_decay)
    } else {
      grad = at::vec::fmadd(param, c.weight_decay, grad);  // grad.add(param, alpha=wd)
    }
  }
  // exp_avg.lerp_(grad, 1 - beta1): ATen's lerp for a weight below 0.5.
  exp_avg = at::vec::fmadd(c.one_minus_beta1, grad - exp_avg, exp_avg);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  exp_avg_sq = exp_avg_sq * c.beta2;
  exp_avg_sq = exp_avg_sq + c.one_minus_beta2 * grad * grad;
  Vec second = exp_avg_sq;
  if constexpr (kAmsgrad) {
    max_exp_avg_sq = at::vec::maximum(max_exp_avg_sq, exp_avg_sq);
    second = max_exp_avg_sq;
  }
  // denom = (sqrt(v) / sqrt(bias_correction2)) + eps, the division as a
  // multiply by the reciprocal (within an ulp; divisions bound the kernel's
  // speed once the data is in cache); param.addcdiv_(exp_avg, denom,
  // value=-step_size)
  const Vec denom = at::vec::fmadd(second.sqrt(), c.inv_bias_correction2_sqrt, c.eps);
  param = param + c.neg_step_size * exp_avg / denom;
}

// Vectors per chunk: enough loads in flight to keep a core's memory
// pipeline busy; even, for the packed 16-bit stores.
constexpr int64_t kVectors = 8;
constexpr int64_t kChunk = kVectors * kLanes;
constexpr int64_t kPrefetchDistance = 16 * 128;  // elements ahead of the chunk being read

// Writes vectors [0, kVectors) of a chunk (counts[u] elements each) of
// updated parameters.
template <typename Out>
inline void store_param_out(void* out, int64_t offset, const Vec* params, const int64_t* counts) {
  if constexpr (std::is_same_v<Out, float>) {
    float* dst = static_cast<float*>(out) + offset;
    for (int64_t u = 0; u < kVectors && counts[u] > 0; ++u) {
      params[u].store(dst + u * kLanes, counts[u]);
    }
  } else if constexpr (!std::is_same_v<Out, NoOut>) {
    // Rounds to nearest even, as c10::BFloat16(float) and c10::Half(float).
    Out* dst = static_cast<Out*>(out) + offset;
    for (int64_t u = 0; u < kVectors && counts[u] > 0; u += 2) {
      at::vec::convert_from_float<Out>(params[u], params[u + 1])
          .store(dst + u * kLanes, counts[u] + counts[u + 1]);
    }
  }
}

template <typename Out, bool kAmsgrad, bool kDecoupled>
void adam_chunks(const HostAdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  Vec p[kVectors], g[kVectors], m[kVectors], v[kVectors], vmax[kVectors];
  int64_t counts[kVectors];
  for (int64_t i = begin; i < end; i += kChunk) {
    for (int64_t u = 0; u < kVectors; ++u) {
      counts[u] = std::clamp<int64_t>(end - i - u * kLanes, 0, kLanes);
    }
    // Hardware prefetchers track few streams per core; five to seven arrays
    // stream here, so ask for the lines a few chunks ahead explicitly.
    if (i + kPrefetchDistance < end) {
      for (int64_t line = 0; line < kChunk; line += 16) {
        const int64_t ahead = i + kPrefetchDistance + line;
        __builtin_prefetch(a.param + ahead, 1);
        __builtin_prefetch(a.grad + ahead, 0);
        __builtin_prefetch(a.exp_avg + ahead, 1);
        __builtin_prefetch(a.exp_avg_sq + ahead, 1);
      }
    }
    for (int64_t u = 0; u < kVectors; ++u) {
      const int64_t at = i + u * kLanes;
      if (counts[u] == 0) {
        p[u] = g[u] = m[u] = v[u] = vmax[u] = Vec(0.0f);
        continue;
      }
      p[u] = Vec::loadu(a.param + at, counts[u]);
      g[u] = Vec::loadu(a.grad + at, counts[u]);
      m[u] = Vec::loadu(a.exp_avg + at, counts[u]);
      v[u] = Vec::loadu(a.exp_avg_sq + at, counts[u]);
      if constexpr (kAmsgrad) {
        vmax[u] = Vec::loadu(a.max_exp_avg_sq + at, counts[u]);
      }
    }
    for (int64_t u = 0; u < kVectors; ++u) {
      adam_math<kAmsgrad, kDecoupled>(c, p[u], g[u], m[u], v[u], vmax[u]);
    }
    for (int64_t u = 0; u < kVectors && counts[u] > 0; ++u) {
      const int64_t at = i + u * kLanes;
      p[u].store(a.param + at, counts[u]);
      m[u].store(a.exp_avg + at, counts[u]);
      v[u].store(a.exp_avg_sq + at, counts[u]);
      if constexpr (kAmsgrad) {
        vmax[u].store(a.max_exp_avg_sq + at, counts[u]);
      }
    }
    store_param_out<Out>(a.param_out, i, p, counts);
  }
}

template <typename F>
void parallel_over_chunks(int64_t numel, const F& body) {
  const int64_t chunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, kGrainElements / kChunk, [&](int64_t first, int64_t last) {
    body(first * kChunk, std::min(last * kChunk, numel));
  });
}

template <typename Out>
void adam_dispatch_flags(const HostAdamArgs& a, const AdamConstants& c) {
  const bool amsgrad = a.max_exp_avg_sq != nullptr;
  parallel_over_chunks(a.numel, [&](int64_t begin, int64_t end) {
    if (amsgrad && a.decoupled_weight_decay) {
      adam_chunks<Out, true, true>(a, c, begin, end);
    } else if (amsgrad) {
      adam_chunks<Out, true, false>(a, c, begin, end);
    } else if (a.decoupled_weight_decay) {
      adam_chunks<Out, false, true>(a, c, begin, end);
    } else {
      adam_chunks<Out, false, false>(a, c, begin, end);
    }
  });
}

struct SgdConstants {
  Vec grad_scale, weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_weight_decay, has_momentum, nesterov, first_step;
};

inline Vec sgd_lanes(const SgdConstants& c, const HostSgdArgs& a, int64_t offset, int64_t count) {
  Vec param = Vec::loadu(a.param + offset, count);
  Vec grad = Vec::loadu(a.grad + offset, count) * c.grad_scale;
  if (c.has_weight_decay) {
    grad = at::vec::fmadd(param, c.weight_decay, grad);  // grad.add(param, alpha=wd)
  }
  if (c.has_momentum) {
    Vec buffer = grad;  // torch.optim: the buffer starts as a clone of the gradient
    if (!c.first_step) {
      // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
      buffer = at::vec::fmadd(grad, c.one_minus_dampening,
                              Vec::loadu(a.momentum_buffer + offset, count) * c.momentum);
    }
    buffer.store(a.momentum_buffer + offset, count);
    grad = c.nesterov ? at::vec::fmadd(buffer, c.momentum, grad) : buffer;
  }
  param = at::vec::fmadd(grad, c.neg_lr, param);  // param.add_(grad, alpha=-lr)
  param.store(a.param + offset, count);
  return param;
}

template <typename Out>
void sgd_run(const HostSgdArgs& a, const SgdConstants& c) {
  parallel_over_chunks(a.numel, [&](int64_t begin, int64_t end) {
    Vec p[kVectors];
    int64_t counts[kVectors];
    for (int64_t i = begin; i < end; i += kChunk) {
      for (int64_t u = 0; u < kVectors; ++u) {
        counts[u] = std::clamp<int64_t>(end - i - u * kLanes, 0, kLanes);
        p[u] = counts[u] > 0 ? sgd_lanes(c, a, i + u * kLanes, counts[u]) : Vec(0.0f);
      }
      store_param_out<Out>(a.param_out, i, p, counts);
    }
  });
}

template <template <typename> class Run, typename Args, typename Constants>
void with_out_type(const Args& a, const Constants& c) {
  if (a.param_out == nullptr) {
    Run<NoOut>::run(a, c);
  } else if (a.out_dtype == c10::ScalarType::Float) {
    Run<float>::run(a, c);
  } else if (a.out_dtype == c10::ScalarType::BFloat16) {
    Run<c10::BFloat16>::run(a, c);
  } else {
    Run<c10::Half>::run(a, c);
  }
}

template <typename Out>
struct AdamRun {
  static void run(const HostAdamArgs& a, const AdamConstants& c) { adam_dispatch_flags<Out>(a, c); }
};

template <typename Out>
struct SgdRun {
  static void run(const HostSgdArgs& a, const SgdConstants& c) { sgd_run<Out>(a, c); }
};

}  // namespace

void adam_step(const HostAdamArgs& a) { with_out_type<AdamRun>(a, adam_constants(a)); }

void sgd_step(const HostSgdArgs& a) {
  SgdConstants c;
  c.grad_scale = Vec(a.grad_scale);
  c.weight_decay = Vec(static_cast<float>(a.weight_decay));
  c.momentum = Vec(static_cast<float>(a.momentum));
  c.one_minus_dampening = Vec(static_cast<float>(1 - a.dampening));
  c.neg_lr = Vec(static_cast<float>(-a.lr));
  c.has_weight_decay = a.weight_decay != 0;
  c.has_momentum = a.momentum != 0;
  c.nesterov = a.nesterov;
  c.first_step = a.step == 1;
  with_out_type<SgdRun>(a, c);
}

}  // namespace CPU_CAPABILITY
}  // namespace zeroshard::host_kernels
