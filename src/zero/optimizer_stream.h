// Internal to OptimizerPartition's implementation (zero/optimizer_partition.h): the stream of
// sub-groups on NVMe through aligned buffers, and the pass of a kernel over every chunk with each
// role's address, resident or streamed. The files that run a pass (the kernel dispatch) include it.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "io/aio.h"
#include "zero/gradient_reducer.h"
#include "zero/optimizer_partition.h"

namespace zt {

// One pass of the step over the sub-groups: disk sub-groups of the pass's roles are read into a
// ring of buffers ahead of their turn and written back after it (docs/offload.md "The step").
class OptimizerPartition::Stream {
 public:
  struct Role {
    const TieredArray* array = nullptr;
    bool read = false, write = false;
  };
  // `extra_bytes` (per sub-group, or empty): a role not among `arrays` yet (the gradients).
  Stream(io::AioEngine& io, const std::vector<SubGroup>& groups, int buffer_count, bool pipeline_read,
         bool pipeline_write, const std::vector<const TieredArray*>& arrays, const std::vector<int64_t>& extra_bytes);

  int64_t buffer_bytes() const;

  // Runs `body(g, pointer_of)` for every sub-group in order; pointer_of(role index, partition
  // offset) gives the address of that element of a disk role in its buffer.
  template <class Body>
  void pass(const std::vector<Role>& roles, Body&& body) {
    roles_ = roles;
    const int n = int(groups_.size());
    const int depth = int(slots_.size());
    int issued = 0;
    for (int g = 0; g < n; ++g) {
      // Read ahead: sub-groups up to g + depth - 2 (one buffer is still being written back).
      while (issued < n && (issued == g || (pipeline_read_ && issued <= g + depth - 2))) issue_reads(issued++);
      Slot& slot = slots_[size_t(g % depth)];
      wait(slot.reads);
      body(g, [&](int role, int64_t offset) -> void* {
        const int64_t at = slot.region[size_t(role)];
        ZT_CHECK_STATE(at >= 0, "a disk role without a buffer region");
        return static_cast<char*>(slot.buffer.data()) + at +
               (offset - groups_[size_t(g)].begin) * roles_[size_t(role)].array->element_size();
      });
      for (size_t r = 0; r < roles_.size(); ++r)
        if (roles_[r].write && roles_[r].array && roles_[r].array->on_disk(g))
          slot.writes.push_back(roles_[r].array->write(g, static_cast<char*>(slot.buffer.data()) + slot.region[r]));
      if (!pipeline_write_) wait(slot.writes);
    }
    for (Slot& s : slots_) wait(s.writes);
  }

  double stall_seconds() const { return stall_seconds_; }

 private:
  struct Slot {
    io::AlignedBuffer buffer;
    std::vector<int64_t> region;  // per role: byte offset in the buffer, -1 when not on disk
    std::vector<io::AioEngine::Ticket> reads, writes;
  };

  void issue_reads(int g);
  void wait(std::vector<io::AioEngine::Ticket>& tickets);

  io::AioEngine& io_;
  const std::vector<SubGroup>& groups_;
  bool pipeline_read_, pipeline_write_;
  std::vector<Slot> slots_;
  std::vector<Role> roles_;
  double stall_seconds_ = 0;
};

// Runs kernel(chunk, p, g, m, v, half_out) over every chunk, sub-group by sub-group; the roles on
// disk are streamed (read before, written after). With separate fp32 masters (the delayed update
// in fp32) the updated masters are copied to the working values after the kernel.
template <class Kernel>
void OptimizerPartition::for_each_chunk(PassTarget target, bool writes_params, bool reads_gradients, Kernel&& kernel) {
  TieredArray* const params = separate_master_ ? &master_ : working_.partition;  // null: the flat buffer
  // The working values the step writes when they are not `params`; null: the flat buffer.
  TieredArray* const out = !separate_master_ ? nullptr : target.to_next ? &next_working_ : working_.partition;
  const bool copy_fp32 = separate_master_ && options_.working_dtype == at::kFloat;
  // Gradients on disk (nvme_gradients) are streamed in with the state.
  const TieredArray* const gradient_tier =
      reads_gradients && target.gradients && target.gradients->sharded() && target.gradients->partition().any_on_disk()
          ? &target.gradients->partition()
          : nullptr;
  enum { kParams, kExpAvg, kExpAvgSq, kOut, kGrad };
  auto address = [&](const TieredArray* a, int role, int g, const Chunk& c, auto& disk_pointer) -> void* {
    if (a == nullptr || !a->defined() || a->numel() == 0) return nullptr;
    if (a->on_disk(g)) return disk_pointer(role, c.partition_offset);
    return a->view(c.partition_offset, c.numel).data_ptr();
  };
  auto body = [&](int g, auto&& disk_pointer) {
    for (const Chunk& c : chunks_[size_t(g)]) {
      // This chunk's gradients: streamed in (on disk), the reducer's arena, or the delayed
      // update's snapshot; 16-bit ones converted to fp32 through the scratch.
      const void* grads = nullptr;
      if (reads_gradients) {
        at::Tensor grad = gradient_tier && gradient_tier->on_disk(g)
                              ? torch::from_blob(disk_pointer(kGrad, c.partition_offset), {c.numel},
                                                 torch::TensorOptions().dtype(options_.working_dtype))
                          : target.gradients ? target.gradients->owned_gradient(c.flat_offset, c.partition_offset, c.numel)
                                             : grad_snapshot_.narrow(0, c.partition_offset, c.numel);
        if (grad_scratch_.defined()) {
          at::Tensor converted = grad_scratch_.narrow(0, 0, c.numel);
          converted.copy_(grad);
          grads = converted.data_ptr<float>();
        } else {
          grads = grad.data_ptr();  // fp32 for the CPU kernels; the working dtype for the device kernels
        }
      }
      float* p = params ? static_cast<float*>(address(params, kParams, g, c, disk_pointer))
                        : working_.flat.data_ptr<float>() + c.flat_offset;
      float* m = static_cast<float*>(address(&exp_avg_, kExpAvg, g, c, disk_pointer));
      float* v = static_cast<float*>(address(&exp_avg_sq_, kExpAvgSq, g, c, disk_pointer));
      void* o = nullptr;
      if (separate_master_)
        o = out ? address(out, kOut, g, c, disk_pointer)
                : static_cast<char*>(working_.flat.data_ptr()) + c.flat_offset * int64_t(working_.flat.element_size());
      kernel(c, p, grads, m, v, copy_fp32 ? nullptr : static_cast<uint16_t*>(o));
      if (copy_fp32 && writes_params) {
        ZT_CHECK_STATE(!options_.devices.device_step(), "an fp32 copy of device masters through the host");
        std::memcpy(o, p, size_t(c.numel) * sizeof(float));
      }
    }
  };
  if (!stream_) {
    auto no_disk = [](int, int64_t) -> void* { return nullptr; };
    for (int g = 0; g < int(groups_.size()); ++g) body(g, no_disk);
    return;
  }
  // The working partition is read only when it holds the masters (plain fp32); the working copy
  // the step produces is only written.
  std::vector<Stream::Role> roles = {{params, true, writes_params},
                                     {&exp_avg_, true, true},
                                     {&exp_avg_sq_, true, true},
                                     {out, false, writes_params},
                                     {gradient_tier, true, false}};
  const double stall_before = stream_->stall_seconds();
  stream_->pass(roles, body);
  // The worker's waits for the disk are not the caller's: finish_step() counts what it waits.
  if (!target.to_next) {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    io_counters_.seconds += stream_->stall_seconds() - stall_before;
  }
}

}  // namespace zt
