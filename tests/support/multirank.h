// Multi-rank tests: a test starts its own binary `world` times, filtered to itself, with the
// variables a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT); each child sees is_rank_process() and runs the rank body.
//
//   TEST(CommMultiRank, AllReduce) {
//     if (is_rank_process()) { ...rank body with ASSERTs...; return; }
//     auto r = run_ranks(2, "CommMultiRank.AllReduce");
//     EXPECT_TRUE(r.all_succeeded()) << r.describe();
//   }
//
// A failed assertion in a rank makes gtest exit non-zero, which the parent sees. A body that
// several tests start is a TEST of a suite whose name ends in RankBody: ctest does not list it
// (tests/CMakeLists.txt), and run_ranks names it.
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "support/process.h"

namespace zt::testing {

struct MultiRankResult {
  std::vector<ProcessResult> ranks;  // index = rank
  double wall_seconds = 0;           // from the first start to the last exit

  bool all_succeeded() const;
  // Every rank's exit code and output, for a failure message.
  std::string describe() const;
};

// Runs the current test binary as `world` ranks in parallel with --gtest_filter=<gtest_filter>.
// The environment is the current one plus the launcher variables, ZT_TEST_RANK_ROLE=1,
// OMP_NUM_THREADS=1 and `extra_env` (which wins). Rank 0 is handed the rendezvous socket already listening
// (ZT_RENDEZVOUS_LISTEN_FD), unless `extra_env` sets MASTER_PORT; then it retries once on a fresh
// port when that port turned out to be taken. Each rank is killed after `timeout`.
MultiRankResult run_ranks(int world, const std::string& gtest_filter, std::map<std::string, std::string> extra_env = {},
                          std::chrono::seconds timeout = std::chrono::seconds(120));

// True inside a rank started by run_ranks (env ZT_TEST_RANK_ROLE is set).
bool is_rank_process();

// RANK and WORLD_SIZE of this rank process (0 and 1 outside one).
int test_rank();
int test_world_size();

}  // namespace zt::testing
