#include "layout/reuse_distance.h"

#include <algorithm>

#include <cstddef>

namespace zt {

std::vector<char> kept_after_forward_use(const std::vector<int>& forward_order, const std::vector<int64_t>& block_numel,
                                         int64_t max_reuse_distance) {
  const std::size_t P = forward_order.size();
  // The step's uses: forward, then backward in reverse.
  auto use = [&](std::size_t t) { return t < P ? forward_order[t] : forward_order[2 * P - 1 - t]; };
  std::vector<char> kept(P, 0);
  for (std::size_t p = 0; p < P; ++p) {
    const int block = forward_order[p];
    int64_t between = 0;
    for (std::size_t t = p + 1; t < 2 * P && between < max_reuse_distance; ++t) {
      if (use(t) == block) {
        kept[p] = 1;
        break;
      }
      between += block_numel[std::size_t(use(t))];
    }
  }
  return kept;
}

int64_t kept_at_turn(const std::vector<int>& forward_order, const std::vector<int64_t>& block_numel,
                     int64_t max_reuse_distance) {
  const std::vector<char> kept = kept_after_forward_use(forward_order, block_numel, max_reuse_distance);
  std::vector<char> last_seen(block_numel.size(), 0);
  int64_t total = 0;
  for (std::size_t p = forward_order.size(); p-- > 0;) {
    const auto block = std::size_t(forward_order[p]);
    if (last_seen[block]) continue;  // only its last forward use decides
    last_seen[block] = 1;
    if (kept[p]) total += block_numel[block];
  }
  return total;
}

int64_t kept_at_turn_equal_blocks(int64_t total, int64_t block, int64_t max_reuse_distance) {
  if (max_reuse_distance <= 0 || total <= 0 || block <= 0) return 0;
  const int64_t span = std::min(max_reuse_distance, 2 * total);
  return std::min(total, (span + 2 * block - 1) / (2 * block) * block);
}

}  // namespace zt
