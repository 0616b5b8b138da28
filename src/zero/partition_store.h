// Where this rank's partition state lives: one TieredArray per role (fp32 master weights, the
// optimizer moments, the stage-3 working parameters), each element range either in host memory
// or in a swap file on NVMe (ZeRO-Infinity; docs/offload.md). Internal to the engine.
//
// Contract
// - The partition [0, P) is cut into sub-groups (plan_sub_groups, layout/offload_plan.h): the unit
//   a swap file is read and written in. Sub-groups never straddle a bucket's shard, so a stage-3
//   block (whole buckets) is whole sub-groups too. Which sub-groups of a role are on disk is the
//   offload plan's decision; the array creates exactly the file the plan counted
//   (swap_file_bytes).
// - A TieredArray keeps the sub-groups it was told to keep in memory in one exact-size tensor, in
//   partition order (all in memory: that tensor is the partition's arena, with no copy or
//   indirection anywhere), and the others in its swap file, each sub-group at an aligned offset.
// - Disk sub-groups are reachable by read()/write() of whole sub-groups into caller-owned aligned
//   buffers (the step), and by read_elements()/write_elements() of any element range through a
//   TransferScratch (checkpoints: memory bounded by the range, not the sub-group); memory
//   sub-groups by view(). Not thread-safe; the I/O itself runs on the AioEngine's threads.
// - TieredStaging is a checkpoint load's copy of an array with sub-groups on disk: filled piece by
//   piece into a fresh swap file beside the live one, it replaces the live content only by
//   commit(), and is removed if never committed (docs/offload.md "Checkpoints").
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "layout/offload_plan.h"
#include "zerotrain/layout/layout.h"

namespace zt {

namespace io {
class AioEngine;
}

// Aligned host memory for element-range transfers, grown to the largest request. Allocated
// through LibTorch's CPU allocator like the state's own tensors, so that memory accounting
// (tests included) sees it.
class TransferScratch {
 public:
  // At least `bytes`, aligned for O_DIRECT; valid until the next call.
  void* get(int64_t bytes);
  int64_t capacity() const { return capacity_; }

 private:
  at::Tensor storage_;
  void* aligned_ = nullptr;
  int64_t capacity_ = 0;
};

class TieredStaging;

class TieredArray {
 public:
  TieredArray() = default;
  // Every element in memory, zero-filled, on `device` (host memory page-locked when `pinned`).
  TieredArray(std::string role, at::ScalarType dtype, int64_t numel, c10::Device device = c10::kCPU,
              bool pinned = false);
  // Sub-group g on disk where on_disk[g], in `file` (created, sized swap_file_bytes()), the rest
  // in memory (zeros; page-locked when `pinned`).
  TieredArray(std::string role, at::ScalarType dtype, const std::vector<SubGroup>& groups,
              const std::vector<char>& on_disk, io::AioEngine& io, const std::filesystem::path& file,
              bool pinned = false);

  bool defined() const { return numel_ > 0 || memory_.defined(); }
  const std::string& role() const { return role_; }
  at::ScalarType dtype() const { return dtype_; }
  int64_t element_size() const;
  int64_t numel() const { return numel_; }
  bool on_disk(int g) const { return !disk_.empty() && disk_[g]; }
  bool any_on_disk() const { return disk_count_ > 0; }

  // [begin, begin + n) of the partition, which must lie in memory sub-groups.
  at::Tensor view(int64_t begin, int64_t n) const;
  // The memory tensor (the whole arena when nothing is on disk).
  const at::Tensor& memory() const { return memory_; }
  int64_t memory_bytes() const;
  int64_t disk_bytes() const { return file_bytes_; }

  // Synchronous copies of [begin, begin + values.numel()) in or out (converted to or from this
  // array's dtype), across sub-groups and tiers; a disk sub-group only partly covered is read,
  // changed and written back. For construction and checkpoints, not for the step.
  void store(int64_t begin, const at::Tensor& values);
  void load(int64_t begin, at::Tensor& out) const;
  void fill_zero();

  // Whether [begin, begin + n) lies in memory sub-groups only (so that view() reaches it).
  bool in_memory(int64_t begin, int64_t n) const;
  // Synchronous copies of elements [begin, begin + count) to or from `data` (in this array's
  // dtype), across sub-groups and tiers. A disk sub-group is transferred only in the pages the
  // range touches, through `scratch` (at most the range's bytes plus two pages); a write reads the
  // partly covered first and last pages first. For checkpoints, in pieces of bounded size.
  void read_elements(int64_t begin, int64_t count, void* data, TransferScratch& scratch) const;
  void write_elements(int64_t begin, int64_t count, const void* data, TransferScratch& scratch);

  // Disk sub-groups: bytes a buffer must hold (aligned), and asynchronous transfers of the whole
  // sub-group; the returned ticket is waited on the AioEngine.
  int64_t buffer_bytes(int g) const;
  int64_t read(int g, void* destination) const;
  int64_t write(int g, const void* source) const;
  const std::filesystem::path& file() const { return path_; }

 private:
  friend class TieredStaging;
  // Element range [from, to) of disk sub-group g: its pages' byte range in the file, relative to
  // the sub-group's place, [*first, *last).
  void page_span(int g, int64_t from, int64_t to, int64_t* first, int64_t* last) const;
  int group_of(int64_t begin) const;
  std::string role_;
  at::ScalarType dtype_ = at::kFloat;
  int64_t numel_ = 0;
  at::Tensor memory_;
  std::vector<SubGroup> groups_;
  std::vector<char> disk_;
  std::vector<int64_t> place_;  // per sub-group: memory element offset, or file byte offset
  int disk_count_ = 0;
  int64_t file_bytes_ = 0;
  io::AioEngine* io_ = nullptr;
  int file_id_ = -1;
  std::filesystem::path path_;
};

// A checkpoint load's copy of a TieredArray that has sub-groups on disk: the same dtype,
// sub-groups and tiers, zeros until written, its disk sub-groups in a swap file beside the live
// one, "<live file>.staging", created (and allocated, so that a full disk fails here) by the first
// write. Elements not written stay zero (the padding between fragments, zero in the live array
// too).
// - commit() makes the staged values the live array's: the memory part is copied into the
//   live tensor (which others may view), and the staging file takes the live file's place
//   (renamed over it; the live descriptor is closed). No transfer: it cannot fail half-way. No
//   transfer of the live file may be in flight.
// - Destroyed uncommitted (a failed load), it closes and removes its file; the live array is
//   untouched. Never throws from the destructor.
// Transient disk space: one more copy of the live array's swap file while a load runs.
class TieredStaging {
 public:
  explicit TieredStaging(TieredArray& live);
  ~TieredStaging();
  TieredStaging(const TieredStaging&) = delete;
  TieredStaging& operator=(const TieredStaging&) = delete;

  // Elements [begin, begin + count) of the partition, in the array's dtype, in any order.
  void write(int64_t begin, int64_t count, const void* values, TransferScratch& scratch);
  void commit();
  const TieredArray& live() const { return live_; }

 private:
  TieredArray& live_;
  TieredArray staged_;
  bool created_ = false, committed_ = false;
};

}  // namespace zt
