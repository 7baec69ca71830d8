#include "zeroshard/crc32c.h"

#include <array>
#include <cstring>

namespace zeroshard {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // reflected Castagnoli

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t value = i;
    for (int bit = 0; bit < 8; ++bit) {
      value = (value & 1) ? (value >> 1) ^ kPolynomial : value >> 1;
    }
    table[i] = value;
  }
  return table;
}

uint32_t crc32c_table(const uint8_t* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  for (size_t i = 0; i < size; ++i) {
    crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  }
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* data, size_t size,
                                                        uint32_t crc) {
  uint64_t value = crc;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    value = __builtin_ia32_crc32di(value, word);
    data += 8;
    size -= 8;
  }
  uint32_t tail = static_cast<uint32_t>(value);
  while (size > 0) {
    tail = __builtin_ia32_crc32qi(tail, *data);
    ++data;
    --size;
  }
  return tail;
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (cpu_has_sse42()) {
    return ~crc32c_sse42(bytes, size, crc);
  }
#endif
  return ~crc32c_table(bytes, size, crc);
}

}  // namespace zeroshard
