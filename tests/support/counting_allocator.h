// Measures what a piece of code really holds: the live bytes of the CPU allocations it makes and
// their peak, by standing in for LibTorch's CPU allocator while installed.
#pragma once
#include <c10/core/Allocator.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace zt::testing {

// Counts allocations made while installed (frees of older allocations are not counted). One
// instance per process, never destroyed (storages keep a pointer to it). Thread-safe.
//
// Keeps c10's allocator contract: every DataPtr it returns has its data pointer as its context
// and `raw_deleter()` frees by data pointer, so `raw_allocate`/`raw_deallocate` work (oneDNN's
// bf16 kernels on AMX machines allocate their scratch through them).
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& instance();
  // Takes over CPU allocations and resets the counters; uninstall() gives them back.
  void install();
  void uninstall();
  int64_t peak() const;
  int64_t live() const;  // bytes allocated while installed and not yet freed

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override;

 private:
  struct Allocation {
    c10::DataPtr inner;  // the base allocator's, freed when the entry is erased
    int64_t bytes;
  };
  CountingAllocator() = default;
  static void release(void* data);
  c10::Allocator* base_ = nullptr;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Allocation> allocations_;  // by data pointer
  int64_t live_ = 0, peak_ = 0;
};

}  // namespace zt::testing
