#include <string>
#include <utility>
#include <vector>

#include "zero/engine_impl.h"

// After a step, the updated working parameters reach every rank (docs/zero.md): with parameters
// not sharded but optimizer states sharded (stages 1-2), each rank's updated shard of every bucket
// by all-gather into the flat buffer; with parameters sharded (stage 3), by invalidating what the
// gatherer holds so that the next gathers read the new partition.

namespace zt {

// Every rank receives the updated working parameters of every other rank's shards.
void Engine::Impl::gather_parameters() {
  const int64_t in_flight_limit = std::max<int64_t>(1, config.zero.allgather_bucket_size);
  std::vector<std::pair<CollectiveHandle, int64_t>> in_flight;
  int64_t in_flight_numel = 0;
  for (int b = 0; b < int(layout.buckets.size()); ++b) {
    const BucketLayout& lb = layout.buckets[b];
    // allgather_bucket_size bounds the elements being gathered at once.
    while (!in_flight.empty() && in_flight_numel + lb.numel > in_flight_limit) {
      in_flight.front().first.wait();
      in_flight_numel -= in_flight.front().second;
      in_flight.erase(in_flight.begin());
    }
    in_flight.emplace_back(comm->all_gather(flat_params.narrow(0, layout.shard_offset(b, shard_rank), lb.shard_numel),
                                            flat_params.narrow(0, lb.offset, lb.numel),
                                            "params.bucket" + std::to_string(b)),
                           lb.numel);
    in_flight_numel += lb.numel;
  }
  for (auto& [handle, numel] : in_flight) handle.wait();
}

// The updated partition reaches the working parameters every rank uses.
void Engine::Impl::publish_parameters() {
  if (shard_parameters) {
    // A block gathered (or read) ahead for a forward that did not come holds old values, and so
    // do the secondary shards.
    release_read_ahead();
    gatherer->invalidate_secondary();
    gatherer->gather_persistent();
  } else if (shard_world > 1) {
    gather_parameters();
  }
}

void Engine::Impl::release_read_ahead() {
  if (!shard_parameters) return;
  gatherer->release_all();  // completes the gathers in flight, which hands their shards back
  parameter_tier->invalidate();
}

}  // namespace zt
