#include "zeroshard/error_agreement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <utility>

namespace zeroshard {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine,
                                            const std::string& tag) {
  // Host data: over the host channel (see [Note: the host channel]).
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  comm.all_reduce_on_host(length, c10d::ReduceOp::MAX, tag + "_length");
  const int64_t width = length.item<int64_t>() + 8;
  at::Tensor input = at::zeros({width}, at::kByte);
  const uint64_t size = mine.size();
  std::memcpy(input.data_ptr(), &size, 8);
  std::memcpy(static_cast<char*>(input.data_ptr()) + 8, mine.data(), mine.size());
  at::Tensor output = at::empty({width * comm.world_size()}, at::kByte);
  comm.all_gather_on_host(output, input, tag);
  std::vector<std::string> all;
  const char* bytes = static_cast<const char*>(output.data_ptr());
  for (int64_t r = 0; r < comm.world_size(); ++r) {
    uint64_t n = 0;
    std::memcpy(&n, bytes + r * width, 8);
    all.emplace_back(bytes + r * width + 8, n);
  }
  return all;
}

namespace {

// Each failed rank, named by its number in each group of the scope, and its
// message: what one rank knows of the failures after some of the groups.
struct RankFailure {
  std::vector<int64_t> coordinates;
  std::string message;
};

// "(k of n ranks failed): " (with `count_failures`) and each failure's label
// and message, or "every rank: " when all n failed alike.
std::string describe(const std::vector<std::string>& labels,
                     const std::vector<std::string>& messages, int64_t ranks,
                     bool count_failures = true) {
  if (labels.empty()) {
    return "";
  }
  std::ostringstream message;
  if (count_failures) {
    message << "(" << labels.size() << " of " << ranks << " ranks failed): ";
  }
  if (static_cast<int64_t>(labels.size()) == ranks &&
      std::all_of(messages.begin(), messages.end(),
                  [&](const auto& m) { return m == messages[0]; })) {
    message << "every rank: " << messages[0];
    return message.str();
  }
  // Ranks that failed alike are named together, once with their message
  // (a save's failure that every rank of a group reports is said once).
  std::vector<std::pair<std::string, std::string>> alike;  // labels, message
  for (size_t i = 0; i < labels.size(); ++i) {
    auto same = std::find_if(alike.begin(), alike.end(),
                             [&](const auto& entry) { return entry.second == messages[i]; });
    if (same == alike.end()) {
      alike.emplace_back(labels[i], messages[i]);
    } else {
      same->first += " and " + labels[i];
    }
  }
  for (size_t i = 0; i < alike.size(); ++i) {
    message << (i == 0 ? "" : "; ") << alike[i].first << ": " << alike[i].second;
  }
  return message.str();
}

// Length-prefixed, so that a message may hold any character.
std::string encode(const std::vector<RankFailure>& failures) {
  std::ostringstream out;
  for (const RankFailure& failure : failures) {
    out << failure.coordinates.size() << ' ';
    for (int64_t c : failure.coordinates) {
      out << c << ' ';
    }
    out << failure.message.size() << ' ' << failure.message;
  }
  return out.str();
}

std::vector<RankFailure> decode(const std::string& text) {
  std::vector<RankFailure> failures;
  std::istringstream in(text);
  size_t count = 0;
  while (in >> count) {
    RankFailure failure;
    failure.coordinates.resize(count);
    for (int64_t& c : failure.coordinates) {
      in >> c;
    }
    size_t length = 0;
    in >> length;
    in.get();  // the space before the message
    failure.message.resize(length);
    in.read(failure.message.data(), static_cast<std::streamsize>(length));
    failures.push_back(std::move(failure));
  }
  return failures;
}

}  // namespace

std::string combined_error(const std::vector<std::string>& errors) {
  std::vector<std::string> labels;
  std::vector<std::string> messages;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      labels.push_back("rank " + std::to_string(r));
      messages.push_back(errors[r]);
    }
  }
  return describe(labels, messages, static_cast<int64_t>(errors.size()));
}

namespace {

// Collective: every rank's `local` ("" = nothing to say), labelled by the
// rank's number in each group of `scope`; `ranks`: the scope's size.
void gather_labelled(const std::vector<AgreementGroup>& scope, const std::string& local_error,
                     const std::string& tag, std::vector<std::string>& labels,
                     std::vector<std::string>& messages, int64_t& ranks) {
  std::vector<const AgreementGroup*> groups;
  for (const AgreementGroup& group : scope) {
    if (group.comm != nullptr) {
      groups.push_back(&group);
    }
  }
  // Group after group: the failures this rank knows after one group are what
  // it brings to the next, so a failure anywhere reaches every rank of every
  // group, and each is carried once, by where it happened.
  std::vector<RankFailure> known;
  if (!local_error.empty()) {
    RankFailure mine{{}, local_error};
    for (const AgreementGroup* group : groups) {
      mine.coordinates.push_back(group->comm->rank());
    }
    known.push_back(std::move(mine));
  }
  ranks = 1;
  for (const AgreementGroup* group : groups) {
    ranks *= group->comm->world_size();
    std::vector<RankFailure> merged;
    for (const std::string& each :
         all_gather_strings(*group->comm, encode(known), group->tag_prefix + tag)) {
      for (RankFailure& failure : decode(each)) {
        merged.push_back(std::move(failure));
      }
    }
    // The last group first: with torchrun's usual layout (replicas of
    // consecutive shard groups) that is the order of the global ranks.
    std::sort(merged.begin(), merged.end(), [](const RankFailure& a, const RankFailure& b) {
      return std::lexicographical_compare(a.coordinates.rbegin(), a.coordinates.rend(),
                                          b.coordinates.rbegin(), b.coordinates.rend());
    });
    merged.erase(std::unique(merged.begin(), merged.end(),
                             [](const RankFailure& a, const RankFailure& b) {
                               return a.coordinates == b.coordinates;
                             }),
                 merged.end());
    known = std::move(merged);
  }
  for (const RankFailure& failure : known) {
    // "rank 1" in one group; "shard rank 1, replica 0" in several.
    std::string label;
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string& named = groups[g]->rank_name;
      const std::string name = !named.empty() ? named : groups.size() > 1 ? "shard rank" : "rank";
      label += (g == 0 ? "" : ", ") + name + " " + std::to_string(failure.coordinates[g]);
    }
    labels.push_back(label);
    messages.push_back(failure.message);
  }
}

}  // namespace

namespace {

// agree_on_error's gathering and message, with or without the failure count.
std::string gathered(const std::vector<AgreementGroup>& scope, const std::string& local,
                     const std::string& tag, bool count_failures) {
  std::vector<std::string> labels;
  std::vector<std::string> messages;
  int64_t ranks = 1;
  gather_labelled(scope, local, tag, labels, messages, ranks);
  return describe(labels, messages, ranks, count_failures);
}

}  // namespace

std::string agree_on_error(const std::vector<AgreementGroup>& scope, const std::string& local_error,
                           const std::string& tag) {
  return gathered(scope, local_error, tag, /*count_failures=*/true);
}

std::string each_rank_says(const std::vector<AgreementGroup>& scope, const std::string& mine,
                           const std::string& tag) {
  return gathered(scope, mine, tag, /*count_failures=*/false);
}

void raise_if_any_rank_failed(const std::vector<AgreementGroup>& scope,
                              const std::string& local_error, const std::string& what,
                              const std::string& tag) {
  const std::string agreed = agree_on_error(scope, local_error, tag);
  TORCH_CHECK_VALUE(local_error.empty(), local_error);
  TORCH_CHECK_VALUE(agreed.empty(), "another rank failed to ", what,
                    "; failing here too instead of waiting for it: ", agreed);
}

}  // namespace zeroshard
