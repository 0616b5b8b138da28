// How the local launcher watches and stops its ranks (launch_parts.h): its own messages, the
// signals it forwards, the process groups it signals and waits for, and what it reports of a
// failed rank.
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

std::atomic<int> g_last_signal{0};
std::atomic<int> g_signal_count{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

extern "C" void on_launcher_signal(int signo) {
  g_last_signal.store(signo);
  g_signal_count.fetch_add(1);
}

void signal_groups(const std::vector<Rank>& ranks, int signo) {
  for (const Rank& r : ranks)
    if (r.pid > 0) ::kill(-r.pid, signo);
}

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

namespace {

// One line of the launcher's output: a label with a newline must not split it.
std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return text;
}

}  // namespace

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

}  // namespace zt::launch_detail
