// Errors agreed across ranks: a failure on any rank becomes the same error on
// every rank, so that no rank goes on into a collective the failed one will
// never join (a hang until the timeout) and every log names what failed where.
// The one mechanism behind construction, loads, NVMe I/O, checkpoint and
// replica agreements; stage 3's gather agreements are collective_agreement.h.
#pragma once

#include "zeroshard/communicator.h"

#include <string>
#include <utility>
#include <vector>

namespace zeroshard {

// Collective: every rank's string, in rank order (one all-reduce of the
// longest length, one all-gather), over the host channel.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            const std::string& tag);

// The message every rank raises, from every rank's error ("" = none): "" when
// none failed, else "(k of n ranks failed): rank r: ..." (ranks that failed
// alike named together, "rank 0 and rank 2: ...", or "every rank: ..." when
// all did).
std::string combined_error(const std::vector<std::string>& errors);

// A group an error agreement spans, the prefix of its collectives' tags, and
// what a rank's number in it is called in messages ("replica",
// "tensor-parallel rank"; "" for the shard group: "rank" when it is the only
// group present, "shard rank" beside others).
struct AgreementGroup {
  Communicator* comm = nullptr;  // null: not part of the scope
  std::string tag_prefix;
  std::string rank_name;
};

// Collective over each group of `scope` in turn (every rank of every group
// calls it): returns the combined error, the same on every rank of every
// group; "" when no rank failed. The message is flat over the whole scope:
// "(k of n ranks failed): shard rank r, replica q: ..." where n is the
// product of the groups' sizes and each failed rank is named once by its
// number in each group (the last group's first), never an agreement nested
// inside another; "rank r" where the scope has one group.
std::string agree_on_error(const std::vector<AgreementGroup>& scope, const std::string& local_error,
                           const std::string& tag);

// Collective as agree_on_error, for what every rank has to say (its values
// of settings that differ): "rank 0: stage = 2; rank 1: stage = 3", ranks
// alike named together, with no count of failures.
std::string each_rank_says(const std::vector<AgreementGroup>& scope, const std::string& mine,
                           const std::string& tag);

// agree_on_error, then the raise: a rank that failed throws its own message
// (what its caller would have thrown alone), the others c10::ValueError
// "another rank failed to <what>; ...: " and the agreed message, which names
// the failed ranks and says why.
void raise_if_any_rank_failed(const std::vector<AgreementGroup>& scope,
                              const std::string& local_error, const std::string& what,
                              const std::string& tag);

}  // namespace zeroshard
