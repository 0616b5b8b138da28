// Gradient reduction: the gradient memory, the buckets and the collectives that sum gradients
// over the ranks (docs/zero.md "One step with sharded gradients"). Internal to the engine.
//
// Contract
// - Owns the gradient arenas: the whole flat gradient buffer (gradients not sharded) or this
//   rank's gradient partition plus one or two bucket buffers (gradients sharded, stage 2 and 3).
// - The engine's autograd hooks drive it: before_gradient / after_gradient for placement i while
//   a backward runs, between begin_backward and end_backward (abort_backward when it throws).
// - After finish_window() (on the boundary micro-step) owned_gradient() holds, for the owned
//   region, the sum over ranks of the scaled gradients of the window; clear() starts the next.
// - Sharded gradients may keep sub-groups of the partition in a swap file (Options::disk;
//   offload_optimizer.nvme_gradients, docs/offload.md "Gradients on NVMe"): each bucket's
//   reduction then lands in a staging shard, is added to what the window holds so far (read
//   back), and is written out as its reduction completes; the step streams those sub-groups in
//   (partition()), and owned_gradient() serves the memory sub-groups only. The sums of squares
//   are taken per bucket from the same values as in memory, so the norm is the same bit for bit.
// - Collectives are issued in bucket order, the same on every rank. Not thread-safe.
#pragma once
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <vector>

#include "io/aio.h"
#include "zero/partition_store.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/layout/layout.h"

namespace zt {

// How gradients travel; chosen once from the configuration's switches.
enum class GradientReduction {
  AllReduce,             // optimizer states not sharded: every rank gets the whole sum
  ReduceScatterInPlace,  // optimizer states sharded: the owned shard of the full gradient buffer
  ReduceScatterBuckets,  // gradients sharded too: bucket buffers reduced into the owned partition
};

class GradientReducer {
 public:
  struct Options {
    GradientReduction reduction = GradientReduction::AllReduce;
    int shard_rank = 0;
    int world = 1;
    at::ScalarType working_dtype = at::kFloat;
    c10::Device device{c10::kCPU};  // the compute device: the arenas and bucket buffers live there
    int64_t accumulation_steps = 1;
    bool overlap_comm = false;
    // Divides every buffer by this before its reduction is launched (DeepSpeed's
    // prescale_gradients: the world size; gradient_predivide_factor: that factor), so that an
    // fp16 sum over many ranks stays in range. post_divisor() is what is left to divide.
    double pre_divide = 1.0;
    // Sharded gradients only: sub-groups of the partition kept in `file` where on_disk.
    struct Disk {
      std::vector<SubGroup> groups;
      std::vector<char> on_disk;
      io::AioEngine* io = nullptr;
      std::filesystem::path file;
    };
    // Per placement (flat order): 1 where the parameter is a tensor-parallel slice
    // (zerotrain/zero/blocks.h mark_tensor_split), whose squares the engine sums over the tensor group
    // apart from the replicated ones. Empty: none.
    std::vector<char> tensor_split;
    std::optional<Disk> disk;
  };
  GradientReducer(const FlatLayout& layout, const Options& options, Communicator& comm);

  // Placement i's parameter (set once, after it has its storage): its .grad becomes a view into
  // the gradient arena (or, sharded, into a bucket buffer while its bucket fills).
  void attach(int placement, const at::Tensor& param);

  bool sharded() const { return options_.reduction == GradientReduction::ReduceScatterBuckets; }
  void begin_backward(bool boundary);
  void abort_backward();
  void end_backward();
  // Called before placement i's gradient is accumulated, in this engine's backward or another's.
  void before_gradient(int placement);
  // True when the gradient counts towards its bucket (the engine then counts it for its block).
  bool after_gradient(int placement);
  // Boundary micro-step: every reduction of the window has completed into the owned region.
  void finish_window();
  // A backward after the window's boundary one, before the step (Engine::Impl::reopen_window):
  // the window's reductions complete, then with `keep` what they hold stays, as the mean over
  // ranks, so that the next boundary reduction adds to it; without, it is dropped. Sharded
  // gradients need neither: the next reduction adds into the owned partition.
  void reopen_window(bool keep);
  // Called with a bucket as soon as its owned slice holds the window's final sum (during the
  // boundary backward with sharded gradients, at finish_window() otherwise; again should a late
  // gradient refill the bucket), and for every bucket by the end of finish_window(). Memory
  // sub-groups only (not with a disk tier). The offloaded step copies each slice to the host then.
  void set_on_final(std::function<void(int bucket)> callback) { on_final_ = std::move(callback); }

  // The owned gradient is the sum over ranks divided by pre_divide (1 in a world of one, where
  // nothing is reduced); the mean over ranks is it divided by post_divisor() = world / that.
  double post_divisor() const { return double(options_.world) / pre_divide_; }

  // Sum of squares of the owned region (the whole gradient when optimizer states are not sharded),
  // of the tensor-parallel slices (Options::tensor_split) and of the rest (padding included)
  // apart. Without slices `split` is 0 and `replicated` the same sum, bit for bit, as the region's
  // in one piece.
  struct SquareSums {
    double split = 0.0, replicated = 0.0;
  };
  SquareSums owned_square_sums() const;
  // Sum of squares of a CPU tensor (fp32, bf16 or fp16), accurate to about 1e-7 relative at any
  // length: the global gradient norm of clipping depends on it.
  static double square_sum(const at::Tensor& t);
  // The owned gradient of a fragment, in the working dtype (in memory sub-groups only).
  at::Tensor owned_gradient(int64_t flat_offset, int64_t partition_offset, int64_t numel) const;
  // Sharded gradients: the partition by sub-group (the step streams its disk sub-groups).
  const TieredArray& partition() const { return partition_; }
  void clear();

  int64_t gradient_bytes() const;  // in memory
  int64_t disk_bytes() const { return partition_.disk_bytes(); }
  // Disk tier: the aligned staging buffers the reductions pass through on their way to the file.
  int64_t staging_bytes() const;
  int64_t buffer_bytes() const;

 private:
  enum class BucketState { Idle, Filling, InFlight };
  struct Slot {
    at::Tensor param;
    int bucket = 0;
    at::Tensor bucket_grad_view[2];  // sharded: the gradient's place in each bucket buffer
    at::Tensor grad_view;            // not sharded: the gradient's place in the flat arena
    bool diverted = false;           // not sharded: another backward's gradient is in .grad
  };
  struct BucketBuffer {
    at::Tensor data;     // largest bucket, working dtype
    at::Tensor scratch;  // largest shard: receives a reduction that must be added, not written
    int bucket = -1;
    bool add_into_partition = false;
    CollectiveHandle handle;
    // Disk tier: the bucket's shard laid out as its sub-groups lie in the file, and the writes
    // still reading from it.
    io::AlignedBuffer staging;
    std::vector<io::AioEngine::Ticket> writes;
  };
  struct BucketProgress {
    int remaining = 0;      // gradients of this bucket still to arrive in this backward
    BucketState state = BucketState::Idle;
    int buffer = -1;
    bool received = false;  // its owned partition slice holds a reduction of this window
    std::optional<CollectiveHandle> handle;  // AllReduce / ReduceScatterInPlace
  };

  SquareSums square_sums(int bucket, const at::Tensor& owned) const;
  void reattach_gradients();
  void wait_whole_reductions();
  void acquire_buffer(int bucket);
  void launch(int bucket);
  void complete(int buffer);
  void flush_buckets();
  // Disk tier.
  void store_shard(int bucket, BucketBuffer& buffer, bool add);
  void wait_writes();
  at::Tensor read_shard(int bucket, BucketBuffer& buffer);  // the window's sum so far, into data

  const FlatLayout& layout_;
  Options options_;
  Communicator& comm_;
  std::vector<Slot> slots_;  // by placement
  at::Tensor flat_grads_, grad_partition_;  // grad_partition_: partition_'s memory when nothing is on disk
  TieredArray partition_;
  bool on_disk_ = false;       // some sub-groups are in a swap file: the staging path
  bool boundary_ = false;      // this backward ends the window
  std::vector<std::vector<int>> bucket_groups_;  // disk tier: the sub-groups of each bucket's shard
  std::vector<SquareSums> bucket_square_sum_;    // disk tier: of the window's sum, per bucket
  std::vector<char> square_sum_known_;
  BucketBuffer buffers_[2];
  int buffer_count_ = 0, next_buffer_ = 0;
  int64_t largest_shard_ = 0;
  std::vector<BucketProgress> progress_;
  bool in_backward_ = false;
  bool reducing_ = false;  // this window's reductions are launched (from the hooks, or after backward)
  bool reduce_whole_ = false;
  double pre_divide_ = 1.0;  // applied before each launch
  std::function<void(int)> on_final_;
  std::vector<char> final_sent_;  // per bucket, this window
  // Per bucket: the tensor-parallel slices in its owned shard, as (offset in the shard, elements),
  // in order.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> split_segments_;
};

}  // namespace zt
