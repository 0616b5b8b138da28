// Launcher: starts nproc ranks of a program on this machine with the variables torchrun sets
// (RANK = node_rank × nproc + LOCAL_RANK, WORLD_SIZE = nnodes × nproc, LOCAL_RANK,
// LOCAL_WORLD_SIZE = nproc, GROUP_RANK = node_rank, GROUP_WORLD_SIZE = nnodes, ROLE_RANK,
// ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), plus ZT_LAUNCHED=1, and OMP_WAIT_POLICY=PASSIVE and
// OMP_NUM_THREADS=max(1, cores / nproc) unless the user set them (docs/design.md "Platform facts").
//
// Several nodes (nnodes > 1; docs/comm.md "Several nodes"): one launcher per node, each given the same nnodes,
// master_addr and master_port and its own node_rank. Node 0's launcher serves the job's control
// store at master_addr:master_port (bound to that address only) and opens the ranks' rendezvous
// on master_addr at a free port, which every node's ranks get as MASTER_PORT. The launchers wait
// for each other (join_timeout), beat heartbeats while the ranks run, and share the first
// failure: a rank failing on any node, a launcher stopped by a signal, or a node whose heartbeat
// stopped for heartbeat_timeout (its launcher killed) ends the job on every node, each launcher
// naming the failed rank and node, and exiting non-zero. Rank logs are named by global rank.
//
// Contract: launch_local() blocks until every rank has exited. Each rank's stdout+stderr goes
// to <log_dir>/rank<i>.log (truncated at start); rank 0's is also copied to this process's
// stdout. Launcher messages (where the logs are, which rank failed, the end of its log) go to
// stderr. When any rank exits non-zero (or dies by a signal), the others receive SIGTERM at
// once and SIGKILL after `kill_grace`. SIGINT/SIGTERM/SIGHUP received by the launcher are
// forwarded to every rank the same way; a second one sends SIGKILL at once. No rank outlives
// it: each rank runs in its own process group, and the whole group (so also what the rank
// started) is signalled, including background processes left by ranks that exited 0. Ranks
// also get SIGKILL if the launcher itself is killed hard (PR_SET_PDEATHSIG; this reaches the
// ranks, not processes they started).
//
// Exit code, the worst of the ranks' own failures:
//   - the largest exit code among the ranks that failed by themselves (128 + signo for a death
//     by a signal), not the 143 of the ranks the launcher stopped because of them: rank 0
//     exiting 3 and rank 1 exiting 7 (or dying by SIGKILL, 137) make the launch return 7 (137).
//     A rank counts as stopped by the launcher when it ended by, or with 128 + the number of, a
//     signal the launcher had sent it;
//   - at least 128 + signo when the launcher was stopped by a signal (even if the ranks then
//     exited cleanly: the job did not finish);
//   - else 0. 127 (not found) or 126 (not executable) when the program cannot be run; then
//     nothing is started.
//
// Flight recorder (src/comm/flight_recorder.h): each rank gets
// ZT_FLIGHT_RECORDER_FILE=<log_dir>/rank<i>.flight (a stale one is removed first). After a
// failed job the launcher reads the rings and, when ranks issued different collectives, prints
// one line "collectives diverged: rank R ..." naming the rank, the sequence number and label.
// Bad options (nproc < 1, no command, port out of range, log directory not creatable) throw
// zt::ConfigError before anything starts.
//
// Not thread-safe: one launch per process at a time (it installs signal handlers, restored on
// return). Call it from the thread that will live for the whole launch (the death signal of
// the ranks is tied to the thread that forked them).
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace zt {

struct LaunchOptions {
  int nproc = 1;        // ranks on this node
  int nnodes = 1;       // nodes in the job, each with its own launcher
  int node_rank = 0;    // this node, 0..nnodes-1
  std::string master_addr = "127.0.0.1";  // node 0's address; every socket the launch opens binds to it only
  int master_port = 0;  // 0: pick a free port on master_addr (one node only; required with several)
  std::chrono::milliseconds join_timeout{300000};      // several nodes: for every launcher to join
  std::chrono::milliseconds heartbeat_timeout{10000};  // several nodes: a silent node has failed
  std::string log_dir = "runs/logs";
  std::vector<std::string> command;  // program and its arguments; the program is searched in PATH
  std::chrono::milliseconds kill_grace{3000};  // between SIGTERM and SIGKILL when stopping
  bool echo_rank0 = true;                      // copy rank 0's output to stdout as well
  // Said beside a rank that died of a SIGKILL the launcher did not send (the signal of the
  // kernel's out-of-memory killer): what the run was estimated to need, if known.
  std::string memory_note;
};

// Returns the job's exit code as described above (0 when every rank succeeded).
int launch_local(const LaunchOptions& options);

// True when this process was started by an external launcher (torchrun, srun, mpirun, or our
// own launch_local), i.e. the rank variables are already in the environment.
bool started_by_launcher();

}  // namespace zt
