#include "zeroshard/error_agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>

namespace zeroshard {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            c10::Device device, const std::string& tag) {
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(device);
  comm.all_reduce_max(length, tag + "_length");
  const int64_t width = length.cpu().item<int64_t>() + 8;
  at::Tensor input = at::zeros({width}, at::kByte);
  const uint64_t size = mine.size();
  std::memcpy(input.data_ptr(), &size, 8);
  std::memcpy(static_cast<char*>(input.data_ptr()) + 8, mine.data(), mine.size());
  input = input.to(device);
  at::Tensor output = at::empty({width * comm.world_size()}, input.options());
  comm.all_gather(output, input, tag).wait();
  output = output.cpu();
  std::vector<std::string> all;
  const char* bytes = static_cast<const char*>(output.data_ptr());
  for (int64_t r = 0; r < comm.world_size(); ++r) {
    uint64_t n = 0;
    std::memcpy(&n, bytes + r * width, 8);
    all.emplace_back(bytes + r * width + 8, n);
  }
  return all;
}

std::string combined_error(const std::vector<std::string>& errors) {
  const auto failed =
      std::count_if(errors.begin(), errors.end(), [](const std::string& e) { return !e.empty(); });
  if (failed == 0) {
    return "";
  }
  std::ostringstream message;
  message << "(" << failed << " of " << errors.size() << " ranks failed): ";
  if (failed == static_cast<int64_t>(errors.size()) &&
      std::all_of(errors.begin(), errors.end(), [&](const auto& e) { return e == errors[0]; })) {
    message << "every rank: " << errors[0];
  } else {
    for (size_t r = 0, listed = 0; r < errors.size(); ++r) {
      if (!errors[r].empty()) {
        message << (listed++ == 0 ? "" : "; ") << "rank " << r << ": " << errors[r];
      }
    }
  }
  return message.str();
}

std::string agree_on_error(const std::vector<AgreementGroup>& scope, const std::string& local_error,
                           c10::Device device, const std::string& tag) {
  // Group after group: what the first group agreed is what this rank brings
  // to the next, so a failure anywhere reaches every rank of every group.
  std::string agreed = local_error;
  for (const AgreementGroup& group : scope) {
    if (group.comm != nullptr) {
      agreed =
          combined_error(all_gather_strings(*group.comm, agreed, device, group.tag_prefix + tag));
    }
  }
  return agreed;
}

void raise_if_any_rank_failed(const std::vector<AgreementGroup>& scope,
                              const std::string& local_error, const std::string& what,
                              c10::Device device, const std::string& tag) {
  const std::string agreed = agree_on_error(scope, local_error, device, tag);
  TORCH_CHECK_VALUE(local_error.empty(), local_error);
  TORCH_CHECK_VALUE(agreed.empty(), "another rank failed to ", what,
                    "; failing here too instead of waiting for it: ", agreed);
}

}  // namespace zeroshard
