// Stage 3's negotiation: the ranks agree on which gathers and gradient
// reductions come next instead of assuming that every rank runs the same
// modules in the same order.
//
// [Note: Negotiated collectives]
// Stage 3 issues collectives from module and autograd hooks, so what a rank
// issues depends on which modules its data took it through: a mixture of
// experts routes each token, a branch is taken on one rank only, a module runs
// twice here and once there. Collectives must still be issued in one order on
// every rank (c10d matches them by sequence). So at each agreement point a
// rank says what it needs (an AgreementRequest) and every rank issues what the
// ranks agreed on, in one canonical order, derived from the same all-reduced
// numbers (Horovod's coordinator negotiates ready tensors the same way):
//   - a unit any rank demands (its forward or backward is waiting for it) is
//     gathered on every rank: the union; ranks that did not ask release it;
//   - a unit is prefetched only where every rank would prefetch it;
//   - a gradient bucket is reduce-scattered once it is complete on every rank;
//     a bucket some rank never completes goes at the end of backward, its
//     missing gradients counted as zeros, as at stages 1-2;
//   - a barrier (the end of the model's forward, of backward, the step) ends
//     when every rank is at one, after serving what the others demanded
//     meanwhile; ranks at different kinds of barrier (one steps while another
//     runs another backward) is an error raised on every rank.
// Not covered: collectives a rank issues itself inside a forward or backward
// whose units differ between ranks (an expert-parallel all-to-all, a
// tensor-parallel all-reduce) may meet another rank's agreement; the block
// issuing them must be one unit, gathered alike everywhere. A rank whose
// backward delivered no gradient still joins the round another rank runs
// (AgreementRequest::round_open).
// Cost: when every rank asks the same (the common path) one all-reduce of two
// integers (a hash of the request, as the order check compares one
// collective); otherwise a second all-reduce of one count per unit and per
// bucket. One agreement covers every gather and reduction it decides, where
// the order check spent one all-reduce on each collective.
#pragma once

#include "zeroshard/communicator.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

// Where a rank waits for the others. The values travel in the agreement.
enum class AgreementBarrier : int64_t {
  kNone = 0,
  kForwardEnd = 1,   // the model's forward returned
  kBackwardEnd = 2,  // a backward pass ended
  kStep = 3,         // step() began
  // A backward inside another (reentrant activation checkpointing) ended.
  kInnerBackwardEnd = 4,
};

const char* agreement_barrier_name(AgreementBarrier barrier);

// What one rank asks for at an agreement point. Indices are unit numbers and
// flat bucket numbers (ParameterGatherer's units, GradientBuckets' buckets).
struct AgreementRequest {
  std::vector<int64_t> demand;    // units this rank must have gathered now
  std::vector<int64_t> prefetch;  // units this rank would gather ahead
  std::vector<int64_t> ready;     // gradient buckets complete here, not yet reduced
  AgreementBarrier barrier = AgreementBarrier::kNone;
  // A gradient reduction round is open here (some gradient arrived): at the
  // end of backward every rank must run the round if any rank does, even one
  // whose backward delivered no gradient.
  bool round_open = false;
};

// What every rank issues, the same on every rank.
struct Agreement {
  std::vector<int64_t> gather;   // units, ascending
  std::vector<int64_t> reduce;   // buckets, ascending
  bool all_at_barrier = false;   // every rank asked with a barrier
  bool barriers_differ = false;  // ... and not all the same kind
  bool unanimous = false;        // every rank asked exactly the same
  // Some ranks asked with round_open, not all: those rounds cannot have
  // closed in this agreement (a bucket is reduced only once complete on
  // every rank), so the other ranks must join them.
  bool round_open_on_some_ranks_only = false;
};

class CollectiveAgreement {
 public:
  // Agreements travel over comm's host channel: what ranks ask for is host
  // knowledge, so agreeing costs no host sync where there is one ([Note: the
  // host channel] in communicator.h).
  CollectiveAgreement(Communicator& comm, int64_t num_units, int64_t num_buckets);

  // Collective: every rank calls it at its own agreement points; the i-th
  // call of one rank is matched with the i-th call of every other.
  Agreement agree(AgreementRequest request);

  // Agreements so far, and how many needed the second (count) round.
  int64_t agreements() const { return agreements_; }
  int64_t count_rounds() const { return count_rounds_; }

 private:
  Communicator& comm_;
  int64_t num_units_;
  int64_t num_buckets_;
  int64_t agreements_ = 0;
  int64_t count_rounds_ = 0;
};

}  // namespace zeroshard
