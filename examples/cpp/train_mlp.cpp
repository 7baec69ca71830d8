// A pure C++ LibTorch program training a small MLP with ZeRO-1 on several
// ranks. Launch it with torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT:
//
//   torchrun --nproc_per_node 2 --no-python build/cmake/zeroshard_train_mlp
#include <zeroshard/gloo_process_group.h>
#include <zeroshard/zero_optimizer.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : fallback;
}

}  // namespace

int main() {
  const int rank = std::stoi(env_or("RANK", "0"));
  const int world_size = std::stoi(env_or("WORLD_SIZE", "1"));
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(std::stoi(env_or("MASTER_PORT", "29500")));
  // Under torchrun the agent already serves the store; otherwise rank 0 does.
  store_options.isServer = rank == 0 && env_or("TORCHELASTIC_USE_AGENT_STORE", "") != "True";
  store_options.numWorkers = world_size;
  auto tcp_store =
      c10::make_intrusive<c10d::TCPStore>(env_or("MASTER_ADDR", "127.0.0.1"), store_options);
  auto store = c10::make_intrusive<c10d::PrefixStore>("zeroshard_train_mlp", tcp_store);
  auto group = zeroshard::make_gloo_process_group(store, rank, world_size);

  torch::manual_seed(rank);  // different per rank: ZeroOptimizer broadcasts rank 0's
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::GELU(),
                              torch::nn::Linear(64, 64), torch::nn::GELU(),
                              torch::nn::Linear(64, 1));
  zeroshard::ZeroOptimizer optimizer(model->parameters(), group,
                                     torch::optim::AdamWOptions(3e-3).weight_decay(0.01),
                                     zeroshard::ZeroOptions().stage(1));

  // Each rank draws its own slice of a synthetic regression problem.
  torch::manual_seed(1234);
  const auto w_true = torch::randn({32, 1});
  const int64_t global_batch = 64;
  const int64_t local_batch = global_batch / world_size;
  for (int step = 0; step < 50; ++step) {
    torch::manual_seed(step * 1000 + rank);
    auto x = torch::randn({local_batch, 32});
    auto y = torch::sin(x.matmul(w_true));
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0 && step % 10 == 0) {
      std::cout << "step " << step << " loss " << loss.item<double>() << " step_ms " << ms
                << " optimizer_state_bytes " << optimizer.optimizer_state_bytes() << std::endl;
    }
  }
  return 0;
}
