// The swap directories of the NVMe tiers (nvme_state_swapper.h,
// nvme_parameter_swapper.h): one per run, rank and tier under nvme_path.
#pragma once

#include <cstdint>
#include <string>

namespace zeroshard {

// mkdtemp of <nvme_path>/<prefix>-rank<rank>-XXXXXX; throws naming the path
// and the system's reason when nvme_path is missing, not a directory or not
// writable. The caller removes it (and the one file it puts there).
std::string make_swap_directory(const std::string& nvme_path, const std::string& prefix,
                                int64_t rank);

// Removes `file` in `directory` and the directory (it holds nothing else),
// then clears `directory`; nothing when it is empty. Never throws: the
// swappers call it from destructors and error paths.
void remove_swap_directory(std::string& directory, const std::string& file) noexcept;

}  // namespace zeroshard
