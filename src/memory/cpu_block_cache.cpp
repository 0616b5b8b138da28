#include "memory/cpu_block_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mremap
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zt {

namespace {

// A block's pages as consecutive ranges, each inside one kernel mapping. mremap moves a range only
// if it lies in one mapping, and a block composed of moved pieces spans as many mappings as it
// had pieces (the kernel joins them only when they came from the same one), so a block keeps the
// lengths of its ranges to be moved again. Their sum is the block's size.
using Segments = std::vector<size_t>;

struct Block {
  char* data;
  size_t bytes;
  Segments segments;
};
using FreeList = std::list<Block>;

// A composed block of more ranges than this is not extended further: each range is a kernel
// mapping (vm.max_map_count bounds them per process), and each is one mremap to move it again.
constexpr size_t kMaxSegmentsPerBlock = 64;
// Past this many ranges held by all blocks together, no block is composed: requests the cached
// blocks do not fit get new pages, as without composition.
constexpr size_t kMaxSegmentsHeld = 16384;

// One mutex and one table of live large blocks for every instance: the deleter LibTorch calls
// gets the data pointer alone (raw_deleter's contract), so it finds the block's owner here.
struct LiveBlock {
  CpuBlockCache* owner;
  size_t bytes;
  Segments segments;
};
std::mutex& global_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<void*, LiveBlock>& live_blocks() {
  static auto* table = new std::unordered_map<void*, LiveBlock>();  // never destroyed: tensors may outlive main
  return *table;
}

size_t page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

void unmap_all(const std::vector<Block>& blocks) {
  for (const auto& b : blocks) munmap(b.data, b.bytes);
}

// Cuts `block` after `head` bytes (0 < head < block.bytes): `block` keeps the head, the tail is
// returned. No system call: both stay in the mappings they were in.
Block split_off_tail(Block& block, size_t head) {
  size_t offset = 0;
  size_t i = 0;
  while (offset + block.segments[i] <= head) offset += block.segments[i++];
  Block tail{block.data + head, block.bytes - head, {}};
  Segments head_segments(block.segments.begin(), block.segments.begin() + long(i));
  if (head > offset) head_segments.push_back(head - offset);
  tail.segments.push_back(offset + block.segments[i] - head);
  tail.segments.insert(tail.segments.end(), block.segments.begin() + long(i) + 1, block.segments.end());
  block.segments = std::move(head_segments);
  block.bytes = head;
  return tail;
}

// What an allocation takes from the cache under its mutex: a cached block that serves it now
// (`served`, whole or the head of a larger one), or the cached blocks to be moved into a new
// mapping (`pieces`, `covered` bytes) and those to unmap to stay within the bound.
struct Claim {
  Block served{nullptr, 0, {}};
  std::vector<Block> pieces;
  size_t covered = 0;
  std::vector<Block> evicted;
};

}  // namespace

struct CpuBlockCache::State {
  size_t large_block_bytes;
  double slack_fraction;
  FreeList oldest_first;                              // cached blocks, least recently freed first
  std::map<size_t, std::vector<FreeList::iterator>> by_size;  // the same blocks by size
  CpuBlockCacheStats stats;
  size_t segments_held = 0;  // ranges of every live and cached block

  void remember(Block block) {
    stats.cached_bytes += static_cast<int64_t>(block.bytes);
    const size_t bytes = block.bytes;
    oldest_first.push_back(std::move(block));
    by_size[bytes].push_back(std::prev(oldest_first.end()));
  }
  // Takes a cached block out of both indexes (the caller holds the mutex).
  Block take(FreeList::iterator it) {
    auto bucket = by_size.find(it->bytes);
    auto& v = bucket->second;
    v.erase(std::find(v.begin(), v.end(), it));
    if (v.empty()) by_size.erase(bucket);
    stats.cached_bytes -= static_cast<int64_t>(it->bytes);
    Block block = std::move(*it);
    oldest_first.erase(it);
    return block;
  }
  // Whether `bytes` more can be mapped with every cached block kept.
  bool fits_beside(size_t bytes) const { return stats.live_bytes + stats.cached_bytes + int64_t(bytes) <= limit(bytes); }
  int64_t limit(size_t bytes) const {
    return std::max(stats.high_water_bytes, stats.live_bytes + int64_t(bytes)) +
           static_cast<int64_t>(slack_fraction * double(stats.high_water_bytes));
  }
  // Takes the oldest cached blocks out until `bytes` more fit under the bound; returns them for
  // unmapping outside the mutex.
  std::vector<Block> make_room(size_t bytes) {
    std::vector<Block> out;
    const auto need = static_cast<int64_t>(bytes);
    while (!oldest_first.empty() && stats.live_bytes + stats.cached_bytes + need > limit(bytes)) {
      out.push_back(take(oldest_first.begin()));
      segments_held -= out.back().segments.size();
      ++stats.unmapped;
    }
    return out;
  }
  std::vector<Block> take_all() {
    std::vector<Block> out;
    while (!oldest_first.empty()) {
      out.push_back(take(oldest_first.begin()));
      segments_held -= out.back().segments.size();
    }
    stats.unmapped += out.size();
    return out;
  }
  // Takes cached blocks, oldest first, until they cover `bytes` (the last one cut to fit) or no
  // more ranges may be added; returns them in that order.
  std::vector<Block> take_pieces(size_t bytes) {
    std::vector<Block> pieces;
    size_t covered = 0, segments = 0;
    for (auto it = oldest_first.begin(); it != oldest_first.end() && covered < bytes;) {
      const auto next = std::next(it);
      // +1: the range of new pages that completes the block when the pieces fall short
      if (segments + it->segments.size() + 1 <= kMaxSegmentsPerBlock) {
        Block piece = take(it);
        if (covered + piece.bytes > bytes) {
          const size_t before = piece.segments.size();
          Block tail = split_off_tail(piece, bytes - covered);
          segments_held += piece.segments.size() + tail.segments.size() - before;
          remember(std::move(tail));  // at the back: the loop ends before reaching it
        }
        covered += piece.bytes;
        segments += piece.segments.size();
        pieces.push_back(std::move(piece));
      }
      it = next;
    }
    return pieces;
  }
  // Decides how `mapped` bytes are served and counts them live (the caller holds the mutex).
  Claim claim(size_t mapped) {
    Claim c;
    ++stats.large_allocations;
    // The smallest cached block that fits, unless it wastes more than an eighth: sizes that vary
    // a little from step to step (the masked rows of BERT's logits) still find their block.
    auto larger = by_size.lower_bound(mapped);
    const bool fits_whole = larger != by_size.end() && larger->first <= mapped + mapped / 8;
    // Past the bound, a larger cached block gives its head, or smaller ones are moved together.
    const bool from_cached = !fits_whole && !by_size.empty() && !fits_beside(mapped);
    if (fits_whole || (from_cached && larger != by_size.end())) {
      c.served = take(larger->second.back());
      if (fits_whole) {
        ++stats.reused;
      } else {
        const size_t before = c.served.segments.size();
        Block tail = split_off_tail(c.served, mapped);
        segments_held += c.served.segments.size() + tail.segments.size() - before;
        remember(std::move(tail));
        ++stats.split;
      }
      stats.live_bytes += static_cast<int64_t>(c.served.bytes);
      stats.high_water_bytes = std::max(stats.high_water_bytes, stats.live_bytes);
      return c;
    }
    // No block of about this size. While a new mapping fits beside every cached block, map one:
    // the cache then comes to hold each size the steps ask for, and later steps fault nothing
    // in. Past the bound, every cached block is smaller: move them, oldest first, into one
    // mapping, so that the resident set stays within the live peak however the sizes vary and
    // only what they lack is faulted in.
    if (from_cached && segments_held < kMaxSegmentsHeld) {
      c.pieces = take_pieces(mapped);
      for (const auto& p : c.pieces) c.covered += p.bytes;
      if (!c.pieces.empty()) ++stats.composed;
    }
    stats.live_bytes += static_cast<int64_t>(c.covered);
    c.evicted = make_room(mapped - c.covered);
    // Counted live before the mapping exists so that a concurrent miss sees it in the bound.
    stats.live_bytes += static_cast<int64_t>(mapped - c.covered);
    stats.mapped_bytes += mapped - c.covered;
    if (c.pieces.empty()) ++stats.mapped;
    stats.high_water_bytes = std::max(stats.high_water_bytes, stats.live_bytes);
    return c;
  }
};

namespace {
// A new mapping of `bytes` whose first ranges are the pieces' pages, moved there in order by
// mremap (page tables move; nothing is copied or faulted in), the rest new pages. Outside the
// cache's mutex. `moved` gets the bytes actually moved, `segments` the block's ranges. On a failed
// mapping the pieces are unmapped and MAP_FAILED returned.
void* compose_block(const std::vector<Block>& pieces, size_t bytes, size_t& moved, Segments& segments) {
  moved = 0;
  void* target = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (target == MAP_FAILED) {
    unmap_all(pieces);
    return MAP_FAILED;
  }
  char* at = static_cast<char*>(target);
  for (const auto& piece : pieces) {
    char* from = piece.data;
    for (const size_t length : piece.segments) {
      // A failed move (no mapping left in the process) leaves new pages in its place.
      if (mremap(from, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED)
        munmap(from, length);
      else
        moved += length;
      segments.push_back(length);
      from += length;
      at += length;
    }
  }
  char* const end = static_cast<char*>(target) + bytes;
  if (at < end) segments.push_back(size_t(end - at));
  return target;
}
}  // namespace

void release_cpu_block(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    auto& live = live_blocks();
    auto found = live.find(data);
    if (found != live.end()) {
      auto& s = *found->second.owner->state_;
      Block block{static_cast<char*>(data), found->second.bytes, std::move(found->second.segments)};
      live.erase(found);
      s.stats.live_bytes -= static_cast<int64_t>(block.bytes);
      s.remember(std::move(block));
      return;
    }
  }
  c10::free_cpu(data);
}

CpuBlockCache::CpuBlockCache(size_t large_block_bytes, double slack_fraction)
    : state_(new State{std::max(large_block_bytes, page_bytes()), slack_fraction, {}, {}, {}}) {
  if (!(slack_fraction >= 0.0)) {
    delete state_;
    throw std::invalid_argument("CpuBlockCache: slack_fraction must be >= 0");
  }
}

CpuBlockCache::~CpuBlockCache() {
  std::vector<Block> cached;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    cached = state_->take_all();
  }
  unmap_all(cached);
  delete state_;
}

c10::DataPtr CpuBlockCache::allocate(size_t bytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (bytes < state_->large_block_bytes) {
    void* data = c10::alloc_cpu(bytes);
    return {data, data, &release_cpu_block, cpu};
  }
  const size_t page = page_bytes();
  const size_t mapped = (bytes + page - 1) / page * page;
  Claim claim;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    claim = state_->claim(mapped);
    if (claim.served.data != nullptr) {
      void* data = claim.served.data;
      live_blocks().emplace(data, LiveBlock{this, claim.served.bytes, std::move(claim.served.segments)});
      return {data, data, &release_cpu_block, cpu};
    }
  }
  auto& pieces = claim.pieces;
  const size_t covered = claim.covered;
  unmap_all(claim.evicted);
  void* data = MAP_FAILED;
  Segments segments;
  size_t moved = 0;
  if (pieces.empty()) {
    data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    segments.push_back(mapped);
  } else {
    data = compose_block(pieces, mapped, moved, segments);
  }
  if (data == MAP_FAILED) {
    std::vector<Block> all;
    {
      std::lock_guard<std::mutex> lock(global_mutex());
      all = state_->take_all();
    }
    unmap_all(all);
    data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    segments.assign(1, mapped);
    moved = 0;
  }
  std::lock_guard<std::mutex> lock(global_mutex());
  auto& s = *state_;
  size_t pieces_segments = 0;
  for (const auto& p : pieces) pieces_segments += p.segments.size();
  s.segments_held -= pieces_segments;
  if (data == MAP_FAILED) {
    s.stats.live_bytes -= static_cast<int64_t>(mapped);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "zerotrain CPU block cache: could not map ", mapped,
                     " bytes for a tensor of ", bytes, " bytes (", s.stats.live_bytes,
                     " bytes live); the system is out of memory");
  }
  s.stats.moved_bytes += moved;
  s.stats.mapped_bytes += covered - moved;  // pieces that could not be moved: new pages instead
  s.segments_held += segments.size();
  live_blocks().emplace(data, LiveBlock{this, mapped, std::move(segments)});
  return {data, data, &release_cpu_block, cpu};
}

c10::DeleterFnPtr CpuBlockCache::raw_deleter() const { return &release_cpu_block; }

void CpuBlockCache::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

CpuBlockCacheStats CpuBlockCache::stats() const {
  std::lock_guard<std::mutex> lock(global_mutex());
  return state_->stats;
}

void CpuBlockCache::release_cached() {
  std::vector<Block> all;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    all = state_->take_all();
  }
  unmap_all(all);
}

void CpuBlockCache::reset_high_water() {
  std::vector<Block> all;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    all = state_->take_all();
    state_->stats.high_water_bytes = state_->stats.live_bytes;
  }
  unmap_all(all);
}

namespace {
CpuBlockCache* installed = nullptr;
}

CpuBlockCache& install_cpu_block_cache() {
  static CpuBlockCache* instance = [] {
    auto* cache = new CpuBlockCache();  // never destroyed: tensors it allocated may outlive main
    // Priority above LibTorch's default (0), so that no later default registration replaces it.
    c10::SetCPUAllocator(cache, /*priority=*/1);
    installed = cache;
    return cache;
  }();
  return *instance;
}

CpuBlockCache* installed_cpu_block_cache() { return installed; }

}  // namespace zt
