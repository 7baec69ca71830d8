// The safetensors file format, written and read from C++ (there is no official
// C++ library): an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}, offsets relative to the end of the header), then the tensors'
// raw little-endian bytes, row-major, with no holes. Files written here load
// with the `safetensors` Python package.
//
// The writer streams: the header is fixed by the list of entries given up
// front, then each tensor's bytes are appended in that order, so a file far
// larger than memory is written one tensor at a time. Each append returns the
// piece's absolute byte offset and CRC-32C, which checkpoint indexes record.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// "F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL"; throws for others.
const char* safetensors_dtype_name(at::ScalarType dtype);
at::ScalarType safetensors_dtype(const std::string& name);

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

struct WrittenPiece {
  int64_t offset = 0;  // absolute, in the file
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

class SafetensorsWriter {
 public:
  // Creates (truncates) `path` and writes the header.
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends the next entry's data; `tensor` must match its dtype and element
  // count (any device; copied to the host when needed).
  WrittenPiece append(const at::Tensor& tensor);
  // Fsyncs and closes. Throws if an entry was not appended.
  void finish();
  int64_t bytes_written() const { return position_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;
  int64_t position_ = 0;
};

class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;

  const std::string& path() const;
  // The parsed header (entries and "__metadata__").
  const nlohmann::json& header() const { return header_; }
  int64_t data_start() const { return data_start_; }
  // Reads `bytes` bytes at absolute offset `offset`.
  void read(int64_t offset, void* out, int64_t bytes) const;
  // One whole tensor, on the host.
  at::Tensor tensor(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  nlohmann::json header_;
  int64_t data_start_ = 0;
};

}  // namespace zeroshard
