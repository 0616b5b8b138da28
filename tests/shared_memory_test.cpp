// Shared-memory collectives (src/comm/shared_memory.cpp) through the communicator, on 2, 3 and 4
// real ranks: every operation over sizes that take several rounds of a slot, against a reference
// and against Gloo's own results; that the path is really taken (and left out when asked); that a
// peer that exits, one that never comes, and a communicator destroyed mid-collective end in
// errors instead of hangs.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/collective_paths.h"
#include "comm/shared_memory.h"
#include "support/multirank.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

using namespace zt;
using namespace zt::testing;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<Communicator> communicator(bool shared_memory) {
  CommOptions options = comm_options_from_environment();
  options.shared_memory = shared_memory;
  return make_communicator(rendezvous_from_environment(), options);
}

// Whether this process maps a zerotrain shared-memory segment (its name is already removed).
bool maps_a_segment() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find("/dev/shm/zt-") != std::string::npos) return true;
  return false;
}

// Rank 0 names the segments it creates after its process.
bool segment_names_left() {
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm"))
    if (entry.path().filename().string().rfind("zt-" + std::to_string(::getpid()) + "-", 0) == 0) return true;
  return false;
}

// Values exact in every dtype used here, and in their sums over 4 ranks.
at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype, int salt) {
  auto i = torch::arange(n, torch::kLong);
  return ((i * 7 + rank * 3 + salt) % 11 - 5).to(dtype);
}

at::Tensor reference(ReduceOp op, int world, int64_t n, at::ScalarType dtype, int salt) {
  auto acc = rank_input(0, n, dtype, salt).to(torch::kDouble);
  for (int r = 1; r < world; ++r) {
    auto x = rank_input(r, n, dtype, salt).to(torch::kDouble);
    acc = op == ReduceOp::Max ? torch::maximum(acc, x) : acc + x;
  }
  if (op == ReduceOp::Avg) acc = acc / world;
  return acc;
}

// Sizes around and across the rounds of a slot, for 4-byte elements.
const int64_t kSlotFloats = SharedMemoryTransport::kSlotBytes / 4;
const std::vector<int64_t> kSizes{0, 1, 3, 1000, kSlotFloats - 1, kSlotFloats + 5, 2 * kSlotFloats + 777};

void expect_ranks_pass(const std::string& filter, std::vector<int> worlds, std::map<std::string, std::string> env = {}) {
  for (int world : worlds) {
    auto r = run_ranks(world, filter, env);
    EXPECT_TRUE(r.all_succeeded()) << filter << " on " << world << " ranks failed:\n" << r.describe();
  }
}

}  // namespace

TEST(SharedMemory, EveryCollectiveMatchesTheReferenceAcrossRounds) {
  if (is_rank_process()) {
    auto comm = communicator(true);
    ASSERT_TRUE(maps_a_segment()) << "ranks on one machine should meet in shared memory";
    const int rank = comm->rank(), world = comm->world_size();
    int salt = 0;
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble, torch::kLong}) {
      const double tol = dtype == torch::kBFloat16 ? 0.02 : 1e-6;
      for (int64_t n : kSizes) {
        for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
          if (dtype == torch::kLong && op == ReduceOp::Avg) continue;
          ++salt;
          auto t = rank_input(rank, n, dtype, salt);
          comm->all_reduce(t, op, "ar").wait();
          ASSERT_EQ(t.scalar_type(), dtype);
          ASSERT_TRUE(torch::allclose(t.to(torch::kDouble), reference(op, world, n, dtype, salt), 0, tol))
              << "all_reduce " << to_string(op) << " " << c10::toString(dtype) << " n=" << n;

          auto input = rank_input(rank, world * n, dtype, salt);
          const auto before = input.clone();
          auto output = torch::full({n}, 99, dtype);
          comm->reduce_scatter(input, output, op, "rs").wait();
          const auto expected = reference(op, world, world * n, dtype, salt).narrow(0, rank * n, n);
          ASSERT_TRUE(torch::allclose(output.to(torch::kDouble), expected, 0, tol))
              << "reduce_scatter " << to_string(op) << " " << c10::toString(dtype) << " n=" << n;
          ASSERT_TRUE(torch::equal(input, before)) << "reduce_scatter changed its input";
          auto in_place = input.clone();
          comm->reduce_scatter(in_place, in_place.narrow(0, rank * n, n), op, "rs.in_place", InputUse::Scratch).wait();
          ASSERT_TRUE(torch::allclose(in_place.narrow(0, rank * n, n).to(torch::kDouble), expected, 0, tol))
              << "reduce_scatter in place " << to_string(op) << " " << c10::toString(dtype) << " n=" << n;
        }
        ++salt;
        auto mine = rank_input(rank, n, dtype, salt);
        auto gathered = torch::full({world * n}, 99, dtype);
        comm->all_gather(mine, gathered, "ag").wait();
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r) parts.push_back(rank_input(r, n, dtype, salt));
        ASSERT_TRUE(torch::equal(gathered, torch::cat(parts))) << "all_gather " << c10::toString(dtype) << " n=" << n;
        // In place: the input is this rank's block of the output (stages 1-2 gather so).
        auto whole = torch::full({world * n}, 99, dtype);
        whole.narrow(0, rank * n, n).copy_(mine);
        comm->all_gather(whole.narrow(0, rank * n, n), whole, "ag.in_place").wait();
        ASSERT_TRUE(torch::equal(whole, torch::cat(parts))) << "all_gather in place n=" << n;
        for (int root = 0; root < world; ++root) {
          auto t = rank_input(rank, n, dtype, salt + root);
          comm->broadcast(t, root, "bc").wait();
          ASSERT_TRUE(torch::equal(t, rank_input(root, n, dtype, salt + root))) << "broadcast root " << root;
        }
      }
    }
    // Several in flight at once, waited in reverse order: they run in issue order.
    std::vector<at::Tensor> buffers;
    std::vector<CollectiveHandle> handles;
    for (int b = 0; b < 5; ++b) {
      buffers.push_back(rank_input(rank, kSlotFloats + 3 * b, torch::kFloat, 500 + b));
      handles.push_back(comm->all_reduce(buffers.back(), ReduceOp::Sum, fmt::format("bucket{}", b)));
    }
    for (int b = 4; b >= 0; --b) {
      handles[size_t(b)].wait();
      ASSERT_TRUE(torch::equal(buffers[size_t(b)].to(torch::kDouble),
                               reference(ReduceOp::Sum, world, kSlotFloats + 3 * b, torch::kFloat, 500 + b)));
    }
    comm->barrier("end");
    if (rank == 0) EXPECT_FALSE(segment_names_left()) << "the segment's name must be gone once every rank has mapped it";
    return;
  }
  expect_ranks_pass("SharedMemory.EveryCollectiveMatchesTheReferenceAcrossRounds", {2, 3, 4});
}

// fp32 gradients as training reduces them: the same bits as Gloo's on two ranks (a sum of two is
// the same in any order), and the same bits on every rank.
TEST(SharedMemory, SameBitsAsGlooOnTwoRanksAndOnEveryRank) {
  if (is_rank_process()) {
    const int rank = test_rank(), world = test_world_size();
    const int64_t n = 3 * kSlotFloats + 11;
    std::vector<at::Tensor> inputs;
    torch::manual_seed(1234 + rank);
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) inputs.push_back(torch::randn({n}).to(dtype));
    // One communicator after the other: a process meets its peers on one port once at a time.
    std::vector<at::Tensor> by_gloo;
    {
      auto gloo = communicator(false);
      EXPECT_FALSE(maps_a_segment());
      for (const auto& x : inputs) {
        by_gloo.push_back(x.clone());
        gloo->all_reduce(by_gloo.back(), ReduceOp::Avg, "gloo").wait();
      }
      gloo->barrier("end");
    }
    auto shared = communicator(true);
    ASSERT_TRUE(maps_a_segment());
    for (size_t k = 0; k < inputs.size(); ++k) {
      auto a = inputs[k].clone();
      shared->all_reduce(a, ReduceOp::Avg, "shm").wait();
      const bool fp32 = a.scalar_type() == torch::kFloat;
      if (world == 2) EXPECT_TRUE(torch::equal(a, by_gloo[k])) << c10::toString(a.scalar_type());
      // Beyond two ranks Gloo rounds bf16 after every addition, this path once (in fp32).
      EXPECT_TRUE(torch::allclose(a.to(torch::kFloat), by_gloo[k].to(torch::kFloat), fp32 ? 1e-5 : 2e-2,
                                  fp32 ? 1e-6 : 5e-2))
          << c10::toString(a.scalar_type()) << " largest difference "
          << (a.to(torch::kFloat) - by_gloo[k].to(torch::kFloat)).abs().max().item<float>();
      auto everyone = torch::empty({world * n}, a.scalar_type());
      shared->all_gather(a, everyone, "check").wait();
      for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(everyone.narrow(0, r * n, n), a)) << "rank " << r;
    }
    shared->barrier("end");
    return;
  }
  expect_ranks_pass("SharedMemory.SameBitsAsGlooOnTwoRanksAndOnEveryRank", {2, 3});
}

TEST(SharedMemory, TurnedOffByTheEnvironmentAndByGlooPathOptions) {
  if (is_rank_process()) {
    {
      auto comm = make_communicator(rendezvous_from_environment(), comm_options_from_environment());
      EXPECT_EQ(maps_a_segment(), std::getenv("ZT_COMM_SHARED_MEMORY") == nullptr);
      auto t = torch::ones({10});
      comm->all_reduce(t, ReduceOp::Sum, "x").wait();
      EXPECT_TRUE(torch::equal(t, torch::full({10}, float(comm->world_size()))));
    }
    EXPECT_FALSE(maps_a_segment()) << "the segment is unmapped with its communicator";
    CollectivePaths native;
    native.native_gloo_all_gather = true;
    auto comm = make_communicator(rendezvous_from_environment(), CommOptions{}, native);
    EXPECT_FALSE(maps_a_segment()) << "options that select Gloo's own paths leave shared memory out";
    comm->barrier("end");
    return;
  }
  expect_ranks_pass("SharedMemory.TurnedOffByTheEnvironmentAndByGlooPathOptions", {2});
  expect_ranks_pass("SharedMemory.TurnedOffByTheEnvironmentAndByGlooPathOptions", {2},
                    {{"ZT_COMM_SHARED_MEMORY", "0"}});
  try {
    comm_options_from_environment(std::nullopt, [](const char* name) -> const char* {
      return std::string(name) == "ZT_COMM_SHARED_MEMORY" ? "yes" : nullptr;
    });
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ZT_COMM_SHARED_MEMORY: expected 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("found 'yes'"), std::string::npos) << e.what();
  }
}

// A peer that exits is noticed from its process, well before the timeout.
TEST(SharedMemory, APeerThatExitsFailsTheCollectiveBeforeTheTimeout) {
  if (is_rank_process()) {
    auto comm = communicator(true);
    auto t = torch::ones({3 * kSlotFloats});
    comm->all_reduce(t, ReduceOp::Sum, "warmup").wait();
    if (comm->rank() == 1) std::_Exit(0);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t, ReduceOp::Sum, "grads.bucket0").wait();
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "CAUGHT: " << e.what() << "\nWAITED: " << waited << " s" << std::endl;
      EXPECT_NE(std::string(e.what()).find("all_reduce 'grads.bucket0' (seq 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 (process"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("exited"), std::string::npos) << e.what();
      EXPECT_LT(waited, 10.0);  // the timeout is 60 s
    }
    return;
  }
  auto r = run_ranks(2, "SharedMemory.APeerThatExitsFailsTheCollectiveBeforeTheTimeout",
                     {{"ZT_COMM_TIMEOUT_SECONDS", "60"}});
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// A rank that never enters the collective: the timeout, with the communicator's usual message.
TEST(SharedMemory, AMissingPeerTimesOutWithTheUsualMessage) {
  if (is_rank_process()) {
    auto comm = communicator(true);
    auto t = torch::ones({1000});
    comm->all_reduce(t, ReduceOp::Sum, "warmup").wait();
    if (comm->rank() == 1) {
      std::this_thread::sleep_for(4s);  // alive, but skips the collective
      return;
    }
    try {
      comm->all_reduce(t, ReduceOp::Sum, "grads.bucket3").wait();
      ADD_FAILURE() << "expected a timeout";
    } catch (const CommError& e) {
      std::cout << "CAUGHT: " << e.what() << std::endl;
      EXPECT_NE(std::string(e.what()).find("rank 0/2 timed out after 1.0 s in all_reduce 'grads.bucket3' (seq 1"),
                std::string::npos)
          << e.what();
    }
    return;
  }
  auto r = run_ranks(2, "SharedMemory.AMissingPeerTimesOutWithTheUsualMessage", {{"ZT_COMM_TIMEOUT_SECONDS", "1"}});
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  EXPECT_LT(r.wall_seconds, 30.0);
}

// A communicator destroyed while its collective waits for a peer returns at once; the collective
// fails.
TEST(SharedMemory, DestroyingTheCommunicatorEndsAWaitingCollective) {
  if (is_rank_process()) {
    auto comm = communicator(true);
    auto t = torch::ones({1000});
    comm->all_reduce(t, ReduceOp::Sum, "warmup").wait();
    comm->barrier("ready");
    if (comm->rank() == 1) return;  // issues nothing more; its communicator goes
    auto pending = comm->all_reduce(t, ReduceOp::Sum, "never.matched");
    const auto start = std::chrono::steady_clock::now();
    comm.reset();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(took, 2.0) << "destroying the communicator waited for the collective";
    EXPECT_THROW(pending.wait(), CommError);
    return;
  }
  auto r = run_ranks(2, "SharedMemory.DestroyingTheCommunicatorEndsAWaitingCollective",
                     {{"ZT_COMM_TIMEOUT_SECONDS", "60"}});
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}
