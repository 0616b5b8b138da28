// How the local launcher starts a rank (launch_parts.h): the program found in PATH before any fork,
// the rank's environment and rendezvous socket, and what the forked child does up to exec.
#include "launch/launch_parts.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "launch/job_control.h"
#include "zerotrain/error.h"
#include "comm/flight_recorder.h"

extern char** environ;

namespace zt::launch_detail {

namespace {

int usable_cores() {
  // The affinity mask, not the machine's core count: taskset/cpusets limit what we may use.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

bool is_executable_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

void close_inherited_fds(int first) {
  // Descriptors the launcher's process opened without O_CLOEXEC must not leak into ranks (a
  // leaked pipe end can keep a reader waiting forever). Async-signal-safe: a raw syscall.
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, unsigned(first), ~0u, 0u) == 0) return;
#endif
  long max_fd = ::sysconf(_SC_OPEN_MAX);
  for (long fd = first; fd < (max_fd > 0 ? max_fd : 1024); ++fd) ::close(static_cast<int>(fd));
}

}  // namespace

ListeningSocket open_rendezvous_socket(const std::string& address) {
  // SO_REUSEADDR (set by listen_on_address): connections rank 0 accepted and closed stay in
  // TIME_WAIT, and only such a listener lets a second communicator of rank 0 bind the port again.
  ListeningSocket s;
  s.fd = listen_on_address(address, 0, &s.port);
  return s;
}

// PATH lookup done once in the parent (like execvp, but before forking) so that a missing
// program is reported once, clearly, with the shell's exit codes, instead of N times in N logs.
Resolved resolve_program(const std::string& program) {
  Resolved r;
  if (program.find('/') != std::string::npos) {
    if (is_executable_file(program)) {
      r.path = program;
    } else if (::access(program.c_str(), F_OK) != 0) {
      r.error_code = 127;
      r.message = "cannot run '" + program + "': no such file";
    } else {
      r.error_code = 126;
      r.message = "cannot run '" + program + "': not an executable file";
    }
    return r;
  }
  const char* path_env = std::getenv("PATH");
  std::string search = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  bool found_non_executable = false;
  std::istringstream entries(search + ":");  // the extra ':' makes a trailing empty entry count
  std::string dir;
  while (std::getline(entries, dir, ':')) {
    // An empty PATH entry means the current directory.
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (is_executable_file(candidate)) {
      r.path = candidate;
      return r;
    }
    if (::access(candidate.c_str(), F_OK) == 0) found_non_executable = true;
  }
  r.error_code = found_non_executable ? 126 : 127;
  r.message = "cannot run '" + program + "': " +
              (found_non_executable ? "found in PATH but not executable" : "not found in PATH");
  return r;
}

// The environment of rank `rank`: ours, with the rendezvous variables torchrun sets replaced.
// `listen_fd`: the rendezvous socket's number in rank 0 (-1: none, or another rank).
std::vector<std::string> rank_environment(const LaunchOptions& options, int local_rank, int port,
                                          const std::string& flight_file, int listen_fd) {
  const int nproc = options.nproc;
  const std::string rank = std::to_string(options.node_rank * nproc + local_rank),
                    world = std::to_string(options.nnodes * nproc);
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", rank},
      {"WORLD_SIZE", world},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(options.nnodes)},
      {"ROLE_RANK", rank},
      {"ROLE_WORLD_SIZE", world},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"ZT_LAUNCHED", "1"},
      {kFlightRecorderFileVariable, flight_file},
  };
  // N ranks on few cores (docs/design.md "Platform facts"). Busy-waiting OpenMP workers steal the
  // cores the other ranks need, and one OpenMP thread per core per rank oversubscribes; the user's
  // own settings win.
  if (!std::getenv("OMP_WAIT_POLICY")) set.emplace_back("OMP_WAIT_POLICY", "PASSIVE");
  if (!std::getenv("OMP_NUM_THREADS"))
    set.emplace_back("OMP_NUM_THREADS", std::to_string(std::max(1, usable_cores() / nproc)));

  if (listen_fd >= 0) set.emplace_back("ZT_RENDEZVOUS_LISTEN_FD", std::to_string(listen_fd));

  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string_view entry(*e);
    std::string_view key = entry.substr(0, entry.find('='));
    // A socket number inherited from an outer launcher means nothing in our ranks.
    if (key == "ZT_RENDEZVOUS_LISTEN_FD") continue;
    bool replaced = std::any_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == key; });
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [key, value] : set) env.push_back(key + "=" + value);
  return env;
}

// Runs in the forked child; never returns.
// `listen_fd` (-1: none) is passed on as kRendezvousFdInRank.
[[noreturn]] void exec_rank(int out_fd, int null_fd, int listen_fd, pid_t launcher_pid, const char* path,
                            char* const* argv, char* const* envp, const char* exec_error_prefix) {
  // Own process group: the terminal's Ctrl-C reaches only the launcher (which forwards it
  // exactly once), and killing the group also kills whatever the rank started.
  ::setpgid(0, 0);
  // Die with the launcher even when it is SIGKILLed and cannot forward anything. The death
  // signal fires when the forking *thread* exits; launch_local blocks that thread until the
  // ranks are gone, so that is the launcher's lifetime. Re-check the parent to close the race
  // with a launcher that died before prctl().
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher_pid) ::_exit(128 + SIGKILL);

  // Undo what the launcher process may have changed: exec keeps ignored signals ignored and
  // the blocked mask blocked, and a rank that ignores SIGTERM could not be stopped gently.
  sigset_t all;
  sigemptyset(&all);
  ::sigprocmask(SIG_SETMASK, &all, nullptr);
  for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGCHLD}) ::signal(signo, SIG_DFL);

  // stdin from /dev/null: a rank in a background process group that reads the terminal would
  // be stopped by SIGTTIN and hang the job.
  ::dup2(null_fd, STDIN_FILENO);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(out_fd, STDERR_FILENO);
  if (listen_fd >= 0) {
    // dup2 leaves the copy without FD_CLOEXEC, so it survives execve; a socket already at that
    // number keeps its flag and needs it cleared.
    if (listen_fd == kRendezvousFdInRank) ::fcntl(listen_fd, F_SETFD, 0);
    else ::dup2(listen_fd, kRendezvousFdInRank);
  }
  close_inherited_fds(listen_fd >= 0 ? kRendezvousFdInRank + 1 : 3);

  ::execve(path, argv, envp);
  int err = errno;
  const char* reason = ::strerror(err);
  write_all(STDERR_FILENO, exec_error_prefix, std::strlen(exec_error_prefix));
  write_all(STDERR_FILENO, reason, std::strlen(reason));
  write_all(STDERR_FILENO, "\n", 1);
  ::_exit(err == ENOENT ? 127 : 126);  // the shell's codes: not found / cannot execute
}

}  // namespace zt::launch_detail
