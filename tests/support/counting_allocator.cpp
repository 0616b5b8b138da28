#include "support/counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <algorithm>

namespace zt::testing {
namespace {
struct Context {
  c10::DataPtr inner;
  int64_t bytes;
};
}  // namespace

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
  auto* context = new Context{std::move(inner), int64_t(n)};
  {
    std::lock_guard lock(mutex_);
    live_ += int64_t(n);
    peak_ = std::max(peak_, live_);
  }
  return {data, context, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
}

void CountingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

void CountingAllocator::release(void* p) {
  auto* context = static_cast<Context*>(p);
  {
    std::lock_guard lock(instance().mutex_);
    instance().live_ -= context->bytes;
  }
  delete context;
}

}  // namespace zt::testing
