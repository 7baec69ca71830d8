#include "zeroshard/collective_agreement.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace zeroshard {
namespace {

void sort_unique(std::vector<int64_t>& values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
}

// The request's numbers, each list preceded by its length so that ([1], [2])
// and ([1, 2], []) differ.
int64_t request_signature(const AgreementRequest& request) {
  Signature signature;
  for (const auto* list : {&request.demand, &request.prefetch, &request.ready}) {
    signature.mix(static_cast<int64_t>(list->size()));
    for (int64_t value : *list) {
      signature.mix(value);
    }
  }
  signature.mix(static_cast<int64_t>(request.barrier));
  signature.mix(request.round_open ? 1 : 0);
  return signature.value();
}

}  // namespace

const char* agreement_barrier_name(AgreementBarrier barrier) {
  switch (barrier) {
    case AgreementBarrier::kNone:
      return "a gather";
    case AgreementBarrier::kForwardEnd:
      return "the end of the model's forward";
    case AgreementBarrier::kBackwardEnd:
      return "the end of a backward pass";
    case AgreementBarrier::kStep:
      return "step()";
    case AgreementBarrier::kInnerBackwardEnd:
      return "the end of a reentrant checkpoint's backward";
  }
  return "an unknown point";
}

CollectiveAgreement::CollectiveAgreement(Communicator& comm, int64_t num_units, int64_t num_buckets)
    : comm_(comm), num_units_(num_units), num_buckets_(num_buckets) {}

Agreement CollectiveAgreement::agree(AgreementRequest request) {
  sort_unique(request.demand);
  sort_unique(request.prefetch);
  sort_unique(request.ready);
  Communicator::AgreedScope agreed(comm_);
  agreements_ += 1;
  Agreement out;
  const int64_t world = comm_.world_size();
  const bool at_barrier = request.barrier != AgreementBarrier::kNone;

  const int64_t signature = request_signature(request);
  const auto [largest, smallest] = comm_.extremes(signature, "agreement");
  if (largest == signature && smallest == signature) {
    // Every rank asked the same: act on this rank's own request.
    out.unanimous = true;
    out.gather = request.demand;
    out.gather.insert(out.gather.end(), request.prefetch.begin(), request.prefetch.end());
    sort_unique(out.gather);
    out.reduce = std::move(request.ready);
    out.all_at_barrier = at_barrier;
    return out;
  }

  // The ranks differ: count, per unit and per bucket, the ranks asking.
  count_rounds_ += 1;
  const int64_t demand_at = 0;
  const int64_t prefetch_at = num_units_;
  const int64_t ready_at = 2 * num_units_;
  const int64_t barrier_at = ready_at + num_buckets_;
  at::Tensor counts = at::zeros({barrier_at + 4}, at::kLong);
  auto* c = counts.data_ptr<int64_t>();
  for (int64_t unit : request.demand) {
    c[demand_at + unit] = 1;
  }
  for (int64_t unit : request.prefetch) {
    c[prefetch_at + unit] = 1;
  }
  for (int64_t bucket : request.ready) {
    c[ready_at + bucket] = 1;
  }
  const auto kind = static_cast<int64_t>(request.barrier);
  c[barrier_at] = at_barrier ? 1 : 0;
  c[barrier_at + 1] = kind;
  c[barrier_at + 2] = kind * kind;
  c[barrier_at + 3] = request.round_open ? 1 : 0;
  comm_.all_reduce_on_host(counts, c10d::ReduceOp::SUM, "agreement_counts");
  c = counts.data_ptr<int64_t>();
  for (int64_t unit = 0; unit < num_units_; ++unit) {
    if (c[demand_at + unit] > 0 || c[prefetch_at + unit] == world) {
      out.gather.push_back(unit);
    }
  }
  for (int64_t bucket = 0; bucket < num_buckets_; ++bucket) {
    if (c[ready_at + bucket] == world) {
      out.reduce.push_back(bucket);
    }
  }
  out.all_at_barrier = c[barrier_at] == world;
  out.round_open_on_some_ranks_only = c[barrier_at + 3] > 0 && c[barrier_at + 3] < world;
  // Equal kinds k on every rank <=> sum = W k and sum of squares = W k^2.
  out.barriers_differ = out.all_at_barrier && (c[barrier_at + 1] != world * kind ||
                                               c[barrier_at + 2] != world * kind * kind);
  return out;
}

}  // namespace zeroshard
