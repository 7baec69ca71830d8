#include "zeroshard/safetensors.h"

#include "durable_file.h"
#include "zeroshard/crc32c.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <utility>

namespace zeroshard {
namespace {

using checkpoint_detail::File;

// Safetensors caps the header at 100 MB; so do we, on both sides.
constexpr int64_t kMaxHeaderBytes = 100'000'000;

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t size : shape) {
    numel *= size;
  }
  return numel;
}

}  // namespace

const char* safetensors_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "F32";
    case at::kBFloat16:
      return "BF16";
    case at::kHalf:
      return "F16";
    case at::kDouble:
      return "F64";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      TORCH_CHECK_VALUE(false, "safetensors: dtype ", dtype, " is not supported");
  }
}

at::ScalarType safetensors_dtype(const std::string& name) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong,
                               at::kInt, at::kByte, at::kBool}) {
    if (name == safetensors_dtype_name(dtype)) {
      return dtype;
    }
  }
  TORCH_CHECK_VALUE(false, "safetensors: dtype '", name, "' is not supported");
}

struct SafetensorsWriter::Impl {
  File file;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : entries_(std::move(entries)) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const auto& entry : entries_) {
    TORCH_CHECK_VALUE(entry.name != "__metadata__" && header.count(entry.name) == 0,
                      "safetensors: duplicate or reserved tensor name '", entry.name, "'");
    const int64_t bytes =
        numel_of(entry.shape) * static_cast<int64_t>(c10::elementSize(entry.dtype));
    header[entry.name] = {{"dtype", safetensors_dtype_name(entry.dtype)},
                          {"shape", entry.shape},
                          {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) {
    header["__metadata__"] = metadata;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // aligns the data, as safetensors does
  TORCH_CHECK_VALUE(static_cast<int64_t>(text.size()) <= kMaxHeaderBytes, "safetensors header of ",
                    path, " would be ", text.size(), " bytes; the format allows ", kMaxHeaderBytes);
  impl_ = std::make_unique<Impl>(Impl{File::create(path)});
  uint8_t length[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<uint8_t>(n >> (8 * i));
  }
  impl_->file.write_all(length, 8);
  impl_->file.write_all(text.data(), text.size());
  position_ = 8 + static_cast<int64_t>(text.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

WrittenPiece SafetensorsWriter::append(const at::Tensor& tensor) {
  TORCH_CHECK(next_ < entries_.size(), "safetensors: more tensors appended than declared");
  const SafetensorsEntry& entry = entries_[next_];
  TORCH_CHECK(tensor.scalar_type() == entry.dtype && tensor.numel() == numel_of(entry.shape),
              "safetensors: tensor for '", entry.name, "' has dtype ", tensor.scalar_type(),
              " and ", tensor.numel(), " elements; declared ", entry.dtype, " and ",
              numel_of(entry.shape));
  const at::Tensor host = tensor.device().is_cpu() ? tensor.contiguous() : tensor.cpu();
  const int64_t bytes = host.numel() * static_cast<int64_t>(host.element_size());
  WrittenPiece piece{position_, bytes, crc32c(host.data_ptr(), static_cast<size_t>(bytes))};
  impl_->file.write_all(host.data_ptr(), static_cast<size_t>(bytes));
  position_ += bytes;
  ++next_;
  return piece;
}

void SafetensorsWriter::finish() {
  TORCH_CHECK(next_ == entries_.size(), "safetensors: ", entries_.size() - next_,
              " declared tensors were not written to ", impl_->file.path());
  impl_->file.sync();
  impl_->file.close();
}

struct SafetensorsReader::Impl {
  File file;
};

SafetensorsReader::SafetensorsReader(const std::string& path)
    : impl_(std::make_unique<Impl>(Impl{File::open_for_reading(path)})) {
  uint8_t length[8];
  TORCH_CHECK_VALUE(impl_->file.size() >= 8, path, " is not a safetensors file (",
                    impl_->file.size(), " bytes)");
  impl_->file.read_at(0, length, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(length[i]) << (8 * i);
  }
  TORCH_CHECK_VALUE(n <= static_cast<uint64_t>(kMaxHeaderBytes) &&
                        static_cast<int64_t>(8 + n) <= impl_->file.size(),
                    path, " is not a safetensors file (header length ", n, ")");
  std::string text(n, '\0');
  impl_->file.read_at(8, text.data(), n);
  try {
    header_ = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK_VALUE(false, path, " has a malformed safetensors header: ", e.what());
  }
  data_start_ = 8 + static_cast<int64_t>(n);
}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;

const std::string& SafetensorsReader::path() const { return impl_->file.path(); }

void SafetensorsReader::read(int64_t offset, void* out, int64_t bytes) const {
  impl_->file.read_at(offset, out, static_cast<size_t>(bytes));
}

at::Tensor SafetensorsReader::tensor(const std::string& name) const {
  TORCH_CHECK_VALUE(header_.contains(name), path(), " has no tensor '", name, "'");
  const auto& entry = header_.at(name);
  const auto shape = entry.at("shape").get<std::vector<int64_t>>();
  const auto offsets = entry.at("data_offsets").get<std::vector<int64_t>>();
  at::Tensor out = at::empty(
      shape, at::TensorOptions().dtype(safetensors_dtype(entry.at("dtype").get<std::string>())));
  TORCH_CHECK_VALUE(
      offsets.size() == 2 &&
          offsets[1] - offsets[0] == out.numel() * static_cast<int64_t>(out.element_size()),
      path(), ": tensor '", name, "' has inconsistent data_offsets");
  read(data_start_ + offsets[0], out.data_ptr(), offsets[1] - offsets[0]);
  return out;
}

}  // namespace zeroshard
