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

TEST(CpuBlockCache, ABlockUpToAnEighthLargerIsReusedWholeALargerOneGivesItsHeadSmallerOnesAreMoved) {
  CpuBlockCache cache(64 << 10, 0.0);
  char* eight_mib = nullptr;
  {
    c10::DataPtr a = cache.allocate(8 * kMiB);
    eight_mib = static_cast<char*>(a.get());
    std::memset(a.get(), 3, 8 * kMiB);
  }
  {
    c10::DataPtr within = cache.allocate(8 * kMiB - kMiB / 2);  // 8 MiB <= 7.5 MiB + 1/8: whole
    EXPECT_EQ(within.get(), eight_mib);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(8 * kMiB));  // the whole block counts
  }
  {
    // 8 MiB > 6 MiB + 1/8, and a new mapping would pass the live peak: the block's head serves,
    // its tail stays cached.
    c10::DataPtr head = cache.allocate(6 * kMiB);
    EXPECT_EQ(head.get(), eight_mib);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(6 * kMiB));
    EXPECT_EQ(cache.stats().cached_bytes, int64_t(2 * kMiB));
    c10::DataPtr tail = cache.allocate(2 * kMiB);
    EXPECT_EQ(tail.get(), eight_mib + 6 * kMiB);
    std::memset(tail.get(), 4, 2 * kMiB);
    head = c10::DataPtr();
    tail = c10::DataPtr();
  }  // cached now, oldest first: the 6 MiB head (3s), then the 2 MiB tail (4s)
  {
    // Every cached block is smaller: both move into one mapping in that order (their pages, not
    // copies), and the missing 2 MiB are new pages.
    c10::DataPtr composed = cache.allocate(10 * kMiB);
    auto* bytes = static_cast<unsigned char*>(composed.get());
    EXPECT_EQ(bytes[0], 3);
    EXPECT_EQ(bytes[6 * kMiB - 1], 3);
    EXPECT_EQ(bytes[6 * kMiB], 4);
    EXPECT_EQ(bytes[8 * kMiB - 1], 4);
    EXPECT_EQ(bytes[8 * kMiB], 0);
    std::memset(composed.get(), 5, 10 * kMiB);
    EXPECT_EQ(cache.stats().live_bytes, int64_t(10 * kMiB));
    EXPECT_EQ(cache.stats().cached_bytes, 0);
  }
  {
    // The composed block, freed, serves its size whole; cut again, its ranges move on.
    c10::DataPtr again = cache.allocate(10 * kMiB);
    EXPECT_EQ(static_cast<unsigned char*>(again.get())[10 * kMiB - 1], 5);
  }
  {
    c10::DataPtr head = cache.allocate(7 * kMiB);  // the head crosses the two moved ranges
    std::memset(head.get(), 6, 7 * kMiB);
    c10::DataPtr more = cache.allocate(5 * kMiB);  // the 3 MiB tail moved beside 2 MiB new pages
    EXPECT_EQ(static_cast<unsigned char*>(more.get())[0], 5);
    EXPECT_EQ(static_cast<unsigned char*>(more.get())[3 * kMiB - 1], 5);
    std::memset(more.get(), 7, 5 * kMiB);
  }
  const auto s = cache.stats();
  EXPECT_EQ(s.large_allocations, 8u);
  EXPECT_EQ(s.reused, 3u);
  EXPECT_EQ(s.split, 2u);
  EXPECT_EQ(s.composed, 2u);
  EXPECT_EQ(s.mapped, 1u);
  EXPECT_EQ(s.mapped_bytes, 8 * kMiB + 2 * kMiB + 2 * kMiB);
  EXPECT_EQ(s.moved_bytes, 8 * kMiB + 3 * kMiB);
  EXPECT_EQ(s.cached_bytes, int64_t(12 * kMiB));
  EXPECT_EQ(s.high_water_bytes, int64_t(12 * kMiB));
}

TEST(CpuBlockCache, SmallerBlocksAreMovedOldestFirstAndTheRestUnmappedToStayWithinTheLivePeak) {
  CpuBlockCache cache(64 << 10, 0.0);
  {
    c10::DataPtr a = cache.allocate(4 * kMiB);
    c10::DataPtr b = cache.allocate(2 * kMiB);
    c10::DataPtr c = cache.allocate(1 * kMiB);
    std::memset(a.get(), 1, 4 * kMiB);
    std::memset(b.get(), 2, 2 * kMiB);
    std::memset(c.get(), 3, 1 * kMiB);
    a = c10::DataPtr();
    b = c10::DataPtr();
    c = c10::DataPtr();
  }  // freed a, b, c in this order: live peak 7 MiB, 7 MiB cached
  EXPECT_EQ(cache.stats().high_water_bytes, int64_t(7 * kMiB));
  EXPECT_EQ(cache.stats().cached_bytes, int64_t(7 * kMiB));
  {
    // 16 MiB: a, b and c move into it (7 MiB), 9 MiB are new pages; nothing is left to unmap.
    c10::DataPtr d = cache.allocate(16 * kMiB);
    const auto* bytes = static_cast<const unsigned char*>(d.get());
    EXPECT_EQ(bytes[0], 1);
    EXPECT_EQ(bytes[4 * kMiB], 2);
    EXPECT_EQ(bytes[6 * kMiB], 3);
    const auto s = cache.stats();
    EXPECT_EQ(s.composed, 1u);
    EXPECT_EQ(s.moved_bytes, 7 * kMiB);
    EXPECT_EQ(s.unmapped, 0u);
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

// A composed block spans one kernel mapping per piece; past 64 ranges it takes no more pieces,
// gets new pages for the rest, and the cached blocks it left are unmapped, oldest first, to
// stay within the live peak.
TEST(CpuBlockCache, ABlockTakesAtMostSixtyFourRangesAndTheBlocksLeftAreUnmapped) {
  CpuBlockCache cache(64 << 10, 0.0);
  constexpr size_t kPiece = 64 << 10;
  constexpr int kPieces = 70;
  {
    std::vector<c10::DataPtr> pieces;
    for (int i = 0; i < kPieces; ++i) {
      pieces.push_back(cache.allocate(kPiece));
      std::memset(pieces.back().get(), i + 1, kPiece);
    }
    for (auto& piece : pieces) piece = c10::DataPtr();  // freed in allocation order
  }
  c10::DataPtr whole = cache.allocate(kPieces * kPiece);
  const auto* bytes = static_cast<const unsigned char*>(whole.get());
  for (int i = 0; i < 63; ++i) ASSERT_EQ(bytes[size_t(i) * kPiece + kPiece / 2], i + 1) << "piece " << i;
  const auto s = cache.stats();
  EXPECT_EQ(s.composed, 1u);
  EXPECT_EQ(s.moved_bytes, 63 * kPiece);
  EXPECT_EQ(s.unmapped, 7u);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.live_bytes + s.cached_bytes, s.high_water_bytes);
}

// Two phases of a step whose live peaks are made of different sizes (the logits' blocks, then
// the tied embedding's gradients): with no slack the cache stays within the live peak, and after
// the first step no allocation maps new pages: each is served by a cached block whole, by the
// head of a larger one, or by smaller ones moved together.
TEST(CpuBlockCache, PhasesOfDifferentSizesShareTheirPagesWithoutFaultingAnyIn) {
  CpuBlockCache cache(64 << 10, 0.0);
  uint64_t mapped_after_first = 0;
  for (int step = 0; step < 5; ++step) {
    const auto before = cache.stats();
    {
      std::vector<c10::DataPtr> logits;
      for (int i = 0; i < 6; ++i) {
        logits.push_back(cache.allocate(2 * kMiB));
        std::memset(logits.back().get(), i, 2 * kMiB);
      }
    }
    {
      std::vector<c10::DataPtr> gradients;
      for (int i = 0; i < 2; ++i) {
        gradients.push_back(cache.allocate(6 * kMiB));
        std::memset(gradients.back().get(), i, 6 * kMiB);
      }
    }
    const auto s = cache.stats();
    EXPECT_LE(s.live_bytes + s.cached_bytes, int64_t(12 * kMiB)) << "step " << step;
    if (step > 0) mapped_after_first += s.mapped_bytes - before.mapped_bytes;
  }
  EXPECT_EQ(mapped_after_first, 0u);
  EXPECT_GT(cache.stats().composed, 0u);
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
    // 3 MiB more does not fit beside the cached 4 under 8 + 2: the cached block's head serves it.
    c10::DataPtr other = cache.allocate(3 * kMiB);
    s = cache.stats();
    EXPECT_EQ(s.split, 1u);
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

// Splitting and moving pages must never let two live blocks share one: every block is filled
// with its own byte and checked whole before it is freed, under sizes that force both.
TEST(CpuBlockCache, LiveBlocksNeverShareAPageWhileBlocksAreSplitAndComposed) {
  CpuBlockCache cache(64 << 10, 0.0);
  std::mt19937 rng(11);
  struct Held {
    c10::DataPtr data;
    size_t bytes;
    unsigned char mark;
  };
  std::vector<Held> held;
  const auto intact = [](const Held& h) {
    const auto* p = static_cast<const unsigned char*>(h.data.get());
    for (size_t i = 0; i < h.bytes; i += 512)
      if (p[i] != h.mark) return false;
    return p[h.bytes - 1] == h.mark;
  };
  for (int i = 0; i < 1500; ++i) {
    const size_t bytes = (64 << 10) + rng() % (3 * kMiB);
    const auto mark = static_cast<unsigned char>(1 + i % 255);
    held.push_back({cache.allocate(bytes), bytes, mark});
    std::memset(held.back().data.get(), mark, bytes);
    if (held.size() > 6) {
      const auto victim = held.begin() + long(rng() % held.size());
      ASSERT_TRUE(intact(*victim)) << "allocation " << i;
      held.erase(victim);
    }
  }
  for (const auto& h : held) ASSERT_TRUE(intact(h));
  held.clear();
  const auto s = cache.stats();
  EXPECT_GT(s.split, 0u);
  EXPECT_GT(s.composed, 0u);
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_LE(s.cached_bytes, s.high_water_bytes);
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
  EXPECT_EQ(s.reused + s.split + s.composed + s.mapped, s.large_allocations);
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
  EXPECT_GE(after.reused + after.split + after.composed - before.reused - before.split - before.composed, 1u);
}

TEST(CpuBlockCache, ANegativeSlackIsRefused) {
  EXPECT_THROW(CpuBlockCache(64 << 10, -0.5), std::invalid_argument);
}

}  // namespace
}  // namespace zt
