// Local launcher: it never swallows exit codes or logs, and it sets OpenMP up for few cores
// (docs/design.md "Lessons from their users", "Platform facts").
//
// Shape of a launch:
//   1. Validate the options and resolve the program in PATH *before* anything starts, so bad
//      input gives one clear message and no half-started job.
//   2. Open every rank's log file, then fork+exec each rank in its own process group, with
//      stdin from /dev/null and stdout+stderr to its log (rank 0: to a pipe that a thread tees
//      to its log and to our stdout).
//   3. Poll the ranks. The first failure (non-zero exit or death by signal) or a forwarded
//      SIGINT/SIGTERM/SIGHUP starts the stop: SIGTERM to every rank's process group, SIGKILL to
//      whatever is left after kill_grace.
//   4. When every rank has been reaped, clean up what ranks left behind in their groups (a
//      background child of a rank that exited 0 must not outlive the launch either).
//
// Everything between fork() and exec() in the child uses only async-signal-safe calls on data
// prepared beforehand: the launcher may live in a multi-threaded process (tests, the CLI).
#include "zerotrain/launch.h"

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

#include "comm/flight_recorder.h"
#include "launch/job_control.h"
#include "zerotrain/error.h"

extern char** environ;

namespace zt {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrefix = "zerotrain launch: ";
constexpr int kTailLines = 20;  // lines of a failed rank's log repeated on stderr

// ---------------------------------------------------------------------------------------------
// Small I/O helpers. Messages go straight to the file descriptors with write(2): the launcher
// shares stdout with rank 0's tee thread, and unbuffered writes keep lines whole and ordered.

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // nothing sensible to do about a closed stdout/stderr
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void say(const std::string& line) {
  std::string text = kPrefix + line + "\n";
  write_all(STDERR_FILENO, text.data(), text.size());
}

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);  // "TERM"; glibc >= 2.32
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signo);
}

// Last `count` lines of a file (reads at most the last 64 KiB).
std::vector<std::string> tail_lines(const std::string& path, int count) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  std::streamoff start = std::max<std::streamoff>(0, size - 65536);
  in.seekg(start);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::deque<std::string> lines;
  std::istringstream stream(text);
  std::string line;
  bool first = start > 0;  // the first line of a partial read is cut; drop it
  while (std::getline(stream, line)) {
    if (first) { first = false; continue; }
    lines.push_back(line);
    if (static_cast<int>(lines.size()) > count) lines.pop_front();
  }
  return {lines.begin(), lines.end()};
}

// The last line of a rank's log that a zerotrain program prints for an error it stops on
// ("zerotrain: error: ..."), or "" when there is none (a crash, another program).
std::string last_error_line(const std::string& path) {
  static const std::string kError = "zerotrain: error: ";
  const auto lines = tail_lines(path, 200);
  for (auto it = lines.rbegin(); it != lines.rend(); ++it)
    if (it->rfind(kError, 0) == 0) return *it;
  return "";
}

// ---------------------------------------------------------------------------------------------
// Options and environment.

int usable_cores() {
  // The affinity mask, not the machine's core count: taskset/cpusets limit what we may use.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// The rendezvous socket, listening on a port the kernel picks, opened here and handed to rank 0
// (ZT_RENDEZVOUS_LISTEN_FD): a port only picked and released could be taken by another process
// (an outgoing connection's ephemeral port, another job's listener) before rank 0 binds it, and
// the other ranks would then reach someone else's socket.
struct ListeningSocket {
  int fd = -1;
  int port = -1;
};

ListeningSocket open_rendezvous_socket(const std::string& address) {
  // SO_REUSEADDR (set by listen_on_address): connections rank 0 accepted and closed stay in
  // TIME_WAIT, and only such a listener lets a second communicator of rank 0 bind the port again.
  ListeningSocket s;
  s.fd = listen_on_address(address, 0, &s.port);
  return s;
}

struct Resolved {
  std::string path;      // what to execve(); empty when not found
  int error_code = 0;    // 127 not found, 126 found but not executable
  std::string message;
};

bool is_executable_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
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

// ---------------------------------------------------------------------------------------------
// Signals received by the launcher. The handler only records the signal; the polling loop
// forwards it. A counter (not a flag) lets a second Ctrl-C escalate to SIGKILL at once.

std::atomic<int> g_last_signal{0};
std::atomic<int> g_signal_count{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

extern "C" void on_launcher_signal(int signo) {
  g_last_signal.store(signo);
  g_signal_count.fetch_add(1);
}

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Installs the forwarding handlers for the lifetime of one launch and restores the old ones.
class SignalScope {
 public:
  SignalScope() {
    g_last_signal = 0;
    g_signal_count = 0;
    struct sigaction sa{};
    sa.sa_handler = on_launcher_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i)
      ::sigaction(kForwardedSignals[i], &sa, &old_[i]);
  }
  ~SignalScope() {
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i)
      ::sigaction(kForwardedSignals[i], &old_[i], nullptr);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction old_[std::size(kForwardedSignals)];
};

// ---------------------------------------------------------------------------------------------
// Rank 0's output: a thread copies the pipe to the log file and to our stdout.

class Tee {
 public:
  Tee(int pipe_read_fd, int log_fd) : pipe_fd_(pipe_read_fd), log_fd_(log_fd) {
    thread_ = std::thread([this] { run(); });
  }
  // Stops once the pipe reaches end of file, or - if something that escaped the rank's process
  // group still holds the write end - once the pipe has been quiet for a moment after stop().
  void stop_and_join() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  ~Tee() { stop_and_join(); }

 private:
  void run() {
    // SIGPIPE from writing to a closed stdout (`zerotrain launch ... | head`) must not kill the
    // launcher; blocked in this thread, the write fails with EPIPE and we stop echoing.
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, nullptr);
    bool echo = true;
    char buffer[16384];
    while (true) {
      pollfd p{pipe_fd_, POLLIN, 0};
      int ready = ::poll(&p, 1, 100);
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        if (stopping_) break;
        continue;
      }
      ssize_t n = ::read(pipe_fd_, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // end of file: every writer is gone
      write_all(log_fd_, buffer, static_cast<size_t>(n));
      if (echo) {
        const char* data = buffer;
        size_t left = static_cast<size_t>(n);
        while (left > 0) {
          ssize_t w = ::write(STDOUT_FILENO, data, left);
          if (w < 0 && errno == EINTR) continue;
          if (w < 0) { echo = false; break; }
          data += w;
          left -= static_cast<size_t>(w);
        }
      }
    }
  }

  int pipe_fd_;
  int log_fd_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------

struct Rank {
  int index = 0;           // on this node (LOCAL_RANK)
  std::string label;       // "rank 3", or "rank 3 (node 1)" in a job of several nodes
  pid_t pid = -1;          // also its process group id (setpgid(0, 0) in the child)
  bool running = false;
  int exit_code = 0;       // exit status, or 128 + signo
  std::string status_text; // "exited with code 3", "was killed by SIGKILL (signal 9)"
  std::string log_path;
  std::string flight_path; // its flight recorder ring (written by its communicator, if any)
  bool own_failure = false; // failed by itself, not by a signal the launcher sent
};

// File descriptors closed when the launch ends, whichever way it ends.
struct FdList {
  std::vector<int> fds;
  int add(int fd) { fds.push_back(fd); return fd; }
  ~FdList() { for (int fd : fds) if (fd >= 0) ::close(fd); }
};

// Signals every rank's process group (the rank and everything it started that stayed in its
// group). Groups of reaped ranks are included: their background children may still be there.
// A group id is only reused once the group is empty, and a reused id would need a new process
// that makes itself a group leader, so signalling an empty group's id is harmless in practice.
void signal_groups(const std::vector<Rank>& ranks, int signo) {
  for (const Rank& r : ranks)
    if (r.pid > 0) ::kill(-r.pid, signo);
}

// True while a rank's process group still has a member that is not a zombie. kill(-pgid, 0)
// alone is not enough: an orphaned grandchild that was killed stays a zombie group member until
// its new parent reaps it, and some container init processes never do. So read the group and
// state of each process from /proc; fall back to kill() where /proc cannot be read.
bool any_group_alive(const std::vector<Rank>& ranks) {
  DIR* proc = ::opendir("/proc");
  if (!proc) {
    for (const Rank& r : ranks)
      if (r.pid > 0 && (::kill(-r.pid, 0) == 0 || errno == EPERM)) return true;
    return false;
  }
  bool alive = false;
  while (dirent* entry = ::readdir(proc)) {
    if (entry->d_name[0] < '1' || entry->d_name[0] > '9') continue;
    std::ifstream stat(std::string("/proc/") + entry->d_name + "/stat");
    std::string text;
    if (!std::getline(stat, text)) continue;  // exited meanwhile
    // Format: "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
    size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(text.substr(close + 1));
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (!(fields >> state >> ppid >> pgrp)) continue;
    if (state == 'Z' || state == 'X') continue;
    if (std::any_of(ranks.begin(), ranks.end(), [&](const Rank& r) { return r.pid > 0 && r.pid == pgrp; })) {
      alive = true;
      break;
    }
  }
  ::closedir(proc);
  return alive;
}

// The number rank 0 finds the rendezvous socket under: the first after stdin, stdout, stderr.
constexpr int kRendezvousFdInRank = 3;

void close_inherited_fds(int first) {
  // Descriptors the launcher's process opened without O_CLOEXEC must not leak into ranks (a
  // leaked pipe end can keep a reader waiting forever). Async-signal-safe: a raw syscall.
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, unsigned(first), ~0u, 0u) == 0) return;
#endif
  long max_fd = ::sysconf(_SC_OPEN_MAX);
  for (long fd = first; fd < (max_fd > 0 ? max_fd : 1024); ++fd) ::close(static_cast<int>(fd));
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

// One line of the launcher's output: a label with a newline must not split it.
std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return text;
}

// After a failed job: which rank left the common sequence of collectives, from the rings the
// ranks' communicators kept in their files (absent for programs that never communicated).
void report_divergence(const std::vector<Rank>& ranks, const fs::path& log_dir) {
  std::vector<FlightRing> rings;
  for (const Rank& r : ranks) {
    if (r.pid <= 0) continue;
    try {
      if (auto ring = read_flight_ring(r.flight_path)) rings.push_back(std::move(*ring));
    } catch (const std::exception& e) {
      say(one_line(e.what()));
    }
  }
  if (rings.size() < 2) return;
  if (auto d = find_divergence(rings))
    say(one_line("collectives diverged: " + d->description + "; flight records: " +
                 (log_dir / "rank*.flight").string()));
}

std::string describe_status(int status, int* code) {
  if (WIFEXITED(status)) {
    *code = WEXITSTATUS(status);
    return "exited with code " + std::to_string(*code);
  }
  int signo = WTERMSIG(status);
  *code = 128 + signo;
  return "was killed by " + signal_name(signo) + " (signal " + std::to_string(signo) + ", code " +
         std::to_string(*code) + ")";
}

}  // namespace

int launch_local(const LaunchOptions& options) {
  // ---- 1. Validate before anything starts.
  if (options.nproc < 1)
    throw ConfigError("launch: --nproc must be at least 1, got " + std::to_string(options.nproc));
  if (options.command.empty() || options.command.front().empty())
    throw ConfigError("launch: no program given to run (expected: launch --nproc N -- PROGRAM ARGS...)");
  if (options.master_port < 0 || options.master_port > 65535)
    throw ConfigError("launch: --master-port must be in 0..65535 (0 picks a free port), got " +
                      std::to_string(options.master_port));
  if (options.kill_grace.count() < 0)
    throw ConfigError("launch: kill grace must not be negative, got " +
                      std::to_string(options.kill_grace.count()) + " ms");
  if (options.log_dir.empty()) throw ConfigError("launch: the log directory must not be empty");
  if (options.nnodes < 1) throw ConfigError("launch: --nnodes must be at least 1, got " + std::to_string(options.nnodes));
  if (options.node_rank < 0 || options.node_rank >= options.nnodes)
    throw ConfigError("launch: --node-rank must be in 0.." + std::to_string(options.nnodes - 1) + " (--nnodes " +
                      std::to_string(options.nnodes) + "), got " + std::to_string(options.node_rank));
  if (options.master_addr.empty()) throw ConfigError("launch: --master-addr must not be empty");
  if (options.nnodes > 1 && options.master_port == 0)
    throw ConfigError("launch: --master-port is required with --nnodes " + std::to_string(options.nnodes) +
                      ": every node's launcher must name the port where node 0's launcher serves the job");

  const Resolved program = resolve_program(options.command.front());
  if (program.path.empty()) {
    say(program.message);
    return program.error_code;
  }

  std::error_code ec;
  fs::create_directories(options.log_dir, ec);
  if (ec)
    throw ConfigError("launch: cannot create log directory '" + options.log_dir + "': " + ec.message());
  fs::path log_dir = fs::absolute(options.log_dir, ec).lexically_normal();
  if (ec) log_dir = options.log_dir;

  const int nproc = options.nproc;
  const bool several_nodes = options.nnodes > 1;
  const std::string node_name = "node " + std::to_string(options.node_rank);
  ListeningSocket rendezvous_socket;
  std::optional<JobControl> control;  // several nodes: the launchers' meeting point (launch/job_control.h)
  if (several_nodes) {
    say(node_name + " of " + std::to_string(options.nnodes) + ": meeting the other nodes' launchers at " +
        options.master_addr + ":" + std::to_string(options.master_port));
    control.emplace(JobControlOptions{.nnodes = options.nnodes,
                                      .node_rank = options.node_rank,
                                      .master_addr = options.master_addr,
                                      .master_port = options.master_port,
                                      .join_timeout = options.join_timeout,
                                      .heartbeat_timeout = options.heartbeat_timeout});
    rendezvous_socket.fd = control->take_rendezvous_socket();  // node 0 only
    rendezvous_socket.port = control->rendezvous_port();
  } else if (options.master_port == 0) {
    rendezvous_socket = open_rendezvous_socket(options.master_addr);
  }
  const int port = rendezvous_socket.port > 0 ? rendezvous_socket.port : options.master_port;
  const int first_rank = options.node_rank * nproc;

  // ---- 2. Prepare everything the children need, then start them.
  FdList fds;
  if (rendezvous_socket.fd >= 0) fds.add(rendezvous_socket.fd);
  int null_fd = fds.add(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (null_fd < 0) throw Error(std::string(kPrefix) + "cannot open /dev/null: " + std::strerror(errno));

  std::vector<Rank> ranks(nproc);
  std::vector<int> log_fds(nproc, -1);
  for (int i = 0; i < nproc; ++i) {
    ranks[i].index = i;
    const std::string global = std::to_string(first_rank + i);
    ranks[i].label = "rank " + global + (several_nodes ? " (" + node_name + ")" : "");
    ranks[i].log_path = (log_dir / ("rank" + global + ".log")).string();
    ranks[i].flight_path = (log_dir / ("rank" + global + ".flight")).string();
    // A ring left by an earlier job would be read as this one's by the analysis at the end.
    fs::remove(ranks[i].flight_path, ec);
    log_fds[i] = fds.add(::open(ranks[i].log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (log_fds[i] < 0)
      throw ConfigError("launch: cannot open log file '" + ranks[i].log_path + "': " + std::strerror(errno));
  }

  // Rank 0 writes into a pipe that the tee thread copies to its log and our stdout.
  int tee_read = -1, tee_write = -1;
  if (options.echo_rank0) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0)
      throw Error(std::string(kPrefix) + "cannot create a pipe: " + std::strerror(errno));
    tee_read = fds.add(p[0]);
    tee_write = p[1];  // closed by hand right after the fork, so EOF arrives when rank 0 ends
  }

  std::vector<std::string> args = options.command;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string exec_error_prefix = std::string(kPrefix) + "cannot execute '" + program.path + "': ";

  {
    const int last_rank = first_rank + nproc - 1;
    std::string range = nproc == 1 ? "rank" + std::to_string(first_rank) + ".log"
                                   : "rank{" + std::to_string(first_rank) + ".." + std::to_string(last_rank) + "}.log";
    say((several_nodes ? node_name + ": " : std::string()) + "starting " +
        (several_nodes ? "ranks " + std::to_string(first_rank) + ".." + std::to_string(last_rank) + " of " +
                             std::to_string(options.nnodes * nproc)
                       : std::to_string(nproc) + (nproc == 1 ? " rank" : " ranks")) +
        " of " + program.path + " (master " + options.master_addr + ":" + std::to_string(port) + "); logs: " +
        (log_dir / range).string());
  }

  SignalScope signal_scope;  // installed before the first fork: no signal is lost in between
  std::optional<Tee> tee;
  if (options.echo_rank0) tee.emplace(tee_read, log_fds[0]);

  const pid_t launcher_pid = ::getpid();
  bool fork_failed = false;
  int first_failure = -1;  // index of the first rank that failed (its log tail is shown)
  int stop_signal = 0;     // a signal the launcher received and forwarded
  std::vector<int> sent_signals;  // every signal the launcher sent to the ranks' groups
  bool stopping = false, escalated = false;
  Clock::time_point kill_deadline{};

  auto begin_stop = [&](int signo) {
    sent_signals.push_back(signo);
    signal_groups(ranks, signo);
    if (!stopping) {
      stopping = true;
      kill_deadline = Clock::now() + options.kill_grace;
    }
  };
  auto escalate = [&] {
    if (escalated) return;
    escalated = true;
    std::string still;
    for (const Rank& r : ranks)
      if (r.running) still += (still.empty() ? "" : ", ") + std::to_string(first_rank + r.index);
    say("sending SIGKILL to what is left" + (still.empty() ? std::string() : " (ranks " + still + ")") +
        " after the " + std::to_string(options.kill_grace.count()) + " ms grace");
    sent_signals.push_back(SIGKILL);
    signal_groups(ranks, SIGKILL);
  };

  for (int i = 0; i < nproc; ++i) {
    const int listen_fd = i == 0 ? rendezvous_socket.fd : -1;
    std::vector<std::string> env =
        rank_environment(options, i, port, ranks[i].flight_path, listen_fd >= 0 ? kRendezvousFdInRank : -1);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out_fd = (i == 0 && options.echo_rank0) ? tee_write : log_fds[i];

    pid_t pid = ::fork();
    if (pid == 0)
      exec_rank(out_fd, null_fd, listen_fd, launcher_pid, program.path.c_str(), argv.data(), envp.data(),
                exec_error_prefix.c_str());
    const int fork_errno = errno;
    if (i == 0 && tee_write >= 0) {
      // Only rank 0 holds the write end now, so the tee sees end of file when rank 0's group
      // is gone (or at once, if the fork failed).
      ::close(tee_write);
      tee_write = -1;
    }
    if (i == 0 && rendezvous_socket.fd >= 0) {
      // Rank 0 owns the rendezvous socket now: if it dies, the others' connections are refused
      // rather than queued on a copy nobody accepts from.
      std::replace(fds.fds.begin(), fds.fds.end(), rendezvous_socket.fd, -1);
      ::close(rendezvous_socket.fd);
      rendezvous_socket.fd = -1;
    }
    if (pid < 0) {
      // The job cannot run without every rank: stop the ones already started (unstarted ranks
      // keep pid -1 and are skipped everywhere).
      fork_failed = true;
      say("cannot start " + ranks[i].label + ": fork failed: " + std::strerror(fork_errno));
      if (control) control->report_failure({1, "cannot start " + ranks[i].label + ": fork failed"});
      begin_stop(SIGTERM);
      break;
    }
    // Also set the group from the parent: whichever of parent and child runs first, the group
    // exists before we might signal it.
    ::setpgid(pid, pid);
    ranks[i].pid = pid;
    ranks[i].running = true;
  }

  // ---- 3. Watch the ranks.
  int seen_signals = 0;
  auto handle_signals = [&] {
    int count = g_signal_count.load();
    if (count == seen_signals) return;
    seen_signals = count;
    int signo = g_last_signal.load();
    if (stop_signal == 0) {
      stop_signal = signo;
      say("received " + signal_name(signo) + "; forwarding it to every rank");
      if (control) control->report_failure({128 + signo, node_name + "'s launcher received " + signal_name(signo)});
      begin_stop(signo);
    } else {
      say("received " + signal_name(signo) + " again; killing every rank now");
      escalate();
    }
  };

  std::optional<JobFailure> remote_failure;  // another node's, which stopped this one
  while (true) {
    handle_signals();
    if (control) {
      // Beats this node's heartbeat; a failure elsewhere ends this node's part of the job.
      if (auto failure = control->poll(); failure && !stopping) {
        remote_failure = failure;
        say("the job failed elsewhere: " + failure->message + "; stopping the ranks of " + node_name);
        begin_stop(SIGTERM);
      }
    }
    bool any_running = false;
    // Reap first, then report: ranks that ended within one pass are reported cause first (below).
    std::vector<Rank*> exited;
    for (Rank& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      pid_t got = ::waitpid(r.pid, &status, WNOHANG);
      if (got == 0) {
        any_running = true;
        continue;
      }
      if (got < 0 && errno == EINTR) {
        any_running = true;
        continue;
      }
      r.running = false;
      if (got < 0) {  // ECHILD: someone else reaped it (SIGCHLD set to SIG_IGN by the host program)
        r.exit_code = 1;
        r.status_text = "ended but its exit status was lost (was SIGCHLD ignored?)";
      } else {
        r.status_text = describe_status(status, &r.exit_code);
      }
      exited.push_back(&r);
    }
    // A rank killed by a signal (other than SIGPIPE, which a rank gets for writing to a peer that
    // has died) is likelier the cause than one that failed by itself, and that likelier than
    // one that succeeded: of ranks found ended in the same pass, the likeliest cause is named
    // first, whatever their order.
    auto cause_rank = [](const Rank& r) {
      if (r.exit_code > 128 && r.exit_code != 128 + SIGPIPE) return 2;
      return r.exit_code != 0 ? 1 : 0;
    };
    std::stable_sort(exited.begin(), exited.end(),
                     [&](const Rank* a, const Rank* b) { return cause_rank(*a) > cause_rank(*b); });
    for (Rank* exited_rank : exited) {
      Rank& r = *exited_rank;
      // A rank failed by itself unless it ended by (or with the code of) a signal we sent it:
      // the 143 of a rank we stopped is not a failure of its own, a 7 or a SIGSEGV is.
      const bool by_our_signal =
          stopping && std::any_of(sent_signals.begin(), sent_signals.end(), [&](int s) { return r.exit_code == 128 + s; });
      r.own_failure = r.exit_code != 0 && !by_our_signal;
      // A SIGKILL nobody here sent is most often the kernel's out-of-memory killer's.
      if (r.own_failure && r.exit_code == 128 + SIGKILL)
        r.status_text += " (not sent by the launcher: the kernel's out-of-memory killer ends processes so" +
                         (options.memory_note.empty() ? std::string() : "; " + options.memory_note) + ")";
      if (r.own_failure && stopping) {
        say(r.label + " also failed: it " + r.status_text + "; log: " + r.log_path);
      }
      if (r.exit_code != 0 && !stopping) {
        // The first failure is the first thing to look at; everything after it may be a
        // consequence (a peer's collective failing) or our own stopping.
        first_failure = r.index;
        std::string message = r.label + " " + r.status_text + "; log: " + r.log_path + "; stopping the other ranks" +
                              (several_nodes ? " on every node" : "");
        if (control) control->report_failure({r.exit_code, r.label + " " + r.status_text});
        if (r.index != 0 || !options.echo_rank0) {
          // Rank 0's output is already on our stdout; for the others, show the end of the log.
          auto lines = tail_lines(r.log_path, kTailLines);
          if (!lines.empty()) {
            message += "\n  last lines of " + r.label + "'s log:";
            for (const auto& line : lines) message += "\n  | " + line;
          }
        }
        say(message);
        begin_stop(SIGTERM);
      }
    }
    if (!any_running) break;
    if (stopping && !escalated && Clock::now() >= kill_deadline) escalate();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // ---- 4. Every rank is reaped; end what they left in their process groups.
  if (any_group_alive(ranks)) {
    if (!stopping) {
      say("every rank has exited, but processes they started are still running; stopping them");
      begin_stop(SIGTERM);
    }
    while (any_group_alive(ranks) && !escalated && Clock::now() < kill_deadline) {
      handle_signals();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (any_group_alive(ranks)) {
      if (!escalated) {
        escalated = true;
        say("sending SIGKILL to processes the ranks left behind");
        signal_groups(ranks, SIGKILL);
      }
      // SIGKILL is delivered asynchronously; give the kernel a moment so that nothing is still
      // running when we return.
      auto until = Clock::now() + std::chrono::seconds(1);
      while (any_group_alive(ranks) && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (tee) tee->stop_and_join();

  // ---- Exit code: the worst of the ranks' own failures (the largest
  // code, 128 + signo for a death by signal), not the 143 of the ranks we stopped; a signal
  // sent to the launcher counts as 128 + signo (even if the ranks shut down cleanly on it: the
  // job did not finish); else 0.
  int result = 0;
  int worst_rank = -1;
  int own_failures = 0;
  for (const Rank& r : ranks) {
    if (!r.own_failure) continue;
    ++own_failures;
    if (r.exit_code > result) {
      result = r.exit_code;
      worst_rank = r.index;
    }
  }
  if (stop_signal != 0) result = std::max(result, 128 + stop_signal);
  if (fork_failed) result = std::max(result, 1);
  if (control) {
    // Node 0 serves the other launchers until they have finished too; a failure that came
    // meanwhile (or stopped this node) is the job's, and so this launcher's exit code.
    if (auto late = control->finish(result); late && !remote_failure) {
      remote_failure = late;
      say("the job failed elsewhere: " + late->message);
    }
    if (remote_failure && result == 0) result = std::max(1, remote_failure->code);
  }
  if (result != 0) report_divergence(ranks, log_dir);
  if (worst_rank >= 0 && first_failure >= 0 && result == ranks[worst_rank].exit_code &&
      result != ranks[first_failure].exit_code)
    say("exit code " + std::to_string(result) + ", the worst of the failures: " + ranks[worst_rank].label + " " +
        ranks[worst_rank].status_text);
  if (result != 0 && own_failures == 0 && stop_signal != 0)
    say("stopped by " + signal_name(stop_signal) + "; exit code " + std::to_string(result));
  // The first failed rank's own one-line error (a zerotrain program's "zerotrain: error: ..."),
  // repeated as the launcher's last line: what a user reads first, after the launcher's account
  // of which rank ended how.
  if (result != 0 && first_failure >= 0) {
    const Rank& r = ranks[first_failure];
    const std::string error = last_error_line(r.log_path);
    if (!error.empty()) {
      const std::string text = error + " (" + r.label + ")\n";
      write_all(STDERR_FILENO, text.data(), text.size());
    }
  }
  return result;
}

bool started_by_launcher() {
  auto set = [](const char* name) {
    const char* value = std::getenv(name);
    return value && *value;
  };
  return (set("RANK") && set("WORLD_SIZE")) || (set("SLURM_PROCID") && set("SLURM_NTASKS")) ||
         (set("OMPI_COMM_WORLD_RANK") && set("OMPI_COMM_WORLD_SIZE"));
}

}  // namespace zt
