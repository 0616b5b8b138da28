#include "support/process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace zt::testing {

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& extra_env,
                          std::chrono::seconds timeout, const std::string& cwd, int inherit_fd,
                          const std::function<void()>& on_started) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    setpgid(0, 0);
    dup2(pipe_fds[1], 1);
    dup2(pipe_fds[1], 2);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    if (inherit_fd >= 0) fcntl(inherit_fd, F_SETFD, 0);
    for (const auto& [key, value] : extra_env) setenv(key.c_str(), value.c_str(), 1);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(127);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  setpgid(pid, pid);
  close(pipe_fds[1]);
  if (on_started) on_started();
  ProcessResult result;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    std::array<char, 4096> buf;
    ssize_t n;
    while ((n = read(pipe_fds[0], buf.data(), buf.size())) > 0) result.output.append(buf.data(), n);
  });
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Children of the child may still hold the pipe open; kill the group so the reader ends.
  kill(-pid, SIGKILL);
  reader.join();
  close(pipe_fds[0]);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) result.exit_code = 128 + WTERMSIG(status);
  return result;
}

std::string self_executable() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

ListeningSocket listen_on_free_port() {
  ListeningSocket s;
  s.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s.fd < 0) throw std::runtime_error("socket failed");
  // As rank 0's own socket: connections it accepted and closed stay in TIME_WAIT, and only a
  // listener with SO_REUSEADDR lets a later store of the same rank bind the port again.
  int one = 1;
  setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(s.fd, 128) != 0 ||
      getsockname(s.fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(s.fd);
    throw std::runtime_error("cannot listen on a free port of 127.0.0.1");
  }
  s.port = ntohs(addr.sin_port);
  return s;
}

// ZT_TEST_BIN_DIR and ZT_TEST_BUILD_DIR move a test binary's build tree: binaries built on one
// machine and run on another (scripts/gpu-check.sh) find the CLI and a writable scratch folder.
static std::string from_env_or(const char* name, const char* built_in) {
  const char* value = std::getenv(name);
  return value && *value ? value : built_in;
}

std::string cli_path() { return from_env_or("ZT_TEST_BIN_DIR", ZT_BIN_DIR) + "/zerotrain"; }

std::string make_temp_dir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  auto dir = std::filesystem::path(from_env_or("ZT_TEST_BUILD_DIR", ZT_BUILD_DIR)) / "tmp" /
             (prefix + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

}  // namespace zt::testing
