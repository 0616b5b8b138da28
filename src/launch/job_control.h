// How the launchers of a multi-node job find and watch each other (docs/comm.md "Several
// nodes"). Internal to the launcher.
//
// Node 0's launcher serves a small control store (c10d::TCPStore) on --master-addr:--master-port,
// bound to that address only, and opens the ranks' rendezvous socket on the same address at a free
// port, which it publishes there; the launchers of the other nodes connect, read that port and
// give it to their ranks as MASTER_PORT, as torchrun's agents do. Every launcher then waits until
// all of them have joined. While the ranks run, each launcher beats a heartbeat into the store
// and reads there the first failure any node reports; node 0 also declares a node whose heartbeat
// stopped (its launcher killed, its machine gone) failed. So one failure ends the job on every
// node within seconds, each launcher naming the failed rank and node.
//
// Contract: one JobControl per launch, used from the launcher's thread (not thread-safe).
// Constructor and methods throw zt::Error (a peer never joined, the store is unreachable at
// construction); poll() and finish() never throw: losing the store is itself reported as a
// failure. Node 0 keeps serving the store until every node has finished or stopped beating.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class TCPStore;
}

namespace zt {

struct JobControlOptions {
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // required: every node must name the same one
  std::chrono::milliseconds join_timeout{300000};     // for all launchers to meet
  std::chrono::milliseconds heartbeat_timeout{10000};  // a node silent this long has failed
  std::chrono::milliseconds heartbeat_interval{500};
};

// A failure somewhere in the job: the exit code the failing rank gave (1 when none) and a line
// naming the rank and node.
struct JobFailure {
  int code = 1;
  std::string message;
};

// Opens a TCP socket listening on `address`:`port` (0: a free port) and on that address only;
// returns the descriptor (close-on-exec) and sets *bound_port. Throws zt::Error naming the address.
int listen_on_address(const std::string& address, int port, int* bound_port);

class JobControl {
 public:
  explicit JobControl(const JobControlOptions& options);
  ~JobControl();
  JobControl(const JobControl&) = delete;
  JobControl& operator=(const JobControl&) = delete;

  // The port of the ranks' rendezvous on master_addr (MASTER_PORT for every rank).
  int rendezvous_port() const { return rendezvous_port_; }
  // Node 0: the listening rendezvous socket, handed to rank 0 (the caller owns it from then on);
  // -1 on other nodes.
  int take_rendezvous_socket();

  // Beats this node's heartbeat (at most once per heartbeat_interval) and returns the job's
  // first failure reported by another node, or found by node 0 in a silent node; nullopt while
  // there is none. The same failure is returned once.
  std::optional<JobFailure> poll();
  // This node's first failure, for the other nodes (message names the rank and node). False when
  // another node's failure was reported first (poll() returns that one) or the store is gone.
  bool report_failure(const JobFailure& failure);
  // This node's ranks have all ended with `code` (0: success). Other nodes return at once; node 0
  // keeps serving until every node has finished or fallen silent, and returns a failure that came
  // meanwhile (nullopt when none).
  std::optional<JobFailure> finish(int code);

 private:
  std::string key(const std::string& name) const;
  std::optional<JobFailure> read_failure();

  JobControlOptions options_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  int rendezvous_fd_ = -1;
  int rendezvous_port_ = 0;
  int64_t beats_ = 0;
  std::chrono::steady_clock::time_point last_beat_{};
  bool failure_seen_ = false, store_lost_ = false;
  // Node 0: each node's last heartbeat value and when it last changed.
  std::vector<std::string> last_heartbeat_;
  std::vector<std::chrono::steady_clock::time_point> heartbeat_changed_;
};

}  // namespace zt
