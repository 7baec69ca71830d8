#include "zeroshard/mapped_host_memory.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

namespace zeroshard {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

// The deleter gets only the context pointer: the mapping's length rides in it.
struct Mapping {
  void* address;
  size_t bytes;
};

void unmap(void* context) {
  auto* mapping = static_cast<Mapping*>(context);
  ::munmap(mapping->address, mapping->bytes);
  delete mapping;
}

class MappedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
    }
    const size_t bytes = (nbytes + page_size() - 1) / page_size() * page_size();
    void* address =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(address != MAP_FAILED, "cannot map ", bytes,
                " bytes of host memory: ", std::strerror(errno),
                " (host memory or the process's address-space limit is exhausted)");
    if (bytes >= kHugePage) {
      // Fewer page faults when the buffer is first written (advice only:
      // where transparent huge pages are off this changes nothing).
      ::madvise(address, bytes, MADV_HUGEPAGE);
    }
    return c10::DataPtr(address, new Mapping{address, bytes}, &unmap, c10::Device(c10::kCPU));
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

c10::Allocator* mapped_host_allocator() {
  static MappedHostAllocator allocator;
  return &allocator;
}

at::Tensor mapped_host_empty(int64_t numel, c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(numel >= 0, "mapped_host_empty: numel must be >= 0, got ", numel);
  return at::Tensor(at::detail::empty_generic({numel}, mapped_host_allocator(),
                                              c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                              c10::nullopt));
}

namespace {

bool mapped(int64_t numel, const at::TensorOptions& options) {
  return options.device().is_cpu() && !options.pinned_memory() &&
         numel * static_cast<int64_t>(options.dtype().itemsize()) >= kMappedBufferBytes;
}

}  // namespace

at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) {
  if (mapped(numel, options)) {
    return mapped_host_empty(numel, c10::typeMetaToScalarType(options.dtype()));
  }
  return at::empty({numel}, options);
}

at::Tensor zeros_buffer(int64_t numel, const at::TensorOptions& options) {
  if (mapped(numel, options)) {
    return mapped_host_empty(numel, c10::typeMetaToScalarType(options.dtype()));  // zero pages
  }
  return at::zeros({numel}, options);
}

}  // namespace zeroshard
