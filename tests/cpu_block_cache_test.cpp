#include "memory/cpu_block_cache.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace zt {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(CpuBlockCache, SmallBlocksComeFromTheHeapAndAreNotCounted) {
  CpuBlockCache cache(64 << 10, 0.0);
  {
    c10::DataPtr small = cache.allocate(1000);
    ASSERT_NE(small.get(), nullptr);
    std::memset(small.get(), 1, 1000);
    c10::DataPtr empty = cache.allocate(0);
  }
  const auto s = cache.stats();
  EXPECT_EQ(s.large_allocations, 0u);
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_EQ(s.cached_bytes, 0);
}

TEST(CpuBlockCache, AFreedBlockServesTheNextAllocationOfItsSize) {
  CpuBlockCache cache(64 << 10, 0.0);
  void* first = nullptr;
  {
    c10::DataPtr a = cache.allocate(kMiB + 10);  // rounded up to the page
    first = a.get();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    std::memset(a.get(), 7, kMiB + 10);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(kMiB + 4096));
  }
  EXPECT_EQ(cache.stats().cached_bytes, int64_t(kMiB + 4096));
  {
    c10::DataPtr b = cache.allocate(kMiB + 100);  // the same pages
    EXPECT_EQ(b.get(), first);
    c10::DataPtr c = cache.allocate(kMiB + 100);  // none cached: a new mapping
    EXPECT_NE(c.get(), first);
  }
  const auto s = cache.stats();
  EXPECT_EQ(s.large_allocations, 3u);
  EXPECT_EQ(s.reused, 1u);
  EXPECT_EQ(s.mapped, 2u);
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_EQ(s.high_water_bytes, int64_t(2 * (kMiB + 4096)));
}

TEST(CpuBlockCache, ABlockUpToAnEighthLargerIsReusedWholeAndOthersAreTrimmedOrGrown) {
  CpuBlockCache cache(64 << 10, 0.0);
  void* eight_mib = nullptr;
  {
    c10::DataPtr a = cache.allocate(8 * kMiB);
    eight_mib = a.get();
    std::memset(a.get(), 3, 8 * kMiB);
  }
  {
    c10::DataPtr within = cache.allocate(8 * kMiB - kMiB / 2);  // 8 MiB <= 7.5 MiB + 1/8: whole
    EXPECT_EQ(within.get(), eight_mib);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(8 * kMiB));  // the whole block counts
  }
  {
    c10::DataPtr trimmed = cache.allocate(6 * kMiB);  // 8 MiB > 6 MiB + 1/8: its tail is unmapped
    EXPECT_EQ(trimmed.get(), eight_mib);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(6 * kMiB));
    EXPECT_EQ(cache.stats().cached_bytes, 0);
  }
  {
    c10::DataPtr grown = cache.allocate(10 * kMiB);  // the 6 MiB block grown: 4 MiB faulted in
    auto* bytes = static_cast<unsigned char*>(grown.get());
    EXPECT_EQ(bytes[0], 3);  // the pages kept are the block's own, moved if need be
    EXPECT_EQ(bytes[6 * kMiB - 1], 3);
    std::memset(grown.get(), 5, 10 * kMiB);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(10 * kMiB));
  }
  const auto s = cache.stats();
  EXPECT_EQ(s.large_allocations, 4u);
  EXPECT_EQ(s.reused, 1u);
  EXPECT_EQ(s.resized, 2u);
  EXPECT_EQ(s.mapped, 1u);
  EXPECT_EQ(s.mapped_bytes, 8 * kMiB + 4 * kMiB);
  EXPECT_EQ(s.cached_bytes, int64_t(10 * kMiB));
}

TEST(CpuBlockCache, CachedBlocksAreUnmappedOldestFirstToStayWithinTheLivePeak) {
  CpuBlockCache cache(64 << 10, 0.0);
  {
    c10::DataPtr a = cache.allocate(4 * kMiB);
    c10::DataPtr b = cache.allocate(2 * kMiB);
    c10::DataPtr c = cache.allocate(1 * kMiB);
  }  // freed a, b, c in this order: live peak 7 MiB, 7 MiB cached
  EXPECT_EQ(cache.stats().high_water_bytes, int64_t(7 * kMiB));
  EXPECT_EQ(cache.stats().cached_bytes, int64_t(7 * kMiB));
  {
    // 16 MiB grows the nearest block (a, 4 MiB) by 12 MiB; with b and c kept the mapped bytes
    // would be 19 MiB against a new peak of 16: b (older) and then c are unmapped.
    c10::DataPtr d = cache.allocate(16 * kMiB);
    const auto s = cache.stats();
    EXPECT_EQ(s.unmapped, 2u);
    EXPECT_EQ(s.cached_bytes, 0);
    EXPECT_EQ(s.live_bytes, int64_t(16 * kMiB));
    EXPECT_EQ(s.high_water_bytes, int64_t(16 * kMiB));
  }
  {
    // Below the peak nothing is unmapped: two blocks live, 16 + 0 cached.
    c10::DataPtr e = cache.allocate(16 * kMiB);
    c10::DataPtr f = cache.allocate(kMiB);
    const auto s = cache.stats();
    EXPECT_EQ(s.live_bytes + s.cached_bytes, s.high_water_bytes);
  }
  cache.release_cached();
  EXPECT_EQ(cache.stats().cached_bytes, 0);
}

// A set-up peak (construction) above the steps' own: without reset_high_water() its freed blocks
// stay cached up to that peak plus the slack for good; with it, the cache is emptied and the
// bound follows the steps, so a new size past it unmaps what the steps no longer use.
TEST(CpuBlockCache, ResetHighWaterFollowsThePeaksAfterIt) {
  CpuBlockCache cache(64 << 10, 0.25);
  c10::DataPtr kept = cache.allocate(4 * kMiB);
  {
    c10::DataPtr setup = cache.allocate(16 * kMiB);  // freed at the end of set-up
  }
  EXPECT_EQ(cache.stats().high_water_bytes, int64_t(20 * kMiB));
  EXPECT_EQ(cache.stats().cached_bytes, int64_t(16 * kMiB));
  cache.reset_high_water();
  auto s = cache.stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.unmapped, 1u);
  EXPECT_EQ(s.high_water_bytes, int64_t(4 * kMiB));
  EXPECT_EQ(s.live_bytes, int64_t(4 * kMiB));
  // A step: 4 MiB live beside the 4 kept, then freed; the peak is 8 MiB, the bound 10.
  for (int step = 0; step < 3; ++step) {
    c10::DataPtr activation = cache.allocate(4 * kMiB);
  }
  s = cache.stats();
  EXPECT_EQ(s.high_water_bytes, int64_t(8 * kMiB));
  EXPECT_EQ(s.reused, 2u);
  EXPECT_EQ(s.cached_bytes, int64_t(4 * kMiB));
  {
    // 3 MiB more does not fit beside the cached 4 under 8 + 2: the cached block is trimmed to it.
    c10::DataPtr other = cache.allocate(3 * kMiB);
    s = cache.stats();
    EXPECT_EQ(s.resized, 1u);
    EXPECT_LE(s.live_bytes + s.cached_bytes, int64_t(10 * kMiB));
  }
}

// A training-like pattern: the same sequence of allocations and frees every step, with sizes
// that vary a little. After the first step nearly every allocation is reused, and the mapped bytes
// never pass the live peak plus the slack.
TEST(CpuBlockCache, RepeatedStepsAreServedFromTheCacheWithinTheBound) {
  const double slack = 1.0 / 16;
  CpuBlockCache cache(64 << 10, slack);
  std::mt19937 rng(3);
  std::vector<size_t> sizes;
  for (int i = 0; i < 60; ++i) sizes.push_back((64 << 10) + rng() % (4 * kMiB));
  uint64_t faulted_after_first = 0, requested_after_first = 0;
  for (int step = 0; step < 6; ++step) {
    const auto before = cache.stats();
    std::vector<c10::DataPtr> live;
    for (size_t i = 0; i < sizes.size(); ++i) {
      // a few percent of jitter, as the masked rows of a BERT batch
      const size_t bytes = sizes[i] - (step % 2) * (sizes[i] / 32);
      live.push_back(cache.allocate(bytes));
      if (step > 0) requested_after_first += bytes;
      std::memset(live.back().get(), int(i), 4096);
      const auto s = cache.stats();
      ASSERT_LE(double(s.live_bytes + s.cached_bytes), double(s.high_water_bytes) * (1 + slack) + 1)
          << "step " << step << " allocation " << i;
      if (i % 3 == 2) live.erase(live.begin() + long(rng() % live.size()));  // temporaries die
    }
    live.clear();
    if (step > 0) faulted_after_first += cache.stats().mapped_bytes - before.mapped_bytes;
  }
  // Returning every block would fault in all of it again each step.
  EXPECT_LE(double(faulted_after_first), 0.1 * double(requested_after_first))
      << faulted_after_first << " of " << requested_after_first << " bytes faulted in again";
}

TEST(CpuBlockCache, ConcurrentAllocationsAndFreesKeepTheAccounts) {
  CpuBlockCache cache(64 << 10, 0.0);
  auto work = [&](int seed) {
    std::mt19937 rng(seed);
    std::vector<c10::DataPtr> held;
    for (int i = 0; i < 2000; ++i) {
      held.push_back(cache.allocate((rng() % 4 + 1) * (128 << 10)));
      *static_cast<int*>(held.back().get()) = i;
      if (held.size() > 8) held.erase(held.begin() + long(rng() % held.size()));
    }
  };
  std::thread a(work, 1), b(work, 2);
  a.join();
  b.join();
  const auto s = cache.stats();
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_EQ(s.large_allocations, 4000u);
  EXPECT_EQ(s.reused + s.resized + s.mapped, s.large_allocations);
  EXPECT_LE(s.cached_bytes, s.high_water_bytes);
}

TEST(CpuBlockCache, InstalledItServesLibTorchTensorsAndRawAllocations) {
  CpuBlockCache& cache = install_cpu_block_cache();
  EXPECT_EQ(&install_cpu_block_cache(), &cache);
  EXPECT_EQ(installed_cpu_block_cache(), &cache);
  EXPECT_EQ(c10::GetCPUAllocator(), &cache);
  const auto before = cache.stats();
  {
    auto t = torch::arange(1 << 20, torch::kFloat32);  // 4 MiB
    EXPECT_EQ(t.sum().item<double>(), double(int64_t(1 << 20) * ((1 << 20) - 1) / 2));
  }
  {
    auto u = torch::ones({1 << 20}, torch::kFloat32);  // the same block, overwritten
    EXPECT_EQ(u.sum().item<double>(), double(1 << 20));
  }
  void* raw = c10::GetCPUAllocator()->raw_allocate(kMiB);
  std::memset(raw, 0, kMiB);
  c10::GetCPUAllocator()->raw_deallocate(raw);
  const auto after = cache.stats();
  EXPECT_GE(after.large_allocations - before.large_allocations, 3u);
  EXPECT_GE(after.reused + after.resized - before.reused - before.resized, 1u);
}

TEST(CpuBlockCache, ANegativeSlackIsRefused) {
  EXPECT_THROW(CpuBlockCache(64 << 10, -0.5), std::invalid_argument);
  CpuBlockCache cache;
  EXPECT_THROW(cache.set_slack_fraction(-0.1), std::invalid_argument);
}

// Set-up runs without slack (mapped bytes within the live peak, as a model is built block by
// block); the steps get theirs back: the same sequence keeps more cached once it is set.
TEST(CpuBlockCache, TheSlackCanBeWithheldAndGivenBack) {
  CpuBlockCache cache(64 << 10, 0.25);
  cache.set_slack_fraction(0.0);
  const auto build_block = [&] {
    c10::DataPtr whole = cache.allocate(8 * kMiB);  // the block built whole, then sharded
    c10::DataPtr shard = cache.allocate(4 * kMiB);
  };
  build_block();  // peak 12 MiB, both cached
  {
    c10::DataPtr other = cache.allocate(10 * kMiB);  // grows a cached block or unmaps one
    const auto s = cache.stats();
    EXPECT_LE(s.live_bytes + s.cached_bytes, s.high_water_bytes) << "no slack: within the live peak";
  }
  cache.reset_high_water();
  cache.set_slack_fraction(0.25);
  build_block();
  {
    c10::DataPtr a = cache.allocate(8 * kMiB);
    c10::DataPtr b = cache.allocate(3 * kMiB);  // 11 live + 4 cached = 15 <= 12 + 3 of slack
    const auto s = cache.stats();
    EXPECT_GT(s.live_bytes + s.cached_bytes, s.high_water_bytes) << "the slack is given back";
    EXPECT_LE(s.live_bytes + s.cached_bytes, s.high_water_bytes + s.high_water_bytes / 4);
  }
}

}  // namespace
}  // namespace zt
