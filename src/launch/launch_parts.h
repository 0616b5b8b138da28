// Internal to src/launch: the parts of the local launcher (launcher.cpp) that start a rank
// (rank_start.cpp) and that watch and stop the ranks (supervision.cpp).
#pragma once
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "zerotrain/launch/launch.h"

namespace zt::launch_detail {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrefix = "zerotrain launch: ";
constexpr int kTailLines = 20;  // lines of a failed rank's log repeated on stderr

// ---------------------------------------------------------------------------------------------
// Small I/O helpers. Messages go straight to the file descriptors with write(2): the launcher
// shares stdout with rank 0's tee thread, and unbuffered writes keep lines whole and ordered.

void write_all(int fd, const char* data, size_t size);
void say(const std::string& line);
std::string signal_name(int signo);
// Last `count` lines of a file (reads at most the last 64 KiB).
std::vector<std::string> tail_lines(const std::string& path, int count);
// The last line of a rank's log that a zerotrain program prints for an error it stops on
// ("zerotrain: error: ..."), or "" when there is none (a crash, another program).
std::string last_error_line(const std::string& path);

// ---------------------------------------------------------------------------------------------
// Options and environment.

// The rendezvous socket, listening on a port the kernel picks, opened here and handed to rank 0
// (ZT_RENDEZVOUS_LISTEN_FD): a port only picked and released could be taken by another process
// (an outgoing connection's ephemeral port, another job's listener) before rank 0 binds it, and
// the other ranks would then reach someone else's socket.
struct ListeningSocket {
  int fd = -1;
  int port = -1;
};

ListeningSocket open_rendezvous_socket(const std::string& address);

struct Resolved {
  std::string path;      // what to execve(); empty when not found
  int error_code = 0;    // 127 not found, 126 found but not executable
  std::string message;
};

// PATH lookup done once in the parent (like execvp, but before forking) so that a missing
// program is reported once, clearly, with the shell's exit codes, instead of N times in N logs.
Resolved resolve_program(const std::string& program);

// The environment of rank `rank`: ours, with the rendezvous variables torchrun sets replaced.
// `listen_fd`: the rendezvous socket's number in rank 0 (-1: none, or another rank).
std::vector<std::string> rank_environment(const LaunchOptions& options, int local_rank, int port,
                                          const std::string& flight_file, int listen_fd);

// ---------------------------------------------------------------------------------------------
// Signals received by the launcher. The handler only records the signal; the polling loop
// forwards it. A counter (not a flag) lets a second Ctrl-C escalate to SIGKILL at once.

extern std::atomic<int> g_last_signal;
extern std::atomic<int> g_signal_count;
extern "C" void on_launcher_signal(int signo);

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
void signal_groups(const std::vector<Rank>& ranks, int signo);

// True while a rank's process group still has a member that is not a zombie. kill(-pgid, 0)
// alone is not enough: an orphaned grandchild that was killed stays a zombie group member until
// its new parent reaps it, and some container init processes never do. So read the group and
// state of each process from /proc; fall back to kill() where /proc cannot be read.
bool any_group_alive(const std::vector<Rank>& ranks);

// The number rank 0 finds the rendezvous socket under: the first after stdin, stdout, stderr.
constexpr int kRendezvousFdInRank = 3;

// Runs in the forked child; never returns.
// `listen_fd` (-1: none) is passed on as kRendezvousFdInRank.
[[noreturn]] void exec_rank(int out_fd, int null_fd, int listen_fd, pid_t launcher_pid, const char* path,
                            char* const* argv, char* const* envp, const char* exec_error_prefix);

// After a failed job: which rank left the common sequence of collectives, from the rings the
// ranks' communicators kept in their files (absent for programs that never communicated).
void report_divergence(const std::vector<Rank>& ranks, const fs::path& log_dir);

// A wait status in words ("exited with code 3"); `code` gets the exit code, 128 + signo for a
// death by signal.
std::string describe_status(int status, int* code);

}  // namespace zt::launch_detail
