// Which implementation each collective takes, for the tests and benchmarks that cover and measure
// the paths a default communicator does not take on this backend (docs/comm.md "What Gloo lacks,
// and the emulations"). Internal; not installed: production code uses make_communicator(info,
// options) of zerotrain/comm/comm.h, which takes the default of every path.
#pragma once
#include <memory>

#include "zerotrain/comm/comm.h"

namespace zt {

struct CollectivePaths {
  // Force the emulated path even where the backend has the primitive.
  bool emulate_avg = false;             // Avg as Sum then divide by the world size
  bool emulate_low_precision = false;   // bf16/fp16 reductions through an fp32 temporary
  bool emulate_reduce_scatter = false;  // reduce_scatter as all_reduce of a copy + slice
  // CPU all_gather runs as one broadcast per rank into views of the output, which measured
  // 1.9-2.7x faster than Gloo's own allgather at >= 16 MiB (docs/benchmarks.md
  // "Collectives: 2 local ranks"); true uses Gloo's.
  bool native_gloo_all_gather = false;
  // CPU reduce_scatter with InputUse::Scratch runs as an in-place all_reduce of the input, which
  // measured 1.3-1.8x faster than Gloo's reduce-scatter at 16-64 MiB; true uses Gloo's.
  bool native_gloo_reduce_scatter = false;

  // True when any path is Gloo's own: the shared-memory path (CommOptions::shared_memory) is then
  // left out, so that the collectives reach Gloo.
  bool any() const {
    return emulate_avg || emulate_low_precision || emulate_reduce_scatter || native_gloo_all_gather ||
           native_gloo_reduce_scatter;
  }
};

// make_communicator (zerotrain/comm/comm.h) with the given paths; groups split from it take the same.
std::shared_ptr<Communicator> make_communicator(const RendezvousInfo& info, const CommOptions& options,
                                                const CollectivePaths& paths);

}  // namespace zt
