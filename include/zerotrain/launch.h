// Local launcher: starts N ranks of a program on this machine with the variables torchrun sets.
//
// Contract: launch_local() blocks until every rank has exited. Each rank's stdout+stderr goes
// to <log_dir>/rank<i>.log; rank 0's is also copied to this process's stdout. When any rank
// exits non-zero (or dies by a signal), the others receive SIGTERM at once and SIGKILL after
// `kill_grace`; the return value is the worst exit code (a signal counts as 128 + signo).
// SIGINT/SIGTERM received by the launcher are forwarded to every rank. No rank outlives it.
// Not thread-safe: one launch per process at a time (it installs signal handlers).
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace zt {

struct LaunchOptions {
  int nproc = 1;
  int master_port = 0;  // 0: pick a free port on 127.0.0.1
  std::string log_dir = "runs/logs";
  std::vector<std::string> command;  // program and its arguments; the program is searched in PATH
  std::chrono::milliseconds kill_grace{3000};
  bool echo_rank0 = true;
};

// Returns the worst exit code of the ranks (0 when all succeeded).
int launch_local(const LaunchOptions& options);

// True when this process was started by an external launcher (torchrun, srun, mpirun, or our
// own launch_local), i.e. the rank variables are already in the environment.
bool started_by_launcher();

}  // namespace zt
