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

struct FreeBlock {
  void* data;
  size_t bytes;
};
using FreeList = std::list<FreeBlock>;

// One mutex and one table of live large blocks for every instance: the deleter LibTorch calls
// gets the data pointer alone (raw_deleter's contract), so it finds the block's owner here.
struct LiveBlock {
  CpuBlockCache* owner;
  size_t bytes;
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

void unmap_all(const std::vector<FreeBlock>& blocks) {
  for (const auto& b : blocks) munmap(b.data, b.bytes);
}

}  // namespace

struct CpuBlockCache::State {
  size_t large_block_bytes;
  double slack_fraction;
  FreeList oldest_first;                              // cached blocks, least recently freed first
  std::map<size_t, std::vector<FreeList::iterator>> by_size;  // the same blocks by size
  CpuBlockCacheStats stats;

  // Removes a cached block from both indexes (the caller holds the mutex).
  void forget(FreeList::iterator it) {
    auto bucket = by_size.find(it->bytes);
    auto& v = bucket->second;
    v.erase(std::find(v.begin(), v.end(), it));
    if (v.empty()) by_size.erase(bucket);
    stats.cached_bytes -= static_cast<int64_t>(it->bytes);
    oldest_first.erase(it);
  }
  // Whether `bytes` more can be mapped with every cached block kept.
  bool fits_beside(size_t bytes) const { return stats.live_bytes + stats.cached_bytes + int64_t(bytes) <= limit(bytes); }
  int64_t limit(size_t bytes) const {
    return std::max(stats.high_water_bytes, stats.live_bytes + int64_t(bytes)) +
           static_cast<int64_t>(slack_fraction * double(stats.high_water_bytes));
  }
  // Takes the oldest cached blocks out until `bytes` more fit under the bound; returns them for
  // unmapping outside the mutex.
  std::vector<FreeBlock> make_room(size_t bytes) {
    std::vector<FreeBlock> out;
    const auto need = static_cast<int64_t>(bytes);
    while (!oldest_first.empty() && stats.live_bytes + stats.cached_bytes + need > limit(bytes)) {
      out.push_back(oldest_first.front());
      forget(oldest_first.begin());
      ++stats.unmapped;
    }
    return out;
  }
  std::vector<FreeBlock> take_all() {
    std::vector<FreeBlock> out(oldest_first.begin(), oldest_first.end());
    stats.unmapped += out.size();
    oldest_first.clear();
    by_size.clear();
    stats.cached_bytes = 0;
    return out;
  }
};

namespace {
// `mapped` bytes outside the cache's mutex: the taken block `resized` trimmed or grown to that
// size, or a new mapping when none was taken (resized.data null). MAP_FAILED when the system has
// no memory left; the taken block is unmapped then.
void* map_block(FreeBlock resized, size_t mapped) {
  if (resized.data != nullptr && resized.bytes >= mapped) {
    if (resized.bytes > mapped) munmap(static_cast<char*>(resized.data) + mapped, resized.bytes - mapped);
    return resized.data;
  }
  if (resized.data != nullptr) {
    void* data = mremap(resized.data, resized.bytes, mapped, MREMAP_MAYMOVE);
    if (data != MAP_FAILED) return data;
    munmap(resized.data, resized.bytes);
  }
  return mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
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
      const size_t bytes = found->second.bytes;
      live.erase(found);
      s.stats.live_bytes -= static_cast<int64_t>(bytes);
      s.stats.cached_bytes += static_cast<int64_t>(bytes);
      s.oldest_first.push_back({data, bytes});
      s.by_size[bytes].push_back(std::prev(s.oldest_first.end()));
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
  std::vector<FreeBlock> cached;
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
  std::vector<FreeBlock> evicted;
  FreeBlock resized{nullptr, 0};  // a cached block taken to be trimmed or grown to `mapped`
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    auto& s = *state_;
    ++s.stats.large_allocations;
    // The smallest cached block that fits, unless it wastes more than an eighth: sizes that vary
    // a little from step to step (the masked rows of BERT's logits) still find their block.
    auto larger = s.by_size.lower_bound(mapped);
    if (larger != s.by_size.end() && larger->first <= mapped + mapped / 8) {
      const auto it = larger->second.back();
      void* data = it->data;
      const size_t block = it->bytes;
      s.forget(it);
      s.stats.live_bytes += static_cast<int64_t>(block);
      s.stats.high_water_bytes = std::max(s.stats.high_water_bytes, s.stats.live_bytes);
      ++s.stats.reused;
      live_blocks().emplace(data, LiveBlock{this, block});
      return {data, data, &release_cpu_block, cpu};
    }
    // No block of about this size. While a new mapping fits beside every cached block, map one:
    // the cache then comes to hold each size the steps ask for, and later steps fault nothing
    // in. Past the bound, resize the cached block nearest in size instead, so that only the
    // difference is unmapped (a larger block's tail) or faulted in (a smaller block grown in
    // place or moved by mremap, which moves pages without copying them).
    if (!s.by_size.empty() && !s.fits_beside(mapped)) {
      auto smaller = larger == s.by_size.begin() ? s.by_size.end() : std::prev(larger);
      auto nearest = larger;
      if (nearest == s.by_size.end() ||
          (smaller != s.by_size.end() && mapped - smaller->first < larger->first - mapped))
        nearest = smaller;
      const auto it = nearest->second.back();
      resized = *it;
      s.forget(it);
      s.stats.live_bytes += static_cast<int64_t>(resized.bytes);
      ++s.stats.resized;
    }
    if (resized.bytes >= mapped) {
      s.stats.live_bytes -= static_cast<int64_t>(resized.bytes - mapped);
    } else {
      evicted = s.make_room(mapped - resized.bytes);
      // Counted live before the mapping exists so that a concurrent miss sees it in the bound.
      s.stats.live_bytes += static_cast<int64_t>(mapped - resized.bytes);
      s.stats.mapped_bytes += mapped - resized.bytes;
      if (resized.data == nullptr) ++s.stats.mapped;
    }
    s.stats.high_water_bytes = std::max(s.stats.high_water_bytes, s.stats.live_bytes);
  }
  unmap_all(evicted);
  void* data = map_block(resized, mapped);
  if (data == MAP_FAILED) {
    std::vector<FreeBlock> all;
    {
      std::lock_guard<std::mutex> lock(global_mutex());
      all = state_->take_all();
    }
    unmap_all(all);
    data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  std::lock_guard<std::mutex> lock(global_mutex());
  if (data == MAP_FAILED) {
    state_->stats.live_bytes -= static_cast<int64_t>(mapped);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "zerotrain CPU block cache: could not map ", mapped,
                     " bytes for a tensor of ", bytes, " bytes (", state_->stats.live_bytes,
                     " bytes live); the system is out of memory");
  }
  live_blocks().emplace(data, LiveBlock{this, mapped});
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
  std::vector<FreeBlock> all;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    all = state_->take_all();
  }
  unmap_all(all);
}

void CpuBlockCache::reset_high_water() {
  std::vector<FreeBlock> all;
  {
    std::lock_guard<std::mutex> lock(global_mutex());
    all = state_->take_all();
    state_->stats.high_water_bytes = state_->stats.live_bytes;
  }
  unmap_all(all);
}

void CpuBlockCache::set_slack_fraction(double slack_fraction) {
  if (!(slack_fraction >= 0.0)) throw std::invalid_argument("CpuBlockCache: slack_fraction must be >= 0");
  std::lock_guard<std::mutex> lock(global_mutex());
  state_->slack_fraction = slack_fraction;
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
