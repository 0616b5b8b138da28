// The stage-3 working partition as a ParameterShards: this rank's shards of every bucket, in
// memory or (offload_param nvme) in a swap file read ahead of each block's gather, in the
// recorded block order, into `buffer_count` aligned buffers (docs/offload.md "Parameters").
// Internal to the engine. Not thread-safe.
//
// Crossing to the compute device (parameters on the host while the model computes on a GPU,
// DevicePlan::parameters_on_host; docs/gpu.md "Parameter offload"): prepare(block) copies the
// block's shards from host memory (the partition, or the buffer its NVMe read landed in) into one
// of `Crossing::slots` device buffers on a copy stream of its own, and the compute stream waits for
// that copy before the gathers read it. A slot is copied into again only after the gathers that
// read it (done(block) records that point on the compute stream); an NVMe buffer is read into
// again only after the copy out of it completed (the host waits for it then). A block still in a
// slot is gathered again without a copy until the step changes the partition (invalidate()). On
// the CPU (the staging forced by ZT_HOST_STAGING) the same slots are filled by synchronous copies.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>
#include <vector>

#include "io/aio.h"
#include "zero/device_plan.h"
#include "zero/parameter_gatherer.h"
#include "zero/partition_store.h"

namespace zt {

class ParameterTier : public ParameterShards {
 public:
  // `partition` holds the working partition; `groups` are its sub-groups. Blocks whose sub-groups
  // are on disk are read through `buffer_count` buffers (io required then).
  struct Crossing {
    c10::Device compute{c10::kCPU};
    int slots = 2;     // blocks on the device at once, at least 2
    bool pin = false;  // page-lock the NVMe read buffers (the partition's own pinning is its array's)
  };
  ParameterTier(const FlatLayout& layout, TieredArray& partition, const std::vector<SubGroup>& groups,
                io::AioEngine* io, int buffer_count, std::optional<Crossing> crossing = std::nullopt);
  ~ParameterTier() override;
  ParameterTier(const ParameterTier&) = delete;
  ParameterTier& operator=(const ParameterTier&) = delete;

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
  // Crossing: the device memory of the slots, and the bytes copied into them so far.
  int64_t slot_bytes() const;
  int64_t crossed_bytes() const { return crossed_bytes_; }

 private:
  struct Buffer {
    io::AlignedBuffer data;
    int block = -1;   // the block whose shards it holds (or is reading)
    bool in_use = false;  // prepare()d and not done() yet
    std::vector<io::AioEngine::Ticket> reads;
    uint64_t last_use = 0;
    std::optional<c10::Event> copied_out;  // crossing: the copy that reads it to the device
    HostRegistration pinned;
  };
  struct Slot {  // crossing: one block's shards on the compute device
    at::Tensor data;
    int block = -1;
    bool in_use = false;
    uint64_t last_use = 0;
    std::optional<c10::Event> copied;    // on the copy stream, after the copies into it
    std::optional<c10::Event> consumed;  // on the compute stream, after the gathers that read it
  };
  int find(int block) const;
  int start_read(int block);  // -1 when no buffer is free
  void wait_reads(Buffer& b);
  // This rank's shard of the bucket in host memory (the partition, or a prepared NVMe buffer).
  at::Tensor host_shard(int bucket);
  int find_slot(int block) const;
  int free_slot() const;  // least recently used, -1 when every slot is in use
  void cross(int block);
  void wait_copies();

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
  std::optional<Crossing> crossing_;
  std::optional<c10::Stream> copy_stream_;  // a GPU's; none on the CPU
  std::vector<Slot> slots_;
  std::vector<int64_t> slot_offset_;  // per bucket of a block: its shard's element offset in the slot
  int64_t crossed_bytes_ = 0;
};

}  // namespace zt
