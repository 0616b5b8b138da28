// A CPU allocator for LibTorch tensors that reuses freed large blocks without letting the
// resident set grow past what the live tensors have needed (docs/memory.md "The heap policy").
// Internal: the trainer and the Python package install it; not installed with the headers.
//
// Why: a training step allocates the same large tensors (activations, their gradients, logits,
// bucket copies) in the same sizes every step. Returned to the OS on free, each one is page-faulted
// in again on the next step: on bert-base that was a quarter of the step. Kept in glibc's heap,
// the heap fragments and the peak ran 14-36% above the live tensors. This cache keeps freed blocks
// of `large_block_bytes` or more, each its own anonymous mapping, for the next allocation of the
// same size (up to 1/8 larger). Every mapped byte counts against a bound: the largest live total
// seen so far (the high-water mark) plus `slack` of it. Within the bound an allocation no cached
// block fits gets a new mapping, so that the cache comes to hold each size the steps ask for;
// past it, it takes the cached block nearest in size and trims its tail (munmap) or grows it
// (mremap, which moves pages without copying), and the oldest cached blocks are unmapped as far
// as needed. So the resident set stays within the slack of the live peak, and steps after the
// first fault little in. The default slack of 1/4 is what bert-base needed for its steps to run
// at the speed of a retained heap, whose peak was 33% above the live one (docs/memory.md).
//
// Contracts:
//  - Blocks below large_block_bytes come from c10::alloc_cpu and go back to c10::free_cpu (glibc).
//  - A large block is page-aligned (so 64-byte aligned, as LibTorch requires), of its size rounded
//    up to the page, and not zeroed when reused.
//  - live + cached <= max(high-water mark, live) + slack after every allocation, counted in mapped
//    bytes; high-water mark = the largest live total since construction or reset_high_water().
//  - A failed mapping unmaps every cached block and retries once, then throws
//    c10::OutOfMemoryError naming the size.
//  - Thread-safe: one process-wide mutex guards every instance (LibTorch frees tensors on any
//    thread: the offload worker, the communication threads).
//  - A block must be freed through the DataPtr it came in (or raw_deleter()); an instance must
//    outlive the tensors it allocated. The installed instance is never destroyed.
#pragma once
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>

namespace zt {

struct CpuBlockCacheStats {
  uint64_t large_allocations = 0;  // allocations of large_block_bytes or more
  uint64_t reused = 0;             // of those, served by a cached block of about their size
  uint64_t resized = 0;            // served by a cached block trimmed or grown to their size
  uint64_t mapped = 0;             // given a new mapping
  uint64_t mapped_bytes = 0;       // bytes newly mapped or grown (page-faulted in on first touch)
  uint64_t unmapped = 0;           // cached blocks unmapped to stay within the bound
  int64_t live_bytes = 0;          // mapped bytes held by tensors now
  int64_t cached_bytes = 0;        // mapped bytes kept for reuse now
  int64_t high_water_bytes = 0;    // the largest live_bytes so far
};

class CpuBlockCache final : public c10::Allocator {
 public:
  static constexpr size_t kDefaultLargeBlockBytes = size_t{64} << 10;
  static constexpr double kDefaultSlackFraction = 0.25;

  // slack_fraction: the cache may hold this share of the high-water mark beyond it (>= 0).
  explicit CpuBlockCache(size_t large_block_bytes = kDefaultLargeBlockBytes,
                         double slack_fraction = kDefaultSlackFraction);
  ~CpuBlockCache() override;  // unmaps the cached blocks
  CpuBlockCache(const CpuBlockCache&) = delete;
  CpuBlockCache& operator=(const CpuBlockCache&) = delete;

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  CpuBlockCacheStats stats() const;
  // Unmaps every cached block (live blocks are untouched).
  void release_cached();
  // Unmaps every cached block and lowers the high-water mark to the bytes live now, so that from
  // here the bound follows the peaks still to come. A training loop calls it once its set-up is
  // done: construction, loading weights or a checkpoint peak once, and their freed blocks would
  // otherwise stay cached up to that peak plus the slack for the rest of the run
  // (docs/memory.md "The heap policy"). Thread-safe.
  void reset_high_water();
  // Changes the slack from the next allocation on (>= 0; std::invalid_argument otherwise). With
  // 0 the mapped bytes never exceed the live peak: a training process sets it while the model is
  // built (one block's freed construction tensors are not worth keeping above that peak) and
  // gives the steps their slack back with reset_high_water(). Thread-safe.
  void set_slack_fraction(double slack_fraction);

 private:
  struct State;
  State* state_;  // owned; behind a pointer so that this header does not pull in the containers
  friend void release_cpu_block(void* data);
};

// Installs one process-wide CpuBlockCache as LibTorch's CPU allocator (c10::SetCPUAllocator) and
// returns it; later calls return the same instance. Tensors allocated before keep their deleter.
CpuBlockCache& install_cpu_block_cache();
// The installed instance, or nullptr before install_cpu_block_cache().
CpuBlockCache* installed_cpu_block_cache();

}  // namespace zt
