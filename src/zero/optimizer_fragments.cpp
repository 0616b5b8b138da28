#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zero/optimizer_partition.h"
#include "zerotrain/memory/memory.h"

// The optimizer partition's side of checkpoints (docs/checkpoint.md): its state as fragments by
// parameter name, for saving (views, or sources that read NVMe piece by piece) and for loading
// (staging that changes nothing until committed), and the working copy rounded from loaded masters.

namespace zt {

void OptimizerPartition::refresh_working_from_masters() {
  if (!separate_master_) return;
  // In pieces of a checkpoint chunk: host memory stays bounded whatever the tiers.
  const int64_t piece = checkpoint_chunk_bytes() / int64_t(sizeof(float));
  TransferScratch scratch;
  at::Tensor masters, rounded;
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    for (int64_t done = 0; done < f.numel;) {
      const int64_t n = std::min(piece, f.numel - done);
      if (!masters.defined() || masters.numel() < n) {
        masters = rounded = at::Tensor();
        masters = torch::empty({n}, torch::kFloat32);
      }
      at::Tensor m = masters.narrow(0, 0, n);
      master_.read_elements(f.partition_offset + done, n, m.data_ptr(), scratch);
      if (working_.partition) {
        if (!rounded.defined() || rounded.numel() < n) rounded = torch::empty({n}, options_.working_dtype);
        at::Tensor r = rounded.narrow(0, 0, n);
        r.copy_(m);
        working_.partition->write_elements(f.partition_offset + done, n, r.data_ptr(), scratch);
      } else {
        working_.flat.narrow(0, f.flat_offset + done, n).copy_(m);
      }
      done += n;
    }
  }
}

std::vector<StateFragment> OptimizerPartition::fragments(bool with_moments,
                                                         const std::function<std::string(int)>& name_of) const {
  std::vector<StateFragment> out;
  const TieredArray* params = separate_master_ ? &master_ : working_.partition;
  auto scratch = std::make_shared<TransferScratch>();  // shared by the sources: one piece at a time
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;  // padding
    StateFragment s;
    s.parameter = name_of(f.placement);
    s.begin = f.parameter_offset;
    s.numel = f.numel;
    auto add = [&](const std::string& role, const TieredArray& a) {
      if (a.in_memory(f.partition_offset, f.numel)) {
        s.roles[role] = a.view(f.partition_offset, f.numel);
        return;
      }
      s.sources[role] = [&a, scratch, at = f.partition_offset](int64_t offset, int64_t count, float* values) {
        a.read_elements(at + offset, count, values, *scratch);
      };
    };
    if (params) add("master", *params);
    else s.roles["master"] = working_.flat.narrow(0, f.flat_offset, f.numel);
    if (with_moments && exp_avg_.numel()) add("exp_avg", exp_avg_);
    if (with_moments && exp_avg_sq_.numel()) add("exp_avg_sq", exp_avg_sq_);
    out.push_back(std::move(s));
  }
  return out;
}

OptimizerPartition::Staged OptimizerPartition::staged_fragments(bool with_moments,
                                                               const std::function<std::string(int)>& name_of) {
  Staged staged;
  staged.scratch = std::make_shared<TransferScratch>();
  TieredArray* params = separate_master_ ? &master_ : working_.partition;
  auto staging_of = [&](TieredArray& a) -> std::shared_ptr<TieredStaging> {
    if (!a.any_on_disk()) return nullptr;
    for (const auto& s : staged.arrays)
      if (&s->live() == &a) return s;
    return staged.arrays.emplace_back(std::make_shared<TieredStaging>(a));
  };
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    StateFragment s;
    s.parameter = name_of(f.placement);
    s.begin = f.parameter_offset;
    s.numel = f.numel;
    auto add = [&](const std::string& role, TieredArray* a) {
      if (auto staging = a ? staging_of(*a) : nullptr) {
        s.sinks[role] = [staging, scratch = staged.scratch, at = f.partition_offset](int64_t offset, int64_t count,
                                                                                    const float* values) {
          staging->write(at + offset, count, values, *scratch);
        };
      } else {
        s.roles[role] = torch::empty({f.numel}, torch::kFloat32);
      }
    };
    add("master", params);
    if (with_moments && exp_avg_.numel()) add("exp_avg", &exp_avg_);
    if (with_moments && exp_avg_sq_.numel()) add("exp_avg_sq", &exp_avg_sq_);
    staged.fragments.push_back(std::move(s));
  }
  return staged;
}

void OptimizerPartition::commit_fragments(Staged& staged) {
  TieredArray* params = separate_master_ ? &master_ : working_.partition;
  size_t i = 0;
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    const StateFragment& s = staged.fragments.at(i++);
    for (const auto& [role, values] : s.roles) {
      if (role == "master") {
        if (params) params->store(f.partition_offset, values);
        else working_.flat.narrow(0, f.flat_offset, f.numel).copy_(values);
      } else if (role == "exp_avg") {
        exp_avg_.store(f.partition_offset, values);
      } else if (role == "exp_avg_sq") {
        exp_avg_sq_.store(f.partition_offset, values);
      }
    }
  }
  for (const auto& array : staged.arrays) array->commit();
}

}  // namespace zt
