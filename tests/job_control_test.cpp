// The launchers' meeting point of a multi-node job (launch/job_control.h), with the "nodes" as
// threads of this process on 127.0.0.1. The launches themselves: tests/launch_test.cpp.
#include "launch/job_control.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <thread>

#include "support/process.h"
#include "zerotrain/error.h"

namespace {

using namespace std::chrono_literals;

zt::JobControlOptions node(int rank, int nnodes, int port) {
  zt::JobControlOptions o;
  o.nnodes = nnodes;
  o.node_rank = rank;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.join_timeout = 20s;
  o.heartbeat_timeout = 1500ms;
  o.heartbeat_interval = 100ms;
  return o;
}

// Nodes 1..n-1 join from threads while node 0 is made here; all are returned once joined.
std::vector<std::unique_ptr<zt::JobControl>> meet(int nnodes, int port) {
  std::vector<std::future<std::unique_ptr<zt::JobControl>>> others;
  for (int k = 1; k < nnodes; ++k)
    others.push_back(std::async(std::launch::async, [=] { return std::make_unique<zt::JobControl>(node(k, nnodes, port)); }));
  std::vector<std::unique_ptr<zt::JobControl>> nodes;
  nodes.push_back(std::make_unique<zt::JobControl>(node(0, nnodes, port)));
  for (auto& f : others) nodes.push_back(f.get());
  return nodes;
}

// Polls `node` until it reports a failure or `limit` passes; other nodes keep beating meanwhile.
std::optional<zt::JobFailure> wait_for_failure(zt::JobControl& node, std::chrono::milliseconds limit,
                                               const std::vector<zt::JobControl*>& beating = {}) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (auto f = node.poll()) return f;
    for (zt::JobControl* other : beating) other->poll();
    std::this_thread::sleep_for(20ms);
  }
  return std::nullopt;
}

TEST(JobControl, NodesMeetAndShareNodeZerosRendezvousPort) {
  auto nodes = meet(3, zt::testing::free_port());
  const int port = nodes[0]->rendezvous_port();
  EXPECT_GT(port, 0);
  for (auto& n : nodes) EXPECT_EQ(n->rendezvous_port(), port);
  const int fd = nodes[0]->take_rendezvous_socket();
  EXPECT_GE(fd, 0) << "node 0 holds the ranks' rendezvous socket";
  EXPECT_EQ(nodes[1]->take_rendezvous_socket(), -1);
  ::close(fd);
  for (auto& n : nodes) EXPECT_FALSE(n->poll().has_value()) << "no failure yet";
}

TEST(JobControl, TheFirstFailureReachesEveryOtherNodeOnce) {
  auto nodes = meet(3, zt::testing::free_port());
  EXPECT_TRUE(nodes[2]->report_failure({7, "rank 5 (node 2) exited with code 7"}));
  EXPECT_FALSE(nodes[1]->report_failure({3, "rank 2 (node 1) exited with code 3"})) << "the first report wins";
  for (int k : {0, 1}) {
    auto f = wait_for_failure(*nodes[size_t(k)], 5s);
    ASSERT_TRUE(f.has_value()) << "node " << k;
    EXPECT_EQ(f->code, 7);
    EXPECT_EQ(f->message, "rank 5 (node 2) exited with code 7");
    EXPECT_FALSE(nodes[size_t(k)]->poll().has_value()) << "reported once";
  }
  EXPECT_FALSE(nodes[2]->poll().has_value()) << "a node's own failure is not read back";
}

// A node whose launcher stops beating (killed) is declared failed by node 0, which tells the rest.
TEST(JobControl, NodeZeroDeclaresASilentNodeFailed) {
  auto nodes = meet(3, zt::testing::free_port());
  const auto start = std::chrono::steady_clock::now();
  auto f = wait_for_failure(*nodes[0], 10s, {nodes[1].get()});  // node 2 never beats again
  ASSERT_TRUE(f.has_value());
  EXPECT_NE(f->message.find("node 2 stopped responding"), std::string::npos) << f->message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  auto seen = wait_for_failure(*nodes[1], 5s);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->message, f->message);
}

TEST(JobControl, LosingNodeZeroIsAFailureOnTheOthers) {
  auto nodes = meet(2, zt::testing::free_port());
  nodes[0].reset();  // node 0's launcher is gone, and its store with it
  auto f = wait_for_failure(*nodes[1], 10s);
  ASSERT_TRUE(f.has_value());
  EXPECT_NE(f->message.find("node 0's launcher is gone"), std::string::npos) << f->message;
}

// Node 0 keeps serving until the others have finished, and learns of a failure at their end.
TEST(JobControl, NodeZeroFinishesAfterTheOthers) {
  auto nodes = meet(2, zt::testing::free_port());
  auto zero = std::async(std::launch::async, [&] { return nodes[0]->finish(0); });
  EXPECT_EQ(zero.wait_for(300ms), std::future_status::timeout) << "node 1 has not finished";
  EXPECT_TRUE(nodes[1]->report_failure({4, "rank 1 (node 1) exited with code 4"}));
  EXPECT_FALSE(nodes[1]->finish(4).has_value());
  ASSERT_EQ(zero.wait_for(10s), std::future_status::ready);
  auto f = zero.get();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->code, 4);
}

TEST(JobControl, AMissingNodeIsNamedAfterTheJoinTimeout) {
  const int port = zt::testing::free_port();
  auto one = std::async(std::launch::async, [=] {
    auto o = node(1, 3, port);
    o.join_timeout = 1500ms;
    return std::make_unique<zt::JobControl>(o);
  });
  auto o = node(0, 3, port);
  o.join_timeout = 1500ms;
  try {
    zt::JobControl zero(o);
    FAIL() << "node 2 never joined";
  } catch (const zt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing node(s) 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(one.get(), zt::Error);
}

// Every socket the launch opens listens on the address given, not on every interface.
TEST(JobControl, ListensOnTheGivenAddressOnly) {
  int port = 0;
  const int fd = zt::listen_on_address("127.0.0.1", 0, &port);
  ASSERT_GT(port, 0);
  auto connects = [&](const char* address) {
    const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(uint16_t(port));
    ::inet_pton(AF_INET, address, &to.sin_addr);
    const bool ok = ::connect(c, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0;
    ::close(c);
    return ok;
  };
  EXPECT_TRUE(connects("127.0.0.1"));
  EXPECT_FALSE(connects("127.0.0.2")) << "another loopback address is another address";
  ::close(fd);
  EXPECT_THROW(zt::listen_on_address("no-such-host.invalid", 0, &port), zt::ConfigError);
}

}  // namespace
