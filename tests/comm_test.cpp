// comm: rendezvous parsing, options, and every collective on 2 and 3 real ranks (shared memory,
// the default on one machine, and Gloo over loopback) against a locally computed reference;
// timeouts and their messages.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "comm/collective_paths.h"
#include "comm/faults.h"
#include "comm/node_groups.h"
#include "support/multirank.h"
#include "support/process.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"

using namespace zt;
using namespace zt::testing;
using namespace std::chrono_literals;

namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

// Expects ConfigError whose message contains every one of `parts`.
void expect_config_error(const std::map<std::string, std::string>& vars, std::vector<std::string> parts) {
  try {
    rendezvous_from_environment(env_of(vars));
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Shows the lines a rank printed with "CAUGHT: " (the error messages under test) in the log.
void echo_caught(const std::string& output) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("CAUGHT: ", 0) == 0) std::cout << "  " << line << "\n";
  }
}

}  // namespace

// ---------------------------------------------------------------- rendezvous from the environment

TEST(CommRendezvous, Torchrun) {
  auto info = rendezvous_from_environment(env_of({{"RANK", "3"},
                                                  {"WORLD_SIZE", "8"},
                                                  {"LOCAL_RANK", "1"},
                                                  {"LOCAL_WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "10.0.0.5"},
                                                  {"MASTER_PORT", "29555"},
                                                  {"SLURM_PROCID", "7"},  // torchrun's variables win
                                                  {"SLURM_NTASKS", "9"}}));
  EXPECT_EQ(info.source, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.node_rank, 1);  // without GROUP_RANK: placed node by node
  EXPECT_EQ(info.master_addr, "10.0.0.5");
  EXPECT_EQ(info.master_port, 29555);
}

// The node comes from GROUP_RANK (torchrun, zerotrain's launcher), SLURM_NODEID or Open MPI's
// placement; a single process is node 0.
TEST(CommRendezvous, NodeRankFromEachLauncher) {
  EXPECT_EQ(rendezvous_from_environment(env_of({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                                {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "3"}}))
                .node_rank,
            3);
  EXPECT_EQ(rendezvous_from_environment(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}})).node_rank, 0);
  EXPECT_EQ(rendezvous_from_environment(env_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                                                {"SLURM_NTASKS_PER_NODE", "3"}, {"SLURM_NODEID", "1"},
                                                {"SLURM_JOB_NODELIST", "node[01-02]"}}))
                .node_rank,
            1);
  EXPECT_EQ(rendezvous_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "6"},
                                                {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}, {"MASTER_ADDR", "10.0.0.5"}}))
                .node_rank,
            1);
  EXPECT_EQ(rendezvous_from_environment(env_of({})).node_rank, 0);
  expect_config_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "2"}}, {"GROUP_RANK"});
  expect_config_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "x"}}, {"GROUP_RANK"});
}

TEST(CommRendezvous, TorchrunDefaults) {
  auto info = rendezvous_from_environment(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}}));
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_EQ(info.listen_fd, -1);
}

// zerotrain's launcher hands rank 0 its rendezvous socket; only rank 0 takes it.
TEST(CommRendezvous, LaunchersSocketGoesToRankZeroOnly) {
  EXPECT_EQ(rendezvous_from_environment(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"ZT_RENDEZVOUS_LISTEN_FD", "3"}}))
                .listen_fd,
            3);
  EXPECT_EQ(rendezvous_from_environment(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"ZT_RENDEZVOUS_LISTEN_FD", "3"}}))
                .listen_fd,
            -1);
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"ZT_RENDEZVOUS_LISTEN_FD", "three"}},
                      {"ZT_RENDEZVOUS_LISTEN_FD", "file descriptor", "'three'"});
}

TEST(CommRendezvous, Slurm) {
  auto info = rendezvous_from_environment(env_of({{"SLURM_PROCID", "5"},
                                                  {"SLURM_NTASKS", "8"},
                                                  {"SLURM_LOCALID", "1"},
                                                  {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                                  {"SLURM_NODEID", "1"},
                                                  {"SLURM_NODELIST", "gpu[07-08]"},
                                                  {"SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"},
                                                  {"SLURM_JOB_ID", "12345"}}));
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 15000 + 12345);
}

TEST(CommRendezvous, SlurmVariants) {
  std::map<std::string, std::string> base{{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"}};
  auto with = [&](std::map<std::string, std::string> more) {
    auto vars = base;
    for (auto& [k, v] : more) vars[k] = v;
    return rendezvous_from_environment(env_of(vars));
  };
  // Uneven tasks per node: node 3 of "2(x3),1" runs one task.
  EXPECT_EQ(with({{"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "3"}, {"SLURM_NODELIST", "a"}}).local_world_size, 1);
  EXPECT_EQ(with({{"SLURM_NTASKS_PER_NODE", "3"}, {"SLURM_NODELIST", "a"}}).local_world_size, 3);
  EXPECT_EQ(with({{"SLURM_NODELIST", "alpha,beta"}}).master_addr, "alpha");
  EXPECT_EQ(with({{"SLURM_NODELIST", "node7"}}).master_addr, "node7");
  EXPECT_EQ(with({{"SLURM_NODELIST", "rack1-n[3,5-6],x"}}).master_addr, "rack1-n3");
  EXPECT_EQ(with({{"SLURM_STEP_NODELIST", "s[2-3]"}, {"SLURM_NODELIST", "n[1-4]"}}).master_addr, "s2");
  EXPECT_EQ(with({{"SLURM_NODELIST", "n[a-b]"}, {"SLURM_LAUNCH_NODE_IPADDR", "10.2.0.1"}}).master_addr, "10.2.0.1");
  auto explicit_master = with({{"SLURM_NODELIST", "n[1-4]"}, {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(explicit_master.master_addr, "head");
  EXPECT_EQ(explicit_master.master_port, 4000);
  EXPECT_EQ(with({{"SLURM_NODELIST", "n1"}}).master_port, 29500);  // no job id: the default port
  expect_config_error(base, {"MASTER_ADDR", "node list"});
}

TEST(CommRendezvous, OpenMpi) {
  auto info = rendezvous_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                                  {"OMPI_COMM_WORLD_SIZE", "4"},
                                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  EXPECT_EQ(info.source, "mpi");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.master_addr, "127.0.0.1");  // all ranks on one node
  // Several nodes: the launcher does not say where rank 0 is.
  expect_config_error({{"OMPI_COMM_WORLD_RANK", "2"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                      {"MASTER_ADDR", "several nodes"});
  auto multi = rendezvous_from_environment(env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                   {"MASTER_ADDR", "n0"},
                                                   {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(multi.master_addr, "n0");
  EXPECT_EQ(multi.master_port, 1234);
  EXPECT_EQ(multi.local_world_size, 2);
}

TEST(CommRendezvous, SingleProcess) {
  auto info = rendezvous_from_environment(env_of({}));
  EXPECT_EQ(info.source, "single");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_world_size, 1);
}

TEST(CommRendezvous, MalformedValuesNameVariableExpectedAndFound) {
  expect_config_error({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, {"RANK", "non-negative integer", "'abc'"});
  expect_config_error({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, {"RANK", "non-negative integer", "'-1'"});
  expect_config_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, {"RANK", "below WORLD_SIZE=2", "found 2"});
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE", "positive integer", "'0'"});
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "2x"}}, {"WORLD_SIZE", "positive integer", "'2x'"});
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
                      {"MASTER_PORT", "1..65535", "'70000'"});
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}, {"MASTER_PORT", "'http'"});
  expect_config_error({{"RANK", "0"}}, {"WORLD_SIZE", "unset"});
  expect_config_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
                      {"LOCAL_RANK", "below LOCAL_WORLD_SIZE=2", "found 2"});
  expect_config_error({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODELIST", "a"}},
                      {"SLURM_PROCID", "below SLURM_NTASKS=4", "found 4"});
  expect_config_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_TASKS_PER_NODE", "2(xx)"}},
                      {"SLURM_TASKS_PER_NODE", "'2(xx)'"});
  expect_config_error({{"OMPI_COMM_WORLD_RANK", "one"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                      {"OMPI_COMM_WORLD_RANK", "'one'"});
}

TEST(CommOptions, TimeoutFromConfigThenEnvironment) {
  EXPECT_EQ(comm_options_from_environment(std::nullopt, env_of({})).timeout, 300000ms);
  EXPECT_EQ(comm_options_from_environment(std::nullopt, env_of({{"ZT_COMM_TIMEOUT_SECONDS", "2"}})).timeout, 2000ms);
  EXPECT_EQ(comm_options_from_environment(7.5, env_of({{"ZT_COMM_TIMEOUT_SECONDS", "2"}})).timeout, 7500ms);
  for (const char* bad : {"abc", "0", "-3", "2s"}) {
    try {
      comm_options_from_environment(std::nullopt, env_of({{"ZT_COMM_TIMEOUT_SECONDS", bad}}));
      ADD_FAILURE() << "expected ConfigError for " << bad;
    } catch (const ConfigError& e) {
      EXPECT_TRUE(contains(e.what(), "ZT_COMM_TIMEOUT_SECONDS")) << e.what();
      EXPECT_TRUE(contains(e.what(), std::string("'") + bad + "'")) << e.what();
    }
  }
  EXPECT_THROW(comm_options_from_environment(-1.0, env_of({})), ConfigError);
}

// ---------------------------------------------------------------- one process

TEST(CommSingle, WorldOfOneNeedsNoNetwork) {
  auto comm = make_communicator(RendezvousInfo{}, CommOptions{});
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  auto t = torch::arange(7, torch::kFloat);
  auto h = comm->all_reduce(t, ReduceOp::Avg, "x");
  h.wait();
  EXPECT_TRUE(h.is_completed());
  EXPECT_EQ(h.sequence(), 0u);
  EXPECT_EQ(h.label(), "x");
  EXPECT_EQ(h.kind(), "all_reduce");
  EXPECT_TRUE(torch::equal(t, torch::arange(7, torch::kFloat)));
  auto out = torch::zeros({7});
  comm->reduce_scatter(t, out, ReduceOp::Sum, "rs").wait();
  EXPECT_TRUE(torch::equal(out, t));
  auto gathered = torch::zeros({7});
  comm->all_gather(t, gathered, "ag").wait();
  EXPECT_TRUE(torch::equal(gathered, t));
  comm->broadcast(t, 0, "b").wait();
  comm->barrier("end");
  EXPECT_EQ(comm->next_sequence(), 5u);
}

TEST(CommSingle, RejectsMisuseWithLabelledErrors) {
  RendezvousInfo info;
  auto comm = make_communicator(info, CommOptions{});
  auto matrix = torch::zeros({4, 3});
  try {
    comm->all_reduce(matrix.t(), ReduceOp::Sum, "grads.view");
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_TRUE(contains(e.what(), "all_reduce 'grads.view'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "contiguous")) << e.what();
  }
  try {
    comm->all_reduce(torch::empty({4}, torch::Device(torch::kMeta)), ReduceOp::Sum, "meta");
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_TRUE(contains(e.what(), "meta")) << e.what();
#ifndef ZT_CUDA
    EXPECT_TRUE(contains(e.what(), "no CUDA support")) << e.what();
#endif
  }
  EXPECT_THROW(comm->all_gather(torch::zeros({3}), torch::zeros({4}), "ag"), CommError);
  EXPECT_THROW(comm->reduce_scatter(torch::zeros({3}), torch::zeros({3}, torch::kBFloat16), ReduceOp::Sum, "rs"),
               CommError);
  EXPECT_THROW(comm->broadcast(torch::zeros({3}), 1, "b"), CommError);
  EXPECT_EQ(comm->next_sequence(), 0u);  // refused calls take no sequence number
}

// ---------------------------------------------------------------- several ranks

namespace {

std::shared_ptr<Communicator> rank_communicator() {
  CollectivePaths paths;
  if (std::getenv("ZT_TEST_COMM_EMULATE") != nullptr) {
    paths.emulate_avg = paths.emulate_low_precision = paths.emulate_reduce_scatter = true;
    paths.native_gloo_all_gather = true;      // the other all_gather path
    paths.native_gloo_reduce_scatter = true;  // scratch inputs take the general path too
  }
  return make_communicator(rendezvous_from_environment(), comm_options_from_environment(), paths);
}

// Small integers (-5..5): exact in bf16, and sums over a few ranks stay exact.
at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype, int salt) {
  auto i = torch::arange(n, torch::kLong);
  return ((i * 7 + rank * 3 + salt) % 11 - 5).to(dtype);
}

at::Tensor reference(ReduceOp op, int world, int64_t n, at::ScalarType dtype, int salt) {
  auto acc = rank_input(0, n, dtype, salt).to(torch::kFloat);
  for (int r = 1; r < world; ++r) {
    auto x = rank_input(r, n, dtype, salt).to(torch::kFloat);
    acc = op == ReduceOp::Max ? torch::maximum(acc, x) : acc + x;
  }
  if (op == ReduceOp::Avg) acc = acc / world;
  return acc;
}

double tolerance(at::ScalarType dtype) { return dtype == torch::kBFloat16 ? 0.04 : 1e-5; }

const std::vector<int64_t> kSizes{1, 7, 1001};
const std::vector<at::ScalarType> kTypes{torch::kFloat, torch::kBFloat16};
const std::vector<ReduceOp> kOps{ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max};

void expect_ranks_pass(const std::string& filter, std::vector<int> worlds, std::map<std::string, std::string> env = {}) {
  for (int world : worlds) {
    auto r = run_ranks(world, filter, env);
    EXPECT_TRUE(r.all_succeeded()) << filter << " on " << world << " ranks failed:\n" << r.describe();
  }
}

const std::map<std::string, std::string> kEmulate{{"ZT_TEST_COMM_EMULATE", "1"}};
// Gloo's own paths where the ranks could meet in shared memory (the default on one machine).
const std::map<std::string, std::string> kGloo{{"ZT_COMM_SHARED_MEMORY", "0"}};

}  // namespace

TEST(CommMultiRank, AllReduce) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    int rank = comm->rank(), world = comm->world_size();
    int salt = 0;
    for (auto dtype : kTypes) {
      for (auto op : kOps) {
        for (auto n : kSizes) {
          auto t = rank_input(rank, n, dtype, ++salt);
          auto h = comm->all_reduce(t, op, "ar");
          h.wait();
          auto expected = reference(op, world, n, dtype, salt);
          ASSERT_TRUE(torch::allclose(t.to(torch::kFloat), expected, 0, tolerance(dtype)))
              << to_string(op) << " " << c10::toString(dtype) << " n=" << n << " rank " << rank;
          ASSERT_EQ(t.scalar_type(), dtype);
        }
      }
    }
    return;
  }
  expect_ranks_pass("CommMultiRank.AllReduce", {2, 3});
  expect_ranks_pass("CommMultiRank.AllReduce", {2, 3}, kGloo);
  expect_ranks_pass("CommMultiRank.AllReduce", {3}, kEmulate);
}

// split(): groups of the ranks with one color, each with collectives of its own; a group of one
// is local, a group of all ranks shares the job's connections; groups split again and keep their
// ranks' nodes; node groups from the placement (here two "nodes" of two ranks on this machine).
TEST(CommMultiRank, SplitMakesGroupsOfTheRanksWithOneColor) {
  if (is_rank_process()) {
    RendezvousInfo info = rendezvous_from_environment();
    const int rank = info.rank;
    info.local_world_size = 2;
    info.local_rank = rank % 2;
    info.node_rank = rank / 2;
    auto world = make_communicator(info, comm_options_from_environment());
    auto sum_of_job_ranks = [&](Communicator& group) {
      at::Tensor t = at::full({3}, double(rank), at::kFloat);
      group.all_reduce(t, ReduceOp::Sum, "sum").wait();
      return t[2].item<double>();
    };
    auto pairs = world->split(rank / 2, "pairs");  // {0,1}, {2,3}
    ASSERT_EQ(pairs->world_size(), 2);
    EXPECT_EQ(pairs->rank(), rank % 2);
    EXPECT_EQ(sum_of_job_ranks(*pairs), rank < 2 ? 1.0 : 5.0);
    auto across = world->split(rank % 2, "across");  // {0,2}, {1,3}
    EXPECT_EQ(across->rank(), rank / 2);
    EXPECT_EQ(sum_of_job_ranks(*across), rank % 2 == 0 ? 2.0 : 4.0);
    // A gather within a group: block r is the group's rank r's.
    at::Tensor mine = at::full({2}, double(rank), at::kBFloat16);
    at::Tensor both = at::empty({4}, at::kBFloat16);
    across->all_gather(mine, both, "gather").wait();
    EXPECT_EQ(both[0].item<double>(), double(rank % 2));
    EXPECT_EQ(both[3].item<double>(), double(rank % 2 + 2));
    auto everyone = world->split(7, "all");
    EXPECT_EQ(everyone->world_size(), 4);
    EXPECT_EQ(sum_of_job_ranks(*everyone), 6.0);
    auto alone = world->split(rank, "alone");
    EXPECT_EQ(alone->world_size(), 1);
    EXPECT_EQ(sum_of_job_ranks(*alone), double(rank));
    auto nested = pairs->split(0, "again");  // a group of a group
    EXPECT_EQ(nested->world_size(), 2);
    EXPECT_EQ(sum_of_job_ranks(*nested), rank < 2 ? 1.0 : 5.0);
    // The groups and the world keep their own sequence numbers; the world's collectives still pair.
    EXPECT_EQ(sum_of_job_ranks(*world), 6.0);
    // Errors name the group and the rank in the job.
    try {
      pairs->all_gather(at::zeros({2}), at::zeros({3}), "bad");
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(rank % 2) + "/2 of group 'pairs' (rank " +
                                           std::to_string(rank) + " of the job)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(world->split(-1, "negative"), CommError);
    const NodeGroups nodes = make_node_groups(world);
    EXPECT_EQ(nodes.within_node->world_size(), 2);
    EXPECT_EQ(nodes.within_node->rank(), rank % 2);
    EXPECT_EQ(sum_of_job_ranks(*nodes.within_node), rank < 2 ? 1.0 : 5.0);
    EXPECT_EQ(nodes.across_nodes->world_size(), 2);
    EXPECT_EQ(sum_of_job_ranks(*nodes.across_nodes), rank % 2 == 0 ? 2.0 : 4.0);
    // A group keeps its ranks' nodes: a pair lies within one node, a group across them has one
    // rank per node, a group of all has the world's placement, a group of one is its own node.
    auto placed = [](const Communicator& c) {
      const NodePlacement p = c.placement();
      return std::vector<int>{p.node_rank, p.local_rank, p.local_world_size};
    };
    EXPECT_EQ(placed(*pairs), (std::vector<int>{0, rank % 2, 2}));
    EXPECT_EQ(placed(*across), (std::vector<int>{rank / 2, 0, 1}));
    EXPECT_EQ(placed(*everyone), (std::vector<int>{rank / 2, rank % 2, 2}));
    EXPECT_EQ(placed(*alone), (std::vector<int>{0, 0, 1}));
    EXPECT_EQ(placed(*nested), (std::vector<int>{0, rank % 2, 2}));
    // The data-parallel groups of a grid of pairs span both nodes, so their node groups follow
    // the nodes: one rank per node (before, every group claimed one node).
    const ProcessGrid grid = make_process_grid(world, 2);
    EXPECT_EQ(placed(*grid.tensor), (std::vector<int>{0, rank % 2, 2}));
    EXPECT_EQ(placed(*grid.data), (std::vector<int>{rank / 2, 0, 1}));
    const NodeGroups data_nodes = make_node_groups(grid.data);
    EXPECT_EQ(data_nodes.within_node->world_size(), 1);
    EXPECT_EQ(data_nodes.across_nodes->world_size(), 2);
    return;
  }
  expect_ranks_pass("CommMultiRank.SplitMakesGroupsOfTheRanksWithOneColor", {4});
}

// On one node the node groups are the world itself and a world of one: nothing is sent.
TEST(CommSingle, NodeGroupsOfOneNodeSendNothing) {
  auto world = make_communicator(RendezvousInfo{}, CommOptions{});
  const NodeGroups groups = make_node_groups(world);
  EXPECT_EQ(groups.within_node.get(), world.get());
  EXPECT_EQ(groups.across_nodes->world_size(), 1);
  EXPECT_EQ(world->next_sequence(), 0u);
}

// Communicators made one after another on one port: a rank that makes its second while rank 0
// still holds its first store must not join that old store (it used to count itself arrived
// there and hang in the new group); it waits for rank 0's second store. Rank 0 is held back
// for a second before it lets its first communicator go.
TEST(CommMultiRank, SuccessiveCommunicatorsOnOnePortMeetTheirOwnPeers) {
  if (is_rank_process()) {
    for (int round = 0; round < 3; ++round) {
      auto comm = rank_communicator();
      auto t = torch::full({4}, float(comm->rank() + 1 + 10 * round));
      comm->all_reduce(t, ReduceOp::Sum, "round").wait();
      const int world = comm->world_size();
      const float expected = float(world * (world + 1) / 2 + 10 * round * world);
      ASSERT_TRUE(torch::allclose(t, torch::full({4}, expected))) << "round " << round << " rank " << comm->rank();
      if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    return;
  }
  expect_ranks_pass("CommMultiRank.SuccessiveCommunicatorsOnOnePortMeetTheirOwnPeers", {2, 3});
}

TEST(CommMultiRank, ReduceScatter) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    int rank = comm->rank(), world = comm->world_size();
    int salt = 0;
    for (auto dtype : kTypes) {
      for (auto op : kOps) {
        for (auto n : kSizes) {
          auto input = rank_input(rank, world * n, dtype, ++salt);
          auto before = input.clone();
          auto output = torch::full({n}, 99, dtype);
          comm->reduce_scatter(input, output, op, "rs").wait();
          auto expected = reference(op, world, world * n, dtype, salt).narrow(0, rank * n, n);
          ASSERT_TRUE(torch::allclose(output.to(torch::kFloat), expected, 0, tolerance(dtype)))
              << to_string(op) << " " << c10::toString(dtype) << " n=" << n << " rank " << rank << "\n"
              << output << expected;
          ASSERT_TRUE(torch::equal(input, before)) << "reduce_scatter changed its input";
          // In place: the output is this rank's own block of the input (stage 1 does this).
          auto in_place = input.clone();
          comm->reduce_scatter(in_place, in_place.narrow(0, rank * n, n), op, "rs.in_place").wait();
          ASSERT_TRUE(torch::allclose(in_place.narrow(0, rank * n, n).to(torch::kFloat), expected, 0, tolerance(dtype)))
              << "in place " << to_string(op) << " " << c10::toString(dtype) << " n=" << n << " rank " << rank;
          // Scratch input, separate output and in place.
          auto scratch = input.clone();
          auto scratch_out = torch::full({n}, 99, dtype);
          comm->reduce_scatter(scratch, scratch_out, op, "rs.scratch", InputUse::Scratch).wait();
          ASSERT_TRUE(torch::allclose(scratch_out.to(torch::kFloat), expected, 0, tolerance(dtype)))
              << "scratch " << to_string(op) << " " << c10::toString(dtype) << " n=" << n << " rank " << rank;
          scratch = input.clone();
          comm->reduce_scatter(scratch, scratch.narrow(0, rank * n, n), op, "rs.scratch_in_place", InputUse::Scratch)
              .wait();
          ASSERT_TRUE(torch::allclose(scratch.narrow(0, rank * n, n).to(torch::kFloat), expected, 0, tolerance(dtype)))
              << "scratch in place " << to_string(op) << " " << c10::toString(dtype) << " n=" << n;
        }
      }
    }
    return;
  }
  expect_ranks_pass("CommMultiRank.ReduceScatter", {2, 3});
  expect_ranks_pass("CommMultiRank.ReduceScatter", {2, 3}, kGloo);
  expect_ranks_pass("CommMultiRank.ReduceScatter", {3}, kEmulate);
}

TEST(CommMultiRank, AllGatherAndBroadcast) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    int rank = comm->rank(), world = comm->world_size();
    int salt = 0;
    for (auto dtype : kTypes) {
      for (auto n : kSizes) {
        ++salt;
        auto input = rank_input(rank, n, dtype, salt);
        auto output = torch::full({world * n}, 99, dtype);
        comm->all_gather(input, output, "ag").wait();
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r) parts.push_back(rank_input(r, n, dtype, salt));
        ASSERT_TRUE(torch::equal(output, torch::cat(parts))) << c10::toString(dtype) << " n=" << n;

        for (int root : {0, world - 1}) {
          auto t = rank_input(rank, n, dtype, salt + root);
          comm->broadcast(t, root, "bc").wait();
          ASSERT_TRUE(torch::equal(t, rank_input(root, n, dtype, salt + root))) << "root " << root << " n=" << n;
        }
      }
    }
    return;
  }
  expect_ranks_pass("CommMultiRank.AllGatherAndBroadcast", {2, 3});
  expect_ranks_pass("CommMultiRank.AllGatherAndBroadcast", {2, 3}, kGloo);
  expect_ranks_pass("CommMultiRank.AllGatherAndBroadcast", {3}, kEmulate);
}

TEST(CommMultiRank, AsyncHandlesSequenceNumbersAndBarrier) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    int rank = comm->rank(), world = comm->world_size();
    // Several collectives in flight, waited out of order and from another thread.
    std::vector<at::Tensor> buffers;
    std::vector<CollectiveHandle> handles;
    for (int b = 0; b < 4; ++b) {
      buffers.push_back(rank_input(rank, 1001 + b, torch::kFloat, b));
      handles.push_back(comm->all_reduce(buffers.back(), ReduceOp::Sum, "bucket" + std::to_string(b)));
    }
    for (int b = 0; b < 4; ++b) {
      EXPECT_EQ(handles[b].sequence(), uint64_t(b));
      EXPECT_EQ(handles[b].label(), "bucket" + std::to_string(b));
    }
    std::thread waiter([&] { handles[3].wait(); });
    for (int b = 2; b >= 0; --b) handles[b].wait();
    waiter.join();
    for (int b = 0; b < 4; ++b) {
      EXPECT_TRUE(handles[b].is_completed());
      handles[b].wait();  // again: returns at once
      ASSERT_TRUE(torch::equal(buffers[b], reference(ReduceOp::Sum, world, 1001 + b, torch::kFloat, b)));
    }
    comm->barrier("middle");
    // Every rank issued the same calls, so every rank agrees on the next sequence number.
    auto mine = torch::full({1}, double(comm->next_sequence()), torch::kDouble);
    auto all = torch::zeros({world}, torch::kDouble);
    uint64_t gather_seq = comm->next_sequence();
    auto h = comm->all_gather(mine, all, "sequence.check");
    EXPECT_EQ(h.sequence(), gather_seq);
    h.wait();
    EXPECT_TRUE(torch::equal(all, torch::full({world}, double(gather_seq), torch::kDouble))) << all;
    EXPECT_EQ(gather_seq, 5u);  // 4 all-reduces and a barrier
    comm->barrier("end");
    return;
  }
  expect_ranks_pass("CommMultiRank.AsyncHandlesSequenceNumbersAndBarrier", {2, 3});
}

TEST(CommMultiRank, SkippedCollectiveTimesOutWithLabelledMessage) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    auto t = torch::ones({1000});
    comm->all_reduce(t, ReduceOp::Sum, "warmup").wait();
    if (comm->rank() == 1) {
      std::this_thread::sleep_for(6s);  // skips 'grads.bucket3', stays alive past the timeout
      return;
    }
    auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t, ReduceOp::Sum, "grads.bucket3").wait();
      ADD_FAILURE() << "expected a timeout";
    } catch (const CommError& e) {
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "CAUGHT: " << e.what() << "\nWAITED: " << waited << " s" << std::endl;
      EXPECT_GE(waited, 1.5);
      // "Within seconds", not a hang: the TCPStore client retries once after a randomised back-off
      // of a few seconds (measured up to 3.5 s), so the bound leaves room for it on a busy machine.
      EXPECT_LT(waited, 2.0 + 10.0);
    }
    // A communicator that failed refuses further work at once instead of hanging again.
    try {
      comm->barrier("after");
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      EXPECT_TRUE(contains(e.what(), "barrier 'after' (seq 2)")) << e.what();
      EXPECT_TRUE(contains(e.what(), "failed earlier")) << e.what();
    }
    return;
  }
  auto r = run_ranks(2, "CommMultiRank.SkippedCollectiveTimesOutWithLabelledMessage",
                     {{"ZT_COMM_TIMEOUT_SECONDS", "2"}});
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  echo_caught(r.ranks[0].output);
  EXPECT_TRUE(contains(r.ranks[0].output,
                       "rank 0/2 timed out after 2.0 s in all_reduce 'grads.bucket3' (seq 1, 1000 float elements): "
                       "waiting for the other ranks to enter the same collective"))
      << r.describe();
  // Without a launcher the flight recorder is kept in memory and written to the log at the timeout.
  EXPECT_TRUE(contains(r.ranks[0].output, "flight recorder of rank 0/2: the last 2 collectives, oldest first"))
      << r.describe();
  EXPECT_TRUE(contains(r.ranks[0].output, "timed-out  all_reduce     'grads.bucket3'")) << r.describe();
  EXPECT_TRUE(contains(r.ranks[0].output, "completed  all_reduce     'warmup'")) << r.describe();
  EXPECT_LT(r.wall_seconds, 20.0);
}

TEST(CommMultiRank, PeerThatExitsFailsTheCollective) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    auto t = torch::ones({1000});
    comm->all_reduce(t, ReduceOp::Sum, "warmup").wait();
    if (comm->rank() == 1) std::_Exit(0);  // gone without a word
    try {
      comm->all_reduce(t, ReduceOp::Sum, "grads.bucket0").wait();
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      std::cout << "CAUGHT: " << e.what() << std::endl;
      EXPECT_TRUE(contains(e.what(), "rank 0/2")) << e.what();
      EXPECT_TRUE(contains(e.what(), "all_reduce 'grads.bucket0' (seq 1, 1000 float elements)")) << e.what();
    }
    return;
  }
  auto r = run_ranks(2, "CommMultiRank.PeerThatExitsFailsTheCollective", {{"ZT_COMM_TIMEOUT_SECONDS", "10"}});
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  echo_caught(r.ranks[0].output);
  EXPECT_LT(r.wall_seconds, 30.0);
}

namespace {

// Local addresses ("0100007F:1F90") of this process's listening TCP sockets.
std::vector<std::string> listening_addresses() {
  std::set<std::string> inodes;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode)) out.push_back(local);
    }
  }
  return out;
}

}  // namespace

TEST(CommMultiRank, LocalRunListensOnLoopbackOnly) {
  if (is_rank_process()) {
    auto comm = rank_communicator();
    auto sockets = listening_addresses();
    if (comm->rank() == 0) EXPECT_FALSE(sockets.empty()) << "rank 0 runs the store's server";
    for (const auto& local : sockets) {
      std::string addr = local.substr(0, local.find(':'));
      EXPECT_TRUE(addr == "0100007F" || addr == "00000000000000000000000001000000")
          << "rank " << comm->rank() << " listens on " << local << ", not on loopback";
    }
    comm->barrier("end");
    return;
  }
  expect_ranks_pass("CommMultiRank.LocalRunListensOnLoopbackOnly", {2});
}

// Under torchrun the agent on node 0 already serves the store at MASTER_PORT
// (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects to it, rank 0 included, and two
// communicators made one after another on it each meet their own peers. The test process plays
// the agent.
TEST(CommMultiRank, TorchrunsAgentStoreServesEveryRankAndCommunicator) {
  if (is_rank_process()) {
    const RendezvousInfo info = rendezvous_from_environment();
    EXPECT_TRUE(info.agent_store);
    EXPECT_EQ(info.listen_fd, -1) << "no socket of our own to serve on";
    for (int generation = 1; generation <= 2; ++generation) {
      auto comm = make_communicator(info, comm_options_from_environment());
      auto t = torch::full({4}, float(comm->rank() + generation));
      comm->all_reduce(t, ReduceOp::Sum, "agent.store").wait();
      EXPECT_EQ(t[0].item<float>(), float(1 + 2 * generation)) << "generation " << generation;
      comm->barrier("end");
    }
    return;
  }
  const int port = free_port();
  c10d::TCPStoreOptions agent;
  agent.port = uint16_t(port);
  agent.isServer = true;
  agent.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", agent);
  auto r = run_ranks(2, "CommMultiRank.TorchrunsAgentStoreServesEveryRankAndCommunicator",
                     {{"MASTER_PORT", std::to_string(port)}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                      {"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     120s);
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  EXPECT_FALSE(rendezvous_from_environment(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}}))
                   .agent_store);
}

TEST(CommRendezvousTimeout, MissingPeersFailWithinTheTimeout) {
  if (is_rank_process()) {
    auto start = std::chrono::steady_clock::now();
    try {
      rank_communicator();
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "CAUGHT: " << e.what() << std::endl;
      // "Within seconds", not a hang: the TCPStore client retries once after a randomised back-off
      // of a few seconds (measured up to 3.5 s), so the bound leaves room for it on a busy machine.
      EXPECT_LT(waited, 2.0 + 10.0);
    }
    return;
  }
  // Rank 0 alone: its store runs, nobody else arrives.
  std::map<std::string, std::string> env{{"RANK", "0"},
                                         {"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "127.0.0.1"},
                                         {"MASTER_PORT", std::to_string(free_port())},
                                         {"ZT_TEST_RANK_ROLE", "1"},
                                         {"ZT_COMM_TIMEOUT_SECONDS", "2"}};
  std::vector<std::string> argv{self_executable(), "--gtest_filter=CommRendezvousTimeout.*"};
  auto r0 = run_process(argv, env, 60s);
  EXPECT_EQ(r0.exit_code, 0) << r0.output;
  echo_caught(r0.output);
  EXPECT_TRUE(contains(r0.output, "rank 0/2 timed out after 2.0 s at the rendezvous at 127.0.0.1:")) << r0.output;
  EXPECT_TRUE(contains(r0.output, "1 of 2 ranks arrived")) << r0.output;
  // Rank 1 alone: there is no store to reach.
  env["RANK"] = "1";
  env["MASTER_PORT"] = std::to_string(free_port());
  auto r1 = run_process(argv, env, 60s);
  EXPECT_EQ(r1.exit_code, 0) << r1.output;
  echo_caught(r1.output);
  EXPECT_TRUE(contains(r1.output, "rank 1/2: could not reach rank 0's rendezvous store at 127.0.0.1:")) << r1.output;
}

// ---------------------------------------------------------------- fault injection

namespace {

struct Tiny : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Tiny() {
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); }
};

// A fresh stage-2 engine over `comm`; one training step. Throws what the engine throws.
std::shared_ptr<Tiny> one_engine_step(std::shared_ptr<Communicator> comm) {
  // overlap_comm: gradients are reduced from autograd hooks, inside backward.
  auto config = parse_config(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "overlap_comm": true}})", {},
      comm->world_size());
  torch::manual_seed(5);
  auto net = std::make_shared<Tiny>();
  Engine engine(net, config, comm);
  auto loss = net->forward(torch::randn({2, 4})).pow(2).mean();
  engine.backward(loss);
  engine.step();
  return net;
}

}  // namespace

TEST(CommFaults, BadFaultsAreConfigErrors) {
  auto comm = make_communicator(RendezvousInfo{}, {});
  EXPECT_THROW(FaultInjectingCommunicator(nullptr, {}), ConfigError);
  EXPECT_THROW(FaultInjectingCommunicator(comm, {{.sequence = 1, .action = CommFault::Action::Delay, .delay = -5ms}}),
               ConfigError);
  EXPECT_THROW(FaultInjectingCommunicator(comm, {{.sequence = 2}, {.sequence = 2}}), ConfigError);
}

// Every rank fails the same collective of an engine step (a gradient reduction inside
// backward, then the last collective of step()): a CommError that names it, and the
// communicator refuses everything afterwards.
TEST(CommFaults, AFailedCollectiveInAnEngineStepIsACommErrorAndLeavesTheCommunicatorUnusable) {
  if (is_rank_process()) {
    auto inner = rank_communicator();
    // A dry run learns the collectives of construction plus one step.
    auto counting = std::make_shared<FaultInjectingCommunicator>(inner, std::vector<CommFault>{});
    one_engine_step(counting);
    const auto seen = counting->issued();
    ASSERT_GE(seen.size(), 2u);
    const auto first_reduction = std::find_if(seen.begin(), seen.end(), [](const auto& c) {
      return c.kind == "reduce_scatter" || c.kind == "all_reduce";
    });
    ASSERT_NE(first_reduction, seen.end());
    for (size_t k : {size_t(first_reduction - seen.begin()), seen.size() - 1}) {
      const std::uint64_t fail_at = inner->next_sequence() + k;
      const std::string label = seen[k].label;
      const std::string kind = seen[k].kind;
      auto faulty = std::make_shared<FaultInjectingCommunicator>(
          inner, std::vector<CommFault>{{.sequence = fail_at, .action = CommFault::Action::Fail}});
      try {
        one_engine_step(faulty);
        ADD_FAILURE() << "expected CommError at " << kind << " '" << label << "'";
      } catch (const CommError& e) {
        std::cout << "CAUGHT: " << e.what() << std::endl;
        EXPECT_TRUE(contains(e.what(), fmt::format("rank {}/2 failed in {} '{}' (seq {}): injected fault",
                                                   inner->rank(), kind, label, fail_at)))
            << e.what();
      }
      try {
        faulty->barrier("after");
        ADD_FAILURE() << "expected CommError";
      } catch (const CommError& e) {
        EXPECT_TRUE(contains(e.what(), fmt::format("cannot start barrier 'after' (seq {})", fail_at))) << e.what();
        EXPECT_TRUE(contains(e.what(), "failed earlier")) << e.what();
        EXPECT_TRUE(contains(e.what(), "injected fault")) << e.what();
      }
      // Every rank failed the same collective before the inner communicator saw it, so the
      // inner one still pairs its collectives correctly.
      auto t = torch::ones({3});
      inner->all_reduce(t, ReduceOp::Sum, "still.usable").wait();
      EXPECT_TRUE(torch::equal(t, torch::full({3}, 2.0f)));
    }
    return;
  }
  auto r = run_ranks(2, "CommFaults.AFailedCollectiveInAnEngineStepIsACommErrorAndLeavesTheCommunicatorUnusable",
                     {{"ZT_COMM_TIMEOUT_SECONDS", "20"}}, std::chrono::seconds(60));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
  echo_caught(r.ranks[0].output);
}

// Rank 1 is late to two collectives (one of them inside an engine step): results are those of
// an undisturbed run.
TEST(CommFaults, ADelayedCollectiveStillGivesCorrectResults) {
  if (is_rank_process()) {
    auto inner = rank_communicator();
    std::vector<CommFault> faults;
    if (inner->rank() == 1) {
      faults.push_back({.sequence = inner->next_sequence() + 1, .action = CommFault::Action::Delay, .delay = 300ms});
      faults.push_back({.sequence = inner->next_sequence() + 4, .action = CommFault::Action::Delay, .delay = 300ms});
    }
    auto comm = std::make_shared<FaultInjectingCommunicator>(inner, faults);
    for (int i = 0; i < 3; ++i) {
      auto t = torch::full({5}, float(comm->rank() + 1 + i));
      comm->all_reduce(t, ReduceOp::Sum, "sum" + std::to_string(i)).wait();
      EXPECT_TRUE(torch::equal(t, torch::full({5}, float(3 + 2 * i)))) << i;
    }
    auto pd = one_engine_step(comm)->parameters();
    auto pp = one_engine_step(inner)->parameters();
    ASSERT_EQ(pd.size(), pp.size());
    for (size_t i = 0; i < pd.size(); ++i) EXPECT_TRUE(torch::equal(pd[i], pp[i])) << i;
    return;
  }
  auto r = run_ranks(2, "CommFaults.ADelayedCollectiveStillGivesCorrectResults", {{"ZT_COMM_TIMEOUT_SECONDS", "20"}},
                     std::chrono::seconds(60));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// ------------------------------------------------------------------ comms logger

namespace {

CommsLoggerConfig logger_config(bool verbose = false, bool debug = false, bool prof_all = true,
                                std::vector<std::string> prof_ops = {}) {
  CommsLoggerConfig c;
  c.enabled = true;
  c.verbose = verbose;
  c.debug = debug;
  c.prof_all = prof_all;
  c.prof_ops = std::move(prof_ops);
  return c;
}

}  // namespace

TEST(CommsLogger, BandwidthsFollowDeepSpeedsFormulas) {
  // 1 MB in 1 ms on 4 ranks: all_reduce moves 2 × the buffer, 2(n-1)/n of it over the bus.
  auto ar = comm_bandwidth("all_reduce", 1'000'000, 1.0, 4);
  EXPECT_DOUBLE_EQ(ar.algbw_gbps, 16.0);
  EXPECT_DOUBLE_EQ(ar.busbw_gbps, 12.0);
  // Gathers and scatters count the whole buffer (n blocks), (n-1)/n of it over the bus.
  auto ag = comm_bandwidth("all_gather", 1'000'000, 2.0, 4);
  EXPECT_DOUBLE_EQ(ag.algbw_gbps, 16.0);
  EXPECT_DOUBLE_EQ(ag.busbw_gbps, 12.0);
  auto rs = comm_bandwidth("reduce_scatter_tensor", 1'000'000, 2.0, 4);
  EXPECT_DOUBLE_EQ(rs.algbw_gbps, 16.0);
  auto bc = comm_bandwidth("broadcast", 1'000'000, 4.0, 4);
  EXPECT_DOUBLE_EQ(bc.algbw_gbps, 2.0);
  EXPECT_DOUBLE_EQ(bc.busbw_gbps, 2.0);
  EXPECT_DOUBLE_EQ(comm_bandwidth("barrier", 0, 1.0, 4).algbw_gbps, 0.0);
  EXPECT_DOUBLE_EQ(comm_bandwidth("all_reduce", 100, 0.0, 4).algbw_gbps, 0.0);  // no division by zero
}

TEST(CommsLogger, SizesAreWrittenAsDeepSpeedWritesThem) {
  EXPECT_EQ(comm_size_text(0), "0B");
  EXPECT_EQ(comm_size_text(512), "512.0 B");
  EXPECT_EQ(comm_size_text(1536), "1.5 KB");
  EXPECT_EQ(comm_size_text(1280), "1.25 KB");
  EXPECT_EQ(comm_size_text(1 << 20), "1.0 MB");
  EXPECT_EQ(comm_size_text(3ull << 30), "3.0 GB");
}

TEST(CommsLogger, AggregatesPerOperationAndMessageSize) {
  CommsLogger logger(logger_config(), 0, 2, [](const std::string&) {});
  for (int i = 1; i <= 10; ++i) logger.record("all_reduce", "grads.bucket0", 4096, double(i));
  logger.record("all_reduce", "train.loss", 8, 0.5);
  logger.record("barrier", "train.end", 0, 2.0);
  logger.record("all_gather_into_tensor", "params.bucket0", 1024, 1.0);
  logger.record("all_gather", "params.bucket1", 1024, 3.0);
  EXPECT_EQ(logger.total_count(), 14);
  const auto rows = logger.rows();
  ASSERT_EQ(rows.size(), 4u);
  // Operations in the order first seen, sizes ascending within one.
  EXPECT_EQ(rows[0].op, "all_reduce");
  EXPECT_EQ(rows[0].message_bytes, 8u);
  EXPECT_EQ(rows[0].count, 1);
  EXPECT_EQ(rows[1].op, "all_reduce");
  EXPECT_EQ(rows[1].message_bytes, 4096u);
  EXPECT_EQ(rows[1].count, 10);
  EXPECT_DOUBLE_EQ(rows[1].total_ms, 55.0);
  // Trimmed mean: one value cut at each end of 1..10.
  EXPECT_DOUBLE_EQ(rows[1].avg_ms, 5.5);
  EXPECT_TRUE(rows[1].caller.empty());
  EXPECT_EQ(rows[2].op, "barrier");
  EXPECT_EQ(rows[3].op, "all_gather");  // DeepSpeed's alias counts as the same operation
  EXPECT_EQ(rows[3].count, 2);
  EXPECT_DOUBLE_EQ(rows[3].avg_ms, 2.0);
  // algbw of the all_gathers: 2 × 1024 bytes per 1 ms and per 3 ms, averaged per collective.
  const double expected = (2048.0 / 1.0 + 2048.0 / 3.0) / 2 * 8 / 1e6;
  EXPECT_NEAR(rows[3].algbw_gbps, expected, 1e-12);

  const std::string table = logger.table();
  EXPECT_TRUE(contains(table, "Comm. Op")) << table;
  EXPECT_TRUE(contains(table, "\nall_reduce\n")) << table;
  EXPECT_TRUE(contains(table, "4.0 KB")) << table;
  const std::string csv = logger.csv();
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5) << csv;
  EXPECT_TRUE(contains(csv, "all_reduce,,4096,10,55.000000,5.500000,")) << csv;
}

TEST(CommsLogger, DebugGroupsByCallerAndVerbosePrintsOnRankZero) {
  std::vector<std::string> lines;
  CommsLogger logger(logger_config(true, true), 0, 2, [&](const std::string& l) { lines.push_back(l); });
  logger.record("all_reduce", "grads.bucket0", 1024, 1.0);
  logger.record("all_reduce", "grads.bucket1", 1024, 1.0);
  logger.record("all_reduce", "grads.bucket0", 1024, 1.0);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "comm op: all_reduce | [Caller: grads.bucket0] | time (ms): 1.00 | msg size: 1.0 KB | "
                      "algbw (Gbps): 0.02 | busbw (Gbps): 0.01");
  const auto rows = logger.rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].caller, "grads.bucket0");
  EXPECT_EQ(rows[0].count, 2);
  EXPECT_EQ(rows[1].caller, "grads.bucket1");

  std::vector<std::string> other;
  CommsLogger rank1(logger_config(true), 1, 2, [&](const std::string& l) { other.push_back(l); });
  rank1.record("barrier", "x", 0, 1.0);
  EXPECT_TRUE(other.empty());  // as DeepSpeed's log_dist(ranks=[0])
  EXPECT_EQ(rank1.total_count(), 1);
}

TEST(CommsLogger, ProfOpsSelectsOperationsAndRejectsUnknownNames) {
  CommsLogger only(logger_config(false, false, false, {"all_reduce", "reduce_scatter_tensor"}), 0, 2);
  EXPECT_TRUE(only.wants("all_reduce"));
  EXPECT_TRUE(only.wants("reduce_scatter"));
  EXPECT_FALSE(only.wants("all_gather"));
  EXPECT_FALSE(only.wants("barrier"));
  CommsLogger all(logger_config(false, false, true, {}), 0, 2);
  EXPECT_TRUE(all.wants("barrier"));
  try {
    CommsLogger bad(logger_config(false, false, false, {"all_reduce", "allreduce"}), 0, 2);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "comms_logger.prof_ops")) << msg;
    EXPECT_TRUE(contains(msg, "\"allreduce\"")) << msg;
    for (const auto& name : CommsLogger::operation_names()) EXPECT_TRUE(contains(msg, name)) << msg;
  }
}

// Through a communicator: each completed collective once, with the bytes this rank contributes;
// a reduce_scatter counts its output block, an all_gather its input block. prof_ops filters.
TEST(CommsLogger, CommunicatorRecordsEachCompletedCollective) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto options = comm_options_from_environment();
    options.comms_logger = std::make_shared<CommsLogger>(logger_config(false, true), test_rank(), test_world_size());
    auto comm = make_communicator(rendezvous_from_environment(), options);
    const int world = comm->world_size();
    auto flat = torch::ones({12 * world}, torch::kFloat);
    for (int i = 0; i < 3; ++i) comm->all_reduce(flat, ReduceOp::Sum, "ar").wait();
    auto out = torch::empty({12}, torch::kFloat);
    comm->reduce_scatter(flat, out, ReduceOp::Sum, "rs").wait();
    auto gathered = torch::empty({12 * world}, torch::kFloat);
    auto handle = comm->all_gather(out, gathered, "ag");
    // Not before its wait (in a world of one it completed when issued).
    EXPECT_EQ(options.comms_logger->total_count(), world > 1 ? 4 : 5);
    handle.wait();
    handle.wait();  // waiting again records nothing
    comm->broadcast(out, 0, "bc").wait();
    comm->barrier("end");
    const auto rows = options.comms_logger->rows();
    ASSERT_EQ(rows.size(), 5u);
    EXPECT_EQ(rows[0].op, "all_reduce");
    EXPECT_EQ(rows[0].count, 3);
    EXPECT_EQ(rows[0].message_bytes, uint64_t(48 * world));
    EXPECT_EQ(rows[1].op, "reduce_scatter");
    EXPECT_EQ(rows[1].message_bytes, 48u);
    EXPECT_EQ(rows[2].op, "all_gather");
    EXPECT_EQ(rows[2].message_bytes, 48u);
    EXPECT_EQ(rows[3].op, "broadcast");
    EXPECT_EQ(rows[4].op, "barrier");
    EXPECT_EQ(rows[4].message_bytes, 0u);
    for (const auto& row : rows) EXPECT_GE(row.total_ms, 0.0);

    return;
  }
  for (int world : {1, 2}) {
    auto r = run_ranks(world, "CommsLogger.CommunicatorRecordsEachCompletedCollective");
    EXPECT_TRUE(r.all_succeeded()) << r.describe();
  }
}

TEST(CommsLogger, ProfOpsFiltersWhatACommunicatorRecords) {
  auto options = CommOptions{};
  options.comms_logger = std::make_shared<CommsLogger>(logger_config(false, false, false, {"all_gather"}), 0, 1);
  auto comm = make_communicator(RendezvousInfo{}, options);
  auto flat = torch::ones({8}, torch::kFloat);
  auto gathered = torch::empty({8}, torch::kFloat);
  comm->all_reduce(flat, ReduceOp::Sum, "ar").wait();
  comm->all_gather(flat, gathered, "ag").wait();
  comm->barrier("end");
  const auto rows = options.comms_logger->rows();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].op, "all_gather");
  EXPECT_EQ(rows[0].count, 1);
}
