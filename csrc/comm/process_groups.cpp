#include "zeroshard/process_groups.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <utility>

namespace zeroshard {

ProcessGroups::ProcessGroups(std::unique_ptr<Communicator> shard,
                             std::unique_ptr<Communicator> replica)
    : shard_(std::move(shard)), replica_(std::move(replica)) {
  TORCH_CHECK_VALUE(shard_ != nullptr, "ProcessGroups needs the shard group");
}

void ProcessGroups::set_model_parallel(ModelParallel kind, std::unique_ptr<Communicator> group) {
  model_parallel_kind_ = kind;
  model_parallel_ = std::move(group);
}

const char* ProcessGroups::model_parallel_tag() const {
  return model_parallel_kind_ == ModelParallel::kExpert ? "expert_parallel/" : "tensor_parallel/";
}

int64_t ProcessGroups::data_parallel_world_size() const {
  return shard_->world_size() * (replica_ ? replica_->world_size() : 1);
}

int64_t ProcessGroups::checkpoint_writer_count() const {
  return shard_->world_size() * (model_parallel_ ? model_parallel_->world_size() : 1);
}

int64_t ProcessGroups::checkpoint_rank() const {
  const int64_t model_parallel_rank = model_parallel_ ? model_parallel_->rank() : 0;
  const int64_t replica = replica_ ? replica_->rank() : 0;
  return replica * checkpoint_writer_count() + model_parallel_rank * shard_->world_size() +
         shard_->rank();
}

std::vector<std::string> ProcessGroups::all_gather_among_writers(const std::string& mine,
                                                                 const std::string& tag) const {
  std::vector<std::string> shard_group = all_gather_strings(*shard_, mine, tag);
  if (!model_parallel_) {
    return shard_group;
  }
  // Each shard group's strings travel as one length-prefixed string.
  std::string packed;
  for (const std::string& each : shard_group) {
    packed += std::to_string(each.size()) + ":" + each;
  }
  std::vector<std::string> all;
  for (const std::string& group :
       all_gather_strings(*model_parallel_, packed, model_parallel_tag() + tag)) {
    for (size_t at = 0; at < group.size();) {
      const size_t colon = group.find(':', at);
      const size_t length = std::stoull(group.substr(at, colon - at));
      all.push_back(group.substr(colon + 1, length));
      at = colon + 1 + length;
    }
  }
  return all;
}

std::vector<AgreementGroup> ProcessGroups::scope() const {
  // One node's failure stops every replica; an expert-parallel peer of a
  // failed rank would otherwise wait for it in the next collective until the
  // timeout.
  return {{shard_.get(), "", ""},
          {replica_.get(), "replicas/", "replica"},
          {model_parallel_.get(), model_parallel_tag(),
           model_parallel_kind_ == ModelParallel::kExpert ? "expert-parallel rank"
                                                          : "tensor-parallel rank"}};
}

std::vector<AgreementGroup> ProcessGroups::writers_scope() const {
  std::vector<AgreementGroup> all = scope();
  return {all[0], all[2]};
}

std::vector<Communicator*> ProcessGroups::communicators() const {
  std::vector<Communicator*> present;
  for (const AgreementGroup& group : scope()) {
    if (group.comm != nullptr) {
      present.push_back(group.comm);
    }
  }
  return present;
}

std::string ProcessGroups::agree(const std::string& local_error, const std::string& tag,
                                 const std::vector<AgreementGroup>& scope) const {
  return agree_on_error(scope.empty() ? this->scope() : scope, local_error, tag);
}

std::vector<bool> ProcessGroups::same_on_every_rank(
    const std::vector<int64_t>& values, const std::string& tag,
    const std::vector<AgreementGroup>& scope) const {
  const auto n = static_cast<int64_t>(values.size());
  at::Tensor extremes = at::empty({2 * n}, at::kLong);
  auto* data = extremes.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    data[i] = values[i];
    data[n + i] = ~values[i];
  }
  for (const AgreementGroup& group : scope.empty() ? this->scope() : scope) {
    if (group.comm != nullptr) {
      group.comm->all_reduce_on_host(extremes, c10d::ReduceOp::MAX, group.tag_prefix + tag);
    }
  }
  data = extremes.data_ptr<int64_t>();
  std::vector<bool> same(values.size());
  for (int64_t i = 0; i < n; ++i) {
    same[i] = data[i] == ~data[n + i];
  }
  return same;
}

void ProcessGroups::raise_if_any_failed(const std::string& local_error, const std::string& what,
                                        const std::string& tag) const {
  raise_if_any_rank_failed(scope(), local_error, what, tag);
}

void ProcessGroups::broadcast_across_replicas(at::Tensor& tensor, const std::string& tag) const {
  if (replica_) {
    replica_->broadcast(tensor, /*root=*/0, "replicas/" + tag);
  }
}

void ProcessGroups::max_across_replicas(at::Tensor& tensor, const std::string& tag) const {
  if (replica_) {
    replica_->all_reduce_on_host(tensor, c10d::ReduceOp::MAX, "replicas/" + tag);
  }
}

void ProcessGroups::max_across_model_parallel(at::Tensor& tensor, const std::string& tag) const {
  if (model_parallel_) {
    model_parallel_->all_reduce_on_host(tensor, c10d::ReduceOp::MAX, model_parallel_tag() + tag);
  }
}

}  // namespace zeroshard
