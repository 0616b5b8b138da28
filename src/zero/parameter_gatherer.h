// Parameter gathering for sharded parameters (stage 3; docs/zero.md "Stage 3", docs/design.md
// "Stage 3: blocks, gathers and release"):
// the blocks, their full-size parameter buffers, the gather pool, the recorded block order and
// the prefetch that walks it. Internal to the engine.
//
// Contract
// - Each block's parameters are views into one full-size tensor per bucket whose storage exists
//   only while the block is gathered; the views (and what autograd saved of them) stay valid as
//   metadata in between.
// - The source of the gathers is this rank's working partition, read through a ParameterShards
//   (memory or an offload tier, zero/partition_store.h); with a secondary partition (hpZ,
//   zero_hpz_partition_size, docs/zero.md "hpZ") a block gathered once since the last change of
//   the parameters is gathered again from its secondary shards, within the secondary group only.
// - It is the BlockRunner of its blocks (zero/block_runner.h) from construction to destruction;
//   a backward through a graph it left behind after that throws zt::Error naming the block.
// - Collectives are issued in the same order on every rank (the first forward checks the block
//   order across ranks). Not thread-safe.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <memory>
#include <string>
#include <vector>

#include "zero/block_runner.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/layout/layout.h"

namespace torch::nn {
class Module;
}

namespace zt {

struct ZeroConfig;

// Where the gathers read this rank's shard of a bucket from. prepare(block) is called before a
// block's gathers are launched (an offload tier reads its shards then); shard(bucket) must stay
// valid until done(block), called once the gathers have completed.
class ParameterShards {
 public:
  virtual ~ParameterShards() = default;
  virtual void prepare(int block) = 0;
  virtual at::Tensor shard(int bucket) = 0;
  virtual void done(int block) = 0;
  // The blocks expected next (in order), for reading ahead; called after each prepare().
  virtual void expect(const std::vector<int>& upcoming) { (void)upcoming; }
  // Whether prepare(block) can be called now; when not, gathers in flight must complete (done())
  // first. An offload tier has a fixed number of buffers.
  virtual bool can_prepare(int block) const {
    (void)block;
    return true;
  }
};

// Memory for gathered blocks. A released block's buffer is kept for the next gather of the same
// size instead of being freed, so that gathering does not page-fault fresh memory every time;
// what is live plus what is kept stays within `limit` (twice the largest block, which holds the
// largest block plus two others), older kept buffers being freed first.
class GatherPool {
 public:
  explicit GatherPool(int64_t limit = 0, c10::Device device = c10::kCPU) : limit_(limit), device_(device) {}
  c10::Device device() const { return device_; }
  c10::DataPtr take(int64_t bytes);
  void give(c10::DataPtr data, int64_t bytes);
  // Counts a buffer allocated elsewhere as live, so that it can be given back.
  void adopt_live(int64_t bytes) { live_bytes_ += bytes; }

 private:
  int64_t limit_ = 0, live_bytes_ = 0, kept_bytes_ = 0;
  c10::Device device_{c10::kCPU};  // the compute device: its allocator serves the gathers
  std::vector<std::pair<c10::DataPtr, int64_t>> kept_;  // oldest first
};

struct GathererLiveness;

class ParameterGatherer : public BlockRunner {
 public:
  struct Block {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
  };
  // `secondary`: the group of the secondary partition (hpZ), whose size divides the world's; null
  // for none. Its shards (each block's 1/size, in the working dtype) are allocated here.
  ParameterGatherer(const FlatLayout& layout, std::vector<Block> blocks, const ZeroConfig& zero,
                    at::ScalarType working_dtype, c10::Device device, Communicator& comm, ParameterShards& shards,
                    std::shared_ptr<Communicator> secondary = nullptr);
  ~ParameterGatherer() override;

  // Starts running the blocks' modules (install_block_runner).
  void install();
  // Construction: `full` (own storage, working dtype) becomes bucket b's full tensor; a bucket of a
  // block is released at once, a persistent one (group -1) stays whole.
  void adopt_bucket(int bucket, at::Tensor full);
  at::Tensor& bucket_tensor(int bucket) { return bucket_params_[bucket]; }

  // A backward starts: every block's gradients are still to come; the first one also ends the
  // recording of the block order.
  void begin_backward();
  // A gradient of `bucket` arrived; its block is released after its last one.
  void gradient_arrived(int bucket);
  // The backward ended: every block still gathered is released (release false: it failed, and the
  // blocks are left as they are). A block run between begin_backward() and end_backward() is a
  // recomputation (activation checkpointing).
  void end_backward(bool release = true);
  void release_all();
  // Between steps: the blocks of `modules` gathered now and kept so until release_held() (reading
  // or changing whole parameters outside forward). A module that is not one of the blocks throws
  // zt::Error.
  void hold(const std::vector<const torch::nn::Module*>& modules);
  void release_held();
  // Parameters outside every block stay whole on every rank; refresh them after a step.
  void gather_persistent();
  // The parameters changed (a step, a load): the secondary shards are stale until each block's
  // next gather from the partition.
  void invalidate_secondary();

  at::Tensor run(int block, const at::Tensor& x, const BlockFunction& fn) override;
  std::vector<at::Tensor> run_outputs(int block, const BlockOutputsFunction& fn) override;
  void gather_for_backward(int block, int64_t position);

  int64_t persistent_bytes() const;
  int64_t peak_gathered_bytes() const { return peak_gathered_bytes_; }
  int64_t prefetched_blocks() const { return prefetched_; }
  int64_t block_gathers() const { return gathers_; }
  // Of block_gathers(): those served by the secondary partition.
  int64_t secondary_gathers() const { return secondary_gathers_; }
  int64_t secondary_bytes() const;

 private:
  enum class Residence { Released, Gathering, Gathered };
  struct BlockState {
    std::string name;
    std::vector<int> buckets;
    int trainable = 0;  // trainable parameters in the block
    int remaining = 0;  // their gradients still to come in this backward
    Residence residence = Residence::Released;
    std::vector<CollectiveHandle> gathering;  // while Gathering
    bool from_secondary = false;              // while Gathering: from the secondary shards
    bool secondary_valid = false;             // its secondary shards hold the current parameters
    int64_t bytes = 0;  // full size of its buckets in the working dtype
    int64_t numel = 0;
  };

  void launch_gather(int block);
  void complete_gathering(int block);
  void gather(int block);
  void release(int block);
  void release_storage(int bucket);
  void prefetch(int64_t position, int direction);
  void check_block_call(int block);
  bool reads_secondary(int block) const { return secondary_ && blocks_[block].secondary_valid; }

  const FlatLayout& layout_;
  const ZeroConfig& zero_;
  at::ScalarType working_dtype_;
  Communicator& comm_;
  ParameterShards& shards_;
  std::vector<BlockState> blocks_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<at::Tensor> bucket_params_;
  std::shared_ptr<Communicator> secondary_;
  std::vector<at::Tensor> secondary_shards_;  // per bucket of a block: this rank's 1/size of it
  GatherPool pool_;
  c10::intrusive_ptr<GathererLiveness> liveness_;
  bool installed_ = false;
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0, prefetched_ = 0, gathers_ = 0,
          secondary_gathers_ = 0;
  // Block order: recorded (and checked across ranks) until the first backward, then used to
  // prefetch. docs/zero.md "Stage 3".
  std::vector<int> gathering_order_;  // blocks in Gathering state, oldest launch first
  std::vector<int> recorded_order_;
  std::vector<char> kept_after_use_;  // per recorded position: stays gathered after its forward use
  bool order_known_ = false;
  bool in_backward_ = false;
  std::vector<int> held_;
  int64_t forward_position_ = 0;
};

}  // namespace zt
