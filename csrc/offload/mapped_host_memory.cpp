#include "zeroshard/mapped_host_memory.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

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

size_t mapped_bytes(size_t nbytes) {
  return (nbytes + page_size() - 1) / page_size() * page_size();
}

void* map_pages(size_t bytes) {
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
  return address;
}

class MappedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
    }
    const size_t bytes = mapped_bytes(nbytes);
    void* address = map_pages(bytes);
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

// The pool's bookkeeping. Every buffer's deleter holds a reference, so it
// outlives the pool object while any buffer is in use.
struct HostBufferPool::State {
  mutable std::mutex mutex;
  std::multimap<size_t, void*> free;  // bytes -> mapping
  size_t out_bytes = 0;               // in buffers now in use
  size_t peak_out_bytes = 0;
  size_t cached_bytes = 0;
  int64_t mappings_made = 0;  // fresh mappings, each faulted in anew
  bool closed = false;        // the pool is gone: freed buffers are unmapped

  // A mapping of at least `bytes` (page multiple), *mapped_size long;
  // *reused: it held data before.
  void* acquire(size_t bytes, bool* reused, size_t* mapped_size) {
    std::vector<std::pair<size_t, void*>> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex);
      // The smallest held mapping that fits, if it is at most twice the
      // request: buckets are cut at parameter boundaries, so their sizes
      // differ a little from one to the next, and a small request must not
      // pin a large mapping.
      const auto found = free.lower_bound(bytes);
      const size_t peak = std::max(peak_out_bytes, out_bytes + bytes);
      // A larger held mapping is taken all the same when a new one would push
      // the pool past its peak: that mapping would be unmapped to make room,
      // and the next request of its size would map it again. A step's
      // requests recur in the same order, so that churn repeated every step
      // (stage 2, 2 ranks, 5M-element buckets: ~70 MB of pages faulted in
      // again a step per rank, [Note: recycled step buffers]).
      *reused = found != free.end() &&
                (found->first <= 2 * bytes || cached_bytes + out_bytes + bytes > peak);
      if (*reused) {
        const size_t held = found->first;
        void* address = found->second;
        free.erase(found);
        cached_bytes -= held;
        out_bytes += held;
        peak_out_bytes = std::max(peak_out_bytes, out_bytes);
        *mapped_size = held;
        return address;
      }
      // Held mappings go (largest first) while holding them and this new one
      // would exceed the peak.
      while (cached_bytes + out_bytes + bytes > peak && !free.empty()) {
        const auto largest = std::prev(free.end());
        evicted.emplace_back(*largest);
        cached_bytes -= largest->first;
        free.erase(largest);
      }
    }
    for (const auto& [size, address] : evicted) {
      ::munmap(address, size);
    }
    void* address = map_pages(bytes);  // throws with nothing to undo
    std::lock_guard<std::mutex> lock(mutex);
    out_bytes += bytes;
    peak_out_bytes = std::max(peak_out_bytes, out_bytes);
    mappings_made += 1;
    *mapped_size = bytes;
    return address;
  }

  void give_back(void* address, size_t bytes) {
    bool keep = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      out_bytes -= bytes;
      keep = !closed && cached_bytes + out_bytes + bytes <= peak_out_bytes;
      if (keep) {
        free.emplace(bytes, address);
        cached_bytes += bytes;
      }
    }
    if (!keep) {
      ::munmap(address, bytes);
    }
  }

  // Unmaps every held mapping and returns their bytes; with `close`, later
  // frees unmap too.
  size_t release(bool close) {
    std::multimap<size_t, void*> held;
    size_t released = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      held.swap(free);
      released = cached_bytes;
      cached_bytes = 0;
      closed = closed || close;
    }
    for (const auto& [bytes, address] : held) {
      ::munmap(address, bytes);
    }
    return released;
  }
};

HostBufferPool::HostBufferPool() : state_(std::make_shared<State>()) {}

HostBufferPool::~HostBufferPool() { state_->release(/*close=*/true); }

at::Tensor HostBufferPool::take(int64_t numel, const at::TensorOptions& options) {
  if (!mapped(numel, options)) {
    return at::Tensor();
  }
  const size_t bytes =
      mapped_bytes(static_cast<size_t>(numel) * static_cast<size_t>(options.dtype().itemsize()));
  size_t mapped_size = 0;
  bool reused = false;
  void* address = state_->acquire(bytes, &reused, &mapped_size);
  try {
    std::shared_ptr<State> state = state_;
    return at::from_blob(
        address, {numel},
        [state = std::move(state), address, mapped_size](void*) {
          state->give_back(address, mapped_size);
        },
        options);
  } catch (...) {
    state_->give_back(address, mapped_size);
    throw;
  }
}

at::Tensor HostBufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  at::Tensor tensor = take(numel, options);
  return tensor.defined() ? tensor : at::empty({numel}, options);
}

int64_t HostBufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->cached_bytes);
}

int64_t HostBufferPool::mappings_made() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->mappings_made;
}

int64_t HostBufferPool::clear() { return static_cast<int64_t>(state_->release(/*close=*/false)); }

}  // namespace zeroshard
