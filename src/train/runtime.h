// Process-wide settings a training rank owns instead of leaving them to environment variables
// (on small machines thread oversubscription and re-faulted pages cost more than any kernel;
// docs/design.md "Platform facts"). Rationale and measurements: docs/benchmarks.md "training speed".
#pragma once

#include <string>

#include "zerotrain/config/config.h"

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

// The heap policy alone (apply_runtime_settings' second half), for a process whose threads are its
// own to set (the Python package). Call before the large allocations it should govern; with
// BoundedCache, CpuBlockCache's reset_high_water() after set-up lets the bound follow the steps.
void apply_heap_policy(HeapPolicy heap_policy);

// Whether LibTorch multiplies matrices in `precision` at this CPU's hardware speed: fp32 always;
// bf16 and fp16 when its oneDNN path supports the CPU (as torch.ops.mkldnn._is_mkldnn_bf16_supported
// and _is_mkldnn_fp16_supported say: bf16 needs AVX-512 or AMX, fp16 AVX-512-FP16 or AMX-FP16).
// Without it LibTorch falls back to a loop many times slower than fp32 (docs/memory.md "Precision
// on CPUs without 16-bit units"). ZT_CPU_HALF_PRECISION_UNITS=present|absent overrides
// the answer for 16-bit precisions (tests, diagnosis); any other value throws ConfigError.
bool cpu_multiplies_at_speed(Precision precision);

struct PrecisionChoice {
  Precision precision = Precision::FP32;  // the one to train in
  std::string note;                       // why it differs from the configured one; empty if it does not
};

// The precision a rank on the CPU trains in: fp32 when the configured one is 16-bit,
// train.cpu_half_precision is "auto" and the CPU has no fast path for it; else the configured one.
PrecisionChoice cpu_training_precision(Precision configured, const std::string& cpu_half_precision);

// Restarts the kernel's peak RSS (VmHWM) from the current RSS (/proc/self/clear_refs, "5"), so
// that set-up's peak and the steps' are told apart; false where the kernel does not allow it.
bool reset_peak_rss();

}  // namespace zt
