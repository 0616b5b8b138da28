// Process-wide settings a training rank owns instead of leaving them to environment variables
// (design §10: on small machines thread oversubscription and re-faulted pages cost more than any
// kernel). Rationale and measurements: docs/benchmarks.md "training speed".
#pragma once

#include <string>

namespace zt {

// What happens to freed memory (train.retain_freed_memory; docs/memory.md "The heap policy").
enum class HeapPolicy {
  BoundedCache,    // "bounded": tensor blocks of 64 KiB or more kept for reuse by CpuBlockCache
                   // within the live high-water mark; other blocks of 64 KiB or more unmapped
  RetainedHeap,    // "always" (and "auto" at stages 0-2): glibc's heap keeps every freed page
  ReturnToSystem,  // "never": every block of 64 KiB or more unmapped when freed
};

// The policy a configuration value names; `shard_parameters` decides "auto". Throws
// std::invalid_argument for a value the schema does not allow.
HeapPolicy heap_policy_of(const std::string& retain_freed_memory, bool shard_parameters);

struct RuntimeSettings {
  int intra_op_threads = 1;
  HeapPolicy heap_policy = HeapPolicy::ReturnToSystem;
};

// Sets LibTorch's intra-op threads (requested > 0, else available cores / `local_ranks`), one
// inter-op thread, and the heap policy (BoundedCache installs the process-wide CpuBlockCache as
// LibTorch's CPU allocator). Call once, before large allocations.
RuntimeSettings apply_runtime_settings(int requested_threads, int local_ranks, HeapPolicy heap_policy);

}  // namespace zt
