// Flat-buffer layout of the trainable parameters (docs/design.md "The flat layout"): a pure
// function from the parameter list to plain data. No tensors are allocated here; the engine
// allocates arenas from it.
//
// Contract
// - Parameters are placed in reverse registration order, so that buckets fill in the order
//   backward produces gradients (the last layers first).
// - Buckets are consecutive ranges of the flat buffer. A bucket takes parameters of one group
//   while its parameter elements stay within `bucket_size`; a parameter larger than
//   `bucket_size` gets a bucket of its own. Parameters are never split across buckets.
// - Every bucket is padded at its end to a multiple of world_size × alignment elements and cut
//   into world_size equal shards: rank r owns shard r of every bucket. A rank's shards, bucket
//   after bucket, form its partition: a compact buffer of `partition_numel` elements, the same for
//   every rank. Shard offsets are multiples of `alignment` (both in the flat buffer and in the
//   partition), so every owned range starts aligned when the buffer does.
// - Every element of the flat buffer (parameter or padding) is owned by exactly one rank.
// - Thread-safe: pure functions over values.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace zt {

struct ParameterSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype = "float32";  // every parameter of one layout must have the same dtype
  int group = -1;  // a stage-3 block id (-1: none); buckets never hold two groups
};

struct LayoutOptions {
  int world_size = 1;
  int64_t alignment = 32;         // elements; shard offsets are multiples of it
  int64_t bucket_size = 500'000'000;  // parameter elements per bucket (padding not counted)
};

struct ParameterPlacement {
  int index = 0;        // position in the input list (registration order)
  int64_t offset = 0;   // element offset in the flat buffer
  int64_t numel = 0;
  int bucket = 0;
};

struct BucketLayout {
  int64_t offset = 0;           // element offset of the bucket in the flat buffer
  int64_t numel = 0;            // padded: world_size × shard_numel
  int64_t parameter_numel = 0;  // elements that belong to parameters (numel minus padding)
  int64_t shard_numel = 0;      // elements each rank owns of this bucket
  int64_t partition_offset = 0; // offset of this bucket's shard in every rank's partition
  int first_placement = 0;      // placements [first_placement, end_placement) lie in this bucket
  int end_placement = 0;
  int group = -1;               // the group of all its parameters
};

// A piece of one rank's partition that lies in one parameter (or in padding).
struct OwnedFragment {
  int placement = -1;           // index into FlatLayout::placements; -1 for padding
  int bucket = 0;
  int64_t flat_offset = 0;      // where the piece lies in the flat buffer
  int64_t partition_offset = 0; // where it lies in the owning rank's partition
  int64_t numel = 0;
  int64_t parameter_offset = 0; // element offset inside the parameter (0 for padding)
};

struct FlatLayout {
  int world_size = 1;
  int64_t alignment = 1;
  std::vector<ParameterPlacement> placements;  // in flat-buffer order
  std::vector<BucketLayout> buckets;
  int64_t total_numel = 0;      // flat buffer size, padding included
  int64_t parameter_numel = 0;  // Ψ: elements of all parameters
  int64_t partition_numel = 0;  // elements each rank owns (total_numel / world_size)

  // Flat-buffer offset of `rank`'s shard of bucket `bucket`.
  int64_t shard_offset(int bucket, int rank) const;
  // `rank`'s partition cut at parameter and padding boundaries, in partition order.
  std::vector<OwnedFragment> owned_fragments(int rank) const;
};

// Stage 3's blocks (docs/zero.md "Stage 3"): a parameter of a marked module (owners[i] >= 0, the
// module's index) with at least `persistence_threshold` elements belongs to that module's block,
// whose id is given in the order the modules' first such parameters appear; every other
// parameter is persistent (group -1: kept whole on every rank). Sets specs[i].group. Within each
// run of parameters of one module the persistent ones come first, so that in the layout's reverse
// order each block is one contiguous run of buckets followed by its persistent bucket.
struct Stage3Blocks {
  std::vector<int> module_of_block;  // block id -> the owner (module index) it was made from
  std::vector<size_t> order;         // the layout's input order, as indices into `specs` as given
};
Stage3Blocks assign_stage3_blocks(std::vector<ParameterSpec>& specs, const std::vector<int>& owners,
                                  int64_t persistence_threshold);

// Throws zt::ConfigError for bad options (world_size < 1, alignment < 1, bucket_size < 1), an
// empty list, a parameter with no elements or a negative dimension, or mixed dtypes; each message
// names the parameter or option, the expected and the found value.
FlatLayout compute_layout(const std::vector<ParameterSpec>& parameters, const LayoutOptions& options);

}  // namespace zt
