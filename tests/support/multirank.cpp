#include "support/multirank.h"

#include <cstdlib>
#include <sstream>
#include <thread>

#include <unistd.h>

namespace zt::testing {

bool MultiRankResult::all_succeeded() const {
  if (ranks.empty()) return false;
  for (const auto& r : ranks) {
    if (r.exit_code != 0 || r.timed_out) return false;
  }
  return true;
}

std::string MultiRankResult::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    out << "---- rank " << i << ": exit " << ranks[i].exit_code << (ranks[i].timed_out ? " (timed out)" : "")
        << " ----\n"
        << ranks[i].output << "\n";
  }
  return out.str();
}

namespace {

MultiRankResult run_once(int world, const std::string& gtest_filter, const std::map<std::string, std::string>& extra_env,
                         std::chrono::seconds timeout) {
  MultiRankResult result;
  result.ranks.resize(size_t(world));
  // Rank 0 gets the rendezvous socket already listening: a port only picked and released can be
  // taken (another test's ephemeral or Gloo port) before rank 0 binds it, and the other ranks
  // would then reach the wrong socket.
  ListeningSocket socket;
  if (extra_env.count("MASTER_PORT") == 0) socket = listen_on_free_port();
  const std::string port = std::to_string(socket.port);
  const std::string exe = self_executable();
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    std::map<std::string, std::string> env{{"RANK", std::to_string(rank)},
                                           {"WORLD_SIZE", std::to_string(world)},
                                           {"LOCAL_RANK", std::to_string(rank)},
                                           {"LOCAL_WORLD_SIZE", std::to_string(world)},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", port},
                                           {"ZT_TEST_RANK_ROLE", "1"},
                                           // One OpenMP thread per rank, whatever the world: tests run 3-4
                                           // ranks on 2 cores, where each rank's idle OpenMP workers spin
                                           // on the cores its peers need to reach the next collective
                                           // (SharedMemory.EveryCollectiveMatchesTheReferenceAcrossRounds
                                           // took 46 s on 4 ranks instead of 17). Fixed rather than cores
                                           // / world, so that every world computes with the same kernels.
                                           {"OMP_NUM_THREADS", "1"}};
    if (rank == 0 && socket.fd >= 0) env["ZT_RENDEZVOUS_LISTEN_FD"] = std::to_string(socket.fd);
    for (const auto& [k, v] : extra_env) env[k] = v;
    const int inherit = rank == 0 ? socket.fd : -1;
    threads.emplace_back([&, rank, env, inherit] {
      // Once rank 0 holds the socket, ours goes: with it open here, the other ranks' connections
      // would queue on it unanswered if rank 0 died, and rank 0 could not bind the port again
      // for a second communicator.
      auto close_ours = [&] {
        if (inherit >= 0) close(inherit);
      };
      result.ranks[size_t(rank)] =
          run_process({exe, "--gtest_filter=" + gtest_filter}, env, timeout, "", inherit, close_ours);
    });
  }
  for (auto& t : threads) t.join();
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace

MultiRankResult run_ranks(int world, const std::string& gtest_filter, std::map<std::string, std::string> extra_env,
                          std::chrono::seconds timeout) {
  auto result = run_once(world, gtest_filter, extra_env, timeout);
  // free_port() only says the port was free a moment ago; another test may have taken it since.
  bool port_taken = !result.ranks.empty() && result.ranks[0].output.find("Address already in use") != std::string::npos;
  if (port_taken && extra_env.count("MASTER_PORT") == 0) result = run_once(world, gtest_filter, extra_env, timeout);
  return result;
}

bool is_rank_process() {
  const char* role = std::getenv("ZT_TEST_RANK_ROLE");
  return role != nullptr && *role != '\0';
}

int test_rank() {
  const char* v = std::getenv("RANK");
  return is_rank_process() && v != nullptr ? std::atoi(v) : 0;
}

int test_world_size() {
  const char* v = std::getenv("WORLD_SIZE");
  return is_rank_process() && v != nullptr ? std::atoi(v) : 1;
}

}  // namespace zt::testing
