#include "train/runtime.h"

#include <malloc.h>
#include <sched.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <fmt/format.h>

#include "memory/cpu_block_cache.h"
#include "zerotrain/error.h"
#include "zerotrain/train/train.h"

namespace zt {
namespace {

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// LibTorch's own answer (the operator behind torch.ops.mkldnn.<name>); false if it is not built in.
bool libtorch_says(const char* op_name) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op_name, ""});
  if (!handle) return false;
  return handle->typed<bool()>().call();
}

// "model name" and the flags that decide 16-bit speed, from /proc/cpuinfo, for the note.
std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "this CPU", flags;
  bool seen_model = false, seen_flags = false;
  while (std::getline(in, line) && !(seen_model && seen_flags)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string value = line.substr(std::min(line.size(), colon + 2));
    if (!seen_model && line.rfind("model name", 0) == 0) {
      model = value;
      seen_model = true;
    } else if (!seen_flags && line.rfind("flags", 0) == 0) {
      seen_flags = true;
      for (const char* f : {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})
        if ((" " + value + " ").find(std::string(" ") + f + " ") != std::string::npos) {
          if (!flags.empty()) flags += ' ';
          flags += f;
        }
    }
  }
  return fmt::format("\"{}\" ({})", model, flags.empty() ? "neither AVX2 nor AVX-512" : flags);
}

}  // namespace

bool cpu_multiplies_at_speed(Precision precision) {
  if (precision == Precision::FP32) return true;
  if (const char* forced = std::getenv("ZT_CPU_HALF_PRECISION_UNITS"); forced != nullptr && *forced != '\0') {
    const std::string v = forced;
    if (v == "present") return true;
    if (v == "absent") return false;
    throw ConfigError(fmt::format("ZT_CPU_HALF_PRECISION_UNITS: expected \"present\" or \"absent\", found \"{}\"", v));
  }
  return libtorch_says(precision == Precision::BF16 ? "mkldnn::_is_mkldnn_bf16_supported"
                                                    : "mkldnn::_is_mkldnn_fp16_supported");
}

PrecisionChoice cpu_training_precision(Precision configured, const std::string& cpu_half_precision) {
  if (configured == Precision::FP32 || cpu_half_precision == "always" || cpu_multiplies_at_speed(configured))
    return {configured, ""};
  if (cpu_half_precision != "auto")
    throw ConfigError(fmt::format("train.cpu_half_precision: expected \"auto\" or \"always\", found \"{}\"",
                                  cpu_half_precision));
  return {Precision::FP32,
          fmt::format("precision: {} is configured, but LibTorch has no fast {} matrix multiply on {}: there it falls "
                      "back to a loop many times slower than fp32 (docs/memory.md \"Precision on CPUs without 16-bit "
                      "units\"), so this run trains in fp32 (model states, gradients and collectives; "
                      "train.cpu_half_precision: \"always\" keeps {})",
                      to_string(configured), to_string(configured), cpu_description(), to_string(configured))};
}

HeapPolicy heap_policy_of(const std::string& retain_freed_memory, bool shard_parameters) {
  if (retain_freed_memory == "bounded") return HeapPolicy::BoundedCache;
  if (retain_freed_memory == "always") return HeapPolicy::RetainedHeap;
  if (retain_freed_memory == "never") return HeapPolicy::ReturnToSystem;
  if (retain_freed_memory == "auto") return shard_parameters ? HeapPolicy::ReturnToSystem : HeapPolicy::RetainedHeap;
  throw std::invalid_argument("train.retain_freed_memory: expected one of \"bounded\", \"auto\", \"always\", "
                              "\"never\", found \"" + retain_freed_memory + "\"");
}

RuntimeSettings apply_runtime_settings(int requested_threads, int local_ranks, HeapPolicy heap_policy) {
  RuntimeSettings settings;
  settings.intra_op_threads =
      requested_threads > 0 ? requested_threads : std::max(1, available_cores() / std::max(1, local_ranks));
  settings.heap_policy = heap_policy;
  at::set_num_threads(settings.intra_op_threads);
  try {
    at::set_num_interop_threads(1);
  } catch (const c10::Error&) {
    // Already fixed by an earlier call in this process (tests run several ranks' code paths).
  }
  apply_heap_policy(heap_policy);
  return settings;
}

void apply_heap_policy(HeapPolicy heap_policy) {
  // Retained heap: keep freed memory in glibc's heap. Large temporaries are not page-faulted in
  // again every step, but the heap fragments: peaks ran 14-36% above the live tensors the
  // estimate counts (docs/benchmarks.md "memory estimate").
  // Returned ("never"): every block of 64 KiB or more is mapped on its own and unmapped when
  // freed, so the resident set follows the live tensors (within 3% of the estimate), and every
  // step faults its temporaries in again: bert-base ran 30% slower than with a retained heap.
  // A 1 MiB threshold left the activations of small models (256-512 KiB tensors) in the heap,
  // whose fragmentation put their peaks 10-16% above the estimate; a fixed threshold also stops
  // glibc from raising it on its own (up to 32 MiB), after which blocks of a transformer block's
  // size would stay in the heap and fragment it.
  // Bounded (the default): the returned policy for everything but LibTorch's tensors, whose
  // large blocks CpuBlockCache reuses by size within the live high-water mark: the speed of the
  // retained heap at the peak of the returned one (docs/memory.md "The heap policy").
  if (heap_policy == HeapPolicy::RetainedHeap) {
    mallopt(M_MMAP_MAX, 0);              // serve large blocks from the heap, where they are reused
    mallopt(M_TRIM_THRESHOLD, INT_MAX);  // and never give the heap's top back between steps
  } else {
    mallopt(M_MMAP_THRESHOLD, 64 << 10);
  }
  if (heap_policy == HeapPolicy::BoundedCache) install_cpu_block_cache();
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

bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return false;
  clear << "5";
  clear.flush();
  return bool(clear);
}
long long current_rss_bytes() { return status_kib("VmRSS:"); }

}  // namespace zt
