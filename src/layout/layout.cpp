#include "zerotrain/layout/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "zerotrain/error.h"

namespace zt {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

int64_t element_count(const ParameterSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) {
    if (d < 0) throw ConfigError(fmt::format("layout: parameter '{}' has a negative dimension {}", spec.name, d));
    n *= d;
  }
  if (n == 0) throw ConfigError(fmt::format("layout: parameter '{}' has no elements (expected at least 1)", spec.name));
  return n;
}

}  // namespace

Stage3Blocks assign_stage3_blocks(std::vector<ParameterSpec>& specs, const std::vector<int>& owners,
                                  int64_t persistence_threshold) {
  Stage3Blocks blocks;
  std::vector<int> block_of_owner;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int owner = owners[i];
    int64_t numel = 1;
    for (int64_t d : specs[i].shape) numel *= d;
    if (owner < 0 || numel < persistence_threshold) continue;
    if (size_t(owner) >= block_of_owner.size()) block_of_owner.resize(size_t(owner) + 1, -1);
    if (block_of_owner[size_t(owner)] < 0) {
      block_of_owner[size_t(owner)] = int(blocks.module_of_block.size());
      blocks.module_of_block.push_back(owner);
    }
    specs[i].group = block_of_owner[size_t(owner)];
  }
  blocks.order.resize(specs.size());
  std::iota(blocks.order.begin(), blocks.order.end(), size_t(0));
  for (size_t begin = 0; begin < blocks.order.size();) {
    size_t end = begin + 1;
    while (end < blocks.order.size() && owners[end] == owners[begin]) ++end;
    if (owners[begin] >= 0)
      std::stable_partition(blocks.order.begin() + long(begin), blocks.order.begin() + long(end),
                            [&](size_t i) { return specs[i].group < 0; });
    begin = end;
  }
  return blocks;
}

FlatLayout compute_layout(const std::vector<ParameterSpec>& parameters, const LayoutOptions& options) {
  if (options.world_size < 1)
    throw ConfigError(fmt::format("layout: world_size must be at least 1, found {}", options.world_size));
  if (options.alignment < 1)
    throw ConfigError(fmt::format("layout: alignment must be at least 1 element, found {}", options.alignment));
  if (options.bucket_size < 1)
    throw ConfigError(fmt::format("layout: bucket_size must be at least 1 element, found {}", options.bucket_size));
  if (parameters.empty()) throw ConfigError("layout: expected at least one parameter, found none");
  for (const auto& p : parameters)
    if (p.dtype != parameters.front().dtype)
      throw ConfigError(fmt::format("layout: every parameter must have the dtype of '{}' ({}), found {} for '{}'",
                                    parameters.front().name, parameters.front().dtype, p.dtype, p.name));

  FlatLayout layout;
  layout.world_size = options.world_size;
  layout.alignment = options.alignment;
  const int64_t quantum = int64_t(options.world_size) * options.alignment;
  int64_t offset = 0;
  auto close_bucket = [&] {
    BucketLayout& b = layout.buckets.back();
    b.numel = round_up(offset - b.offset, quantum);
    b.shard_numel = b.numel / options.world_size;
    b.end_placement = int(layout.placements.size());
    offset = b.offset + b.numel;
  };
  for (int i = int(parameters.size()) - 1; i >= 0; --i) {
    const int64_t n = element_count(parameters[i]);
    const bool open = !layout.buckets.empty() && layout.buckets.back().end_placement < 0;
    if (open && (layout.buckets.back().parameter_numel + n > options.bucket_size ||
                 layout.buckets.back().group != parameters[i].group))
      close_bucket();
    if (layout.buckets.empty() || layout.buckets.back().end_placement >= 0) {
      BucketLayout b;
      b.offset = offset;
      b.first_placement = int(layout.placements.size());
      b.end_placement = -1;  // open
      b.group = parameters[i].group;
      b.partition_offset = layout.buckets.empty()
                               ? 0
                               : layout.buckets.back().partition_offset + layout.buckets.back().shard_numel;
      layout.buckets.push_back(b);
    }
    layout.placements.push_back({i, offset, n, int(layout.buckets.size()) - 1});
    layout.buckets.back().parameter_numel += n;
    layout.parameter_numel += n;
    offset += n;
  }
  close_bucket();
  layout.total_numel = offset;
  layout.partition_numel = layout.total_numel / options.world_size;
  return layout;
}

int64_t FlatLayout::shard_offset(int bucket, int rank) const {
  const BucketLayout& b = buckets.at(bucket);
  return b.offset + int64_t(rank) * b.shard_numel;
}

std::vector<OwnedFragment> FlatLayout::owned_fragments(int rank) const {
  if (rank < 0 || rank >= world_size)
    throw ConfigError(fmt::format("layout: rank must be in 0..{}, found {}", world_size - 1, rank));
  std::vector<OwnedFragment> fragments;
  for (int bi = 0; bi < int(buckets.size()); ++bi) {
    const BucketLayout& b = buckets[bi];
    const int64_t begin = shard_offset(bi, rank), end = begin + b.shard_numel;
    int64_t cursor = begin;
    auto emit = [&](int placement, int64_t from, int64_t to, int64_t parameter_offset) {
      if (to <= from) return;
      fragments.push_back({placement, bi, from, b.partition_offset + (from - begin), to - from, parameter_offset});
    };
    for (int pi = b.first_placement; pi < b.end_placement && cursor < end; ++pi) {
      const ParameterPlacement& p = placements[pi];
      const int64_t from = std::max(cursor, p.offset), to = std::min(end, p.offset + p.numel);
      if (to <= from) continue;
      emit(-1, cursor, from, 0);
      emit(pi, from, to, from - p.offset);
      cursor = to;
    }
    emit(-1, cursor, end, 0);
  }
  return fragments;
}

}  // namespace zt
