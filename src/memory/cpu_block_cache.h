// A CPU allocator for LibTorch tensors that reuses freed large blocks without letting the
// resident set grow past what the live tensors have needed (docs/memory.md "The heap policy").
// Internal: the trainer and the Python package install it; not installed with the headers.
//
// Why: a training step allocates the same large tensors (activations, their gradients, logits,
// bucket copies) in the same sizes every step. Returned to the OS on free, each one is page-faulted
// in again on the next step: on bert-base that was a quarter of the step. Kept in glibc's heap,
// the heap fragments and the peak ran 14-36% above the live tensors. This cache keeps freed blocks
// of `large_block_bytes` or more, each in anonymous mappings of its own, for the next allocation
// of the same size (up to 1/8 larger). Every mapped byte counts against a bound: the largest live
// total seen so far (the high-water mark) plus `slack` of it. Within the bound an allocation no
// cached block fits gets a new mapping, so that the cache comes to hold each size the steps ask
// for. Past it, the pages of cached blocks serve it: the head of a larger one (its tail stays
// cached), or several smaller ones, oldest first, moved side by side into one new mapping by
// mremap (page tables move; no byte is copied or faulted in) and completed with new pages if they
// fall short; the oldest cached blocks are unmapped as far as the bound needs. So the resident set
// stays within the slack of the live peak whatever mix of sizes the steps hold at their peak, and
// steps after the first fault little in (docs/memory.md "The heap policy").
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
  uint64_t split = 0;              // served by the head of a larger cached block
  uint64_t composed = 0;           // served by smaller cached blocks moved into one mapping
  uint64_t mapped = 0;             // given a new mapping of new pages only
  uint64_t mapped_bytes = 0;       // new pages mapped (page-faulted in on first touch)
  uint64_t moved_bytes = 0;        // bytes of cached blocks moved into composed ones
  uint64_t unmapped = 0;           // cached blocks unmapped to stay within the bound
  int64_t live_bytes = 0;          // mapped bytes held by tensors now
  int64_t cached_bytes = 0;        // mapped bytes kept for reuse now
  int64_t high_water_bytes = 0;    // the largest live_bytes so far
};

class CpuBlockCache final : public c10::Allocator {
 public:
  static constexpr size_t kDefaultLargeBlockBytes = size_t{64} << 10;
  static constexpr double kDefaultSlackFraction = 0.0;

  // slack_fraction: the cache may hold this share of the high-water mark beyond it (>= 0). The
  // default, none, keeps the mapped bytes within the live peak: past the bound cached pages serve
  // a request by moving, so a slack buys no speed (docs/memory.md "The heap policy").
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
  // otherwise stay cached up to that peak for the rest of the run
  // (docs/memory.md "The heap policy"). Thread-safe.
  void reset_high_water();

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
