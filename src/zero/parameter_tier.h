// The stage-3 working partition as a ParameterShards: this rank's shards of every bucket, in
// memory or (offload_param nvme) in a swap file read ahead of each block's gather, in the
// recorded block order, into `buffer_count` aligned buffers (docs/offload.md "Parameters").
// Internal to the engine. Not thread-safe.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <vector>

#include "io/aio.h"
#include "zero/parameter_gatherer.h"
#include "zero/partition_store.h"

namespace zt {

class ParameterTier : public ParameterShards {
 public:
  // `partition` holds the working partition; `groups` are its sub-groups. Blocks whose sub-groups
  // are on disk are read through `buffer_count` buffers (io required then).
  ParameterTier(const FlatLayout& layout, TieredArray& partition, const std::vector<SubGroup>& groups,
                io::AioEngine* io, int buffer_count);

  void prepare(int block) override;
  at::Tensor shard(int bucket) override;
  void done(int block) override;
  void expect(const std::vector<int>& upcoming) override;
  bool can_prepare(int block) const override;
  // The step rewrites the partition: what was read ahead is stale.
  void invalidate();

  int64_t buffer_bytes() const;
  int64_t largest_block_shard_bytes() const { return largest_; }
  double stall_seconds() const { return stall_seconds_; }

 private:
  struct Buffer {
    io::AlignedBuffer data;
    int block = -1;   // the block whose shards it holds (or is reading)
    bool in_use = false;  // prepare()d and not done() yet
    std::vector<io::AioEngine::Ticket> reads;
    uint64_t last_use = 0;
  };
  int find(int block) const;
  int start_read(int block);  // -1 when no buffer is free
  void wait_reads(Buffer& b);

  const FlatLayout& layout_;
  TieredArray& partition_;
  const std::vector<SubGroup>& groups_;
  io::AioEngine* io_;
  std::vector<std::vector<int>> block_groups_;  // per block: its sub-groups
  std::vector<int> block_of_bucket_;
  std::vector<bool> block_on_disk_;
  std::vector<Buffer> buffers_;
  std::vector<int64_t> group_offset_in_block_;  // per sub-group: byte offset in its block's buffer
  int64_t largest_ = 0;
  uint64_t clock_ = 0;
  double stall_seconds_ = 0;
};

}  // namespace zt
