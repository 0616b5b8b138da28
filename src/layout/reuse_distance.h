// Stage 3's release rule (DeepSpeed's stage3_max_reuse_distance; docs/zero.md "Stage 3"), as a
// pure function of the block order so that the engine and the memory estimate apply the same one.
//
// A training step uses the blocks in the recorded forward order, then in reverse in backward. After
// a forward use, a block stays gathered when the elements of the uses strictly between that use and
// its next one are fewer than `max_reuse_distance`; otherwise it is released and gathered again at
// its next use. The blocks kept after their last forward use stay gathered until their gradients
// have arrived in backward. Pure functions; thread-safe.
#pragma once
#include <cstdint>
#include <vector>

namespace zt {

// forward_order[p]: the block used at forward position p; block_numel[b]: the elements block b
// gathers. Returns, for each forward position, whether the block stays gathered after that use.
std::vector<char> kept_after_forward_use(const std::vector<int>& forward_order, const std::vector<int64_t>& block_numel,
                                         int64_t max_reuse_distance);

// The elements gathered at the turn from forward to backward: the blocks kept after their last
// forward use, each counted once.
int64_t kept_at_turn(const std::vector<int>& forward_order, const std::vector<int64_t>& block_numel,
                     int64_t max_reuse_distance);

// The same when the order is unknown: `total` elements in equal blocks of `block` used once each
// in forward. The j-th block from the last has 2j blocks' uses before its backward, so
// ceil(distance / 2 blocks) of them are kept (at most all).
int64_t kept_at_turn_equal_blocks(int64_t total, int64_t block, int64_t max_reuse_distance);

}  // namespace zt
