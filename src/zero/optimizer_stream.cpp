#include <algorithm>
#include <chrono>

#include "zero/optimizer_stream.h"

// The optimizer step's stream of NVMe sub-groups (docs/offload.md "The step"): a ring of aligned
// buffers, each sized for every disk role of the largest sub-group, reads ahead and write-backs.

namespace zt {

OptimizerPartition::Stream::Stream(io::AioEngine& io, const std::vector<SubGroup>& groups, int buffer_count,
                                   bool pipeline_read, bool pipeline_write,
                                   const std::vector<const TieredArray*>& arrays,
                                   const std::vector<int64_t>& extra_bytes)
    : io_(io), groups_(groups), pipeline_read_(pipeline_read), pipeline_write_(pipeline_write) {
  // One buffer holds every disk role of the largest sub-group.
  int64_t largest = 0;
  for (int g = 0; g < int(groups.size()); ++g) {
    int64_t bytes = extra_bytes.empty() ? 0 : extra_bytes[size_t(g)];
    for (const TieredArray* a : arrays)
      if (a && a->on_disk(g)) bytes += a->buffer_bytes(g);
    largest = std::max(largest, bytes);
  }
  slots_.resize(size_t(std::max(1, buffer_count)));
  if (largest > 0)
    for (Slot& s : slots_) s.buffer = io::AlignedBuffer(largest);
}

int64_t OptimizerPartition::Stream::buffer_bytes() const {
  int64_t total = 0;
  for (const Slot& s : slots_) total += s.buffer.size();
  return total;
}

void OptimizerPartition::Stream::issue_reads(int g) {
  Slot& slot = slots_[size_t(g % int(slots_.size()))];
  wait(slot.writes);  // the buffer's previous sub-group must be on disk before it is reused
  slot.region.assign(roles_.size(), -1);
  int64_t at = 0;
  for (size_t r = 0; r < roles_.size(); ++r) {
    const TieredArray* a = roles_[r].array;
    if (!a || !a->on_disk(g)) continue;
    slot.region[r] = at;
    if (roles_[r].read) slot.reads.push_back(a->read(g, static_cast<char*>(slot.buffer.data()) + at));
    at += a->buffer_bytes(g);
  }
}

void OptimizerPartition::Stream::wait(std::vector<io::AioEngine::Ticket>& tickets) {
  if (tickets.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  for (auto t : tickets) io_.wait(t);
  tickets.clear();
  stall_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace zt
