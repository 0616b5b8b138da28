#include "train/runtime.h"

#include <malloc.h>
#include <sched.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <string>

#include "zerotrain/train.h"

namespace zt {
namespace {

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

RuntimeSettings apply_runtime_settings(int requested_threads, int local_ranks, bool retain_freed_memory) {
  RuntimeSettings settings;
  settings.intra_op_threads =
      requested_threads > 0 ? requested_threads : std::max(1, available_cores() / std::max(1, local_ranks));
  settings.retain_freed_memory = retain_freed_memory;
  at::set_num_threads(settings.intra_op_threads);
  try {
    at::set_num_interop_threads(1);
  } catch (const c10::Error&) {
    // Already fixed by an earlier call in this process (tests run several ranks' code paths).
  }
  // Retained: keep freed memory in the process. Large temporaries (logits, their gradients) are
  // otherwise returned to the OS on free and page-faulted in again on the next step (design §10).
  // Measured on GPT-2 124M (docs/benchmarks.md): 2.5x fewer page faults and 7% more tokens/s
  // than glibc's defaults, for about 8% more peak RSS. But the retained heap fragments: peaks ran
  // 14-34% above the memory estimate at stages 0-2 on the small presets, so it is opt-in
  // ("always", or "auto" at stages 0-2), and the estimate's notes say so.
  // Not retained (the default, "never"): every block of 64 KiB or more is mapped on its own and
  // unmapped when freed, so the resident set follows the live tensors that the estimate counts
  // (docs/memory.md). A 1 MiB threshold left the activations of small models (256-512 KiB
  // tensors) in the heap, whose fragmentation put their peaks 10-16% above the estimate; at
  // 64 KiB they are within 3% (docs/benchmarks.md "memory estimate"). A fixed threshold also
  // stops glibc from raising it on its own (up to 32 MiB), after which blocks of the size of a
  // transformer block would stay in the heap and fragment it: measured at stage 3, the retained
  // heap costs about 1 GiB of peak RSS on GPT-2 124M (docs/benchmarks.md "stage 3"). Stage 3
  // keeps its gathered blocks' memory itself (GatherPool in src/zero/engine.cpp).
  if (retain_freed_memory) {
    mallopt(M_MMAP_MAX, 0);              // serve large blocks from the heap, where they are reused
    mallopt(M_TRIM_THRESHOLD, INT_MAX);  // and never give the heap's top back between steps
  } else {
    mallopt(M_MMAP_THRESHOLD, 64 << 10);
  }
  return settings;
}

namespace {
long long status_kib(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const size_t length = std::char_traits<char>::length(field);
  while (std::getline(status, line))
    if (line.compare(0, length, field) == 0) return std::stoll(line.substr(length)) * 1024;
  return 0;
}
}  // namespace

long long peak_rss_bytes() { return status_kib("VmHWM:"); }
long long current_rss_bytes() { return status_kib("VmRSS:"); }

}  // namespace zt
