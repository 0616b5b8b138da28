#include "support/counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace zt::testing {

CountingAllocator& CountingAllocator::instance() {
  static auto* allocator = new CountingAllocator();
  return *allocator;
}

void CountingAllocator::install() {
  base_ = c10::GetCPUAllocator();
  {
    std::lock_guard lock(mutex_);
    live_ = peak_ = 0;
  }
  c10::SetCPUAllocator(this);
  EXPECT_EQ(c10::GetCPUAllocator(), this) << "the counting allocator must take over CPU allocations";
}

void CountingAllocator::uninstall() { c10::SetCPUAllocator(base_); }

int64_t CountingAllocator::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_;
}

int64_t CountingAllocator::peak() const {
  std::lock_guard lock(mutex_);
  return peak_;
}

c10::DataPtr CountingAllocator::allocate(size_t n) {
  c10::DataPtr inner = base_->allocate(n);
  void* data = inner.get();
  // Nothing to count (zero bytes); the base's DataPtr already keeps the contract.
  if (data == nullptr) return inner;
  {
    std::lock_guard lock(mutex_);
    live_ += int64_t(n);
    peak_ = std::max(peak_, live_);
    allocations_.emplace(data, Allocation{std::move(inner), int64_t(n)});
  }
  // The context is the data pointer itself, as c10::Allocator::raw_allocate requires.
  return {data, data, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
}

void CountingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

void CountingAllocator::release(void* data) {
  auto& self = instance();
  std::unordered_map<void*, Allocation>::node_type entry;
  {
    std::lock_guard lock(self.mutex_);
    entry = self.allocations_.extract(data);
    if (entry) self.live_ -= entry.mapped().bytes;
  }
  if (!entry) {
    // A deleter cannot throw; a pointer this allocator never handed out is a broken test.
    std::fprintf(stderr, "CountingAllocator: freeing %p, which it did not allocate\n", data);
    std::abort();
  }
  // `entry` goes out of scope here, outside the lock: the base allocator frees the memory.
}

}  // namespace zt::testing
