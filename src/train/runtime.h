// Process-wide settings a training rank owns instead of leaving them to environment variables
// (design §10: on small machines thread oversubscription and re-faulted pages cost more than any
// kernel). Rationale and measurements: docs/benchmarks.md "training speed".
#pragma once

namespace zt {

struct RuntimeSettings {
  int intra_op_threads = 1;
  bool retain_freed_memory = false;
};

// Sets LibTorch's intra-op threads (requested > 0, else available cores / `local_ranks`), one
// inter-op thread, and an allocator policy: with `retain_freed_memory` freed pages stay in the
// process for reuse, else blocks of 64 KiB or more go back to the OS when freed. Call once,
// before large allocations.
RuntimeSettings apply_runtime_settings(int requested_threads, int local_ranks, bool retain_freed_memory);

}  // namespace zt
