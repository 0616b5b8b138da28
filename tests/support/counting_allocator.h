// Measures what a piece of code really holds: the live bytes of the CPU allocations it makes and
// their peak, by standing in for LibTorch's CPU allocator while installed.
#pragma once
#include <c10/core/Allocator.h>

#include <cstdint>
#include <mutex>

namespace zt::testing {

// Counts allocations made while installed (frees of older allocations are not counted). One
// instance per process, never destroyed (storages keep a pointer to it). Thread-safe.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& instance();
  // Takes over CPU allocations and resets the counters; uninstall() gives them back.
  void install();
  void uninstall();
  int64_t peak() const;
  int64_t live() const;  // bytes allocated while installed and not yet freed

  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

 private:
  CountingAllocator() = default;
  static void release(void* context);
  c10::Allocator* base_ = nullptr;
  mutable std::mutex mutex_;
  int64_t live_ = 0, peak_ = 0;
};

}  // namespace zt::testing
