// The process groups one optimizer talks over, each named for what it is, and
// the agreements that span them: the one owner of the shard, replica and
// model-parallel communicators. Every rank-numbering fact that involves more
// than one group (the data-parallel world, a rank's number in checkpoints,
// which ranks write them) is answered here and nowhere else.
#pragma once

#include "zeroshard/communicator.h"
#include "zeroshard/error_agreement.h"
#include "zeroshard/model_parallel.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

class ProcessGroups {
 public:
  // `shard`: ZeRO's data-parallel group (required); `replica`: hybrid
  // sharding's replicate group (the ranks holding the same shard), or null.
  ProcessGroups(std::unique_ptr<Communicator> shard, std::unique_ptr<Communicator> replica);

  Communicator& shard() const { return *shard_; }
  Communicator* replica() const { return replica_.get(); }
  // Null without model parallelism, or where its group has one rank.
  Communicator* model_parallel() const { return model_parallel_.get(); }
  ModelParallel model_parallel_kind() const { return model_parallel_kind_; }
  void set_model_parallel(ModelParallel kind, std::unique_ptr<Communicator> group);
  // The prefix of the model-parallel group's collective tags, naming it.
  const char* model_parallel_tag() const;

  // Ranks that hold a copy of each parameter's data-parallel gradient: the
  // shard group times the replicas.
  int64_t data_parallel_world_size() const;
  // Checkpoints: the ranks that write one are the first replica's shard group
  // times the model-parallel group, numbered 0 .. writers - 1; the other
  // replicas' ranks follow (they name RNG files only).
  int64_t checkpoint_writer_count() const;
  int64_t checkpoint_rank() const;
  // Collective over the writers' groups (shard, then model-parallel): every
  // writer's string, in checkpoint_rank() order.
  std::vector<std::string> all_gather_among_writers(const std::string& mine,
                                                    const std::string& tag) const;

  // Every group present, with its tag prefix and the name of a rank in it.
  std::vector<AgreementGroup> scope() const;
  // The writers' part of scope(): the shard and model-parallel groups.
  std::vector<AgreementGroup> writers_scope() const;
  std::vector<Communicator*> communicators() const;

  // The one agreement primitive: collective over `scope` (every group when
  // empty); every rank's error combined into one message, the same on every
  // rank, "" when none failed (see error_agreement.h for its form).
  std::string agree(const std::string& local_error, const std::string& tag,
                    const std::vector<AgreementGroup>& scope = {}) const;
  // The primitive for values: collective over `scope` (every group when
  // empty); for each of `values`, whether every rank holds the same one. One
  // MAX all-reduce of {v..., ~v...} per group over the host channel (the
  // complements' largest is the smallest's complement); the same answer on
  // every rank. Communicator::extremes is its form for one value and one
  // group (the order check, stage 3's agreements).
  std::vector<bool> same_on_every_rank(const std::vector<int64_t>& values, const std::string& tag,
                                       const std::vector<AgreementGroup>& scope = {}) const;
  // agree over every group, then the raise (raise_if_any_rank_failed).
  void raise_if_any_failed(const std::string& local_error, const std::string& what,
                           const std::string& tag) const;

  // Replica 0's values on every replica; the maximum over the replicas; the
  // maximum over the model-parallel group (host tensors, over the host
  // channel). No-ops where the group is absent.
  void broadcast_across_replicas(at::Tensor& tensor, const std::string& tag) const;
  void max_across_replicas(at::Tensor& tensor, const std::string& tag) const;
  void max_across_model_parallel(at::Tensor& tensor, const std::string& tag) const;

 private:
  std::unique_ptr<Communicator> shard_;
  std::unique_ptr<Communicator> replica_;
  std::unique_ptr<Communicator> model_parallel_;
  ModelParallel model_parallel_kind_ = ModelParallel::kNone;
};

}  // namespace zeroshard
