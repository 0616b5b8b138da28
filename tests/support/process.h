// Test helpers for running child processes (the CLI, or the test binary itself as a rank).
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace zt::testing {

struct ProcessResult {
  int exit_code = -1;       // exit status, or 128 + signal when killed by a signal
  bool timed_out = false;   // killed because it ran past the timeout
  std::string output;       // stdout and stderr together
};

// Runs argv[0] (a path) with argv, the current environment plus `extra_env`, in `cwd` when not
// empty. Kills the whole process group after `timeout`. `inherit_fd` (when >= 0) stays open in
// the child under its number; every other descriptor opened with O_CLOEXEC does not.
// `on_started` runs in the caller once the child exists (e.g. to close the caller's copy of
// inherit_fd).
ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& extra_env = {},
                          std::chrono::seconds timeout = std::chrono::seconds(120),
                          const std::string& cwd = "", int inherit_fd = -1,
                          const std::function<void()>& on_started = {});

// Path of the running executable (/proc/self/exe).
std::string self_executable();

// A TCP port free on 127.0.0.1 at the time of the call.
int free_port();

// A socket listening on a free port of 127.0.0.1 (O_CLOEXEC), held until closed: for a rank 0
// started by run_process (inherit_fd, ZT_RENDEZVOUS_LISTEN_FD), so no other process can take the
// port in between.
struct ListeningSocket {
  int fd = -1;
  int port = -1;
};
ListeningSocket listen_on_free_port();

// The CLI binary built beside the tests.
std::string cli_path();

// A fresh empty directory under the build tree's tmp folder.
std::string make_temp_dir(const std::string& prefix);

}  // namespace zt::testing
