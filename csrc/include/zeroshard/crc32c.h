// CRC-32C (Castagnoli), the checksum of every piece of a checkpoint. SSE4.2's
// crc32 instruction where the CPU has it (chosen at run time), a table
// otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroshard {

// Continues `crc` (0 to start) over `size` bytes at `data`.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace zeroshard
