// Swap directories (swap_directory.h). Liveness is a flock, not a pid: a killed process loses
// its locks at once, pids are reused and differ between containers sharing one disk.
#include "io/swap_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "zerotrain/error.h"

namespace zt::io {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLockName = "lock";
std::atomic<int> g_counter{0};

std::string errno_text(int error) { return fmt::format("{} (errno {})", std::strerror(error), error); }

void say(const std::function<void(const std::string&)>& log, const std::string& line) {
  if (log) {
    log(line);
  } else {
    std::cerr << "zerotrain: note: " << line << std::endl;
  }
}

bool digits(const std::string& s, size_t from, size_t to) {
  if (from >= to) return false;
  for (size_t i = from; i < to; ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return true;
}

int64_t tree_bytes(const fs::path& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += int64_t(st.st_size);
  }
  return total;
}

// Removes a stale swap directory if its lock can be taken; see the header's contract.
void clear_if_stale(const fs::path& dir, const std::function<void(const std::string&)>& log) {
  const fs::path lock = dir / kLockName;
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    // No lock file: what a removal interrupted after deleting it leaves. rmdir only takes an
    // empty directory, so nothing with content is lost.
    if (errno == ENOENT) ::rmdir(dir.c_str());
    return;
  }
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_lock{fd};
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) return;  // its run is alive
  // Another process may have removed this directory (and a new run taken the name) between our
  // open and our flock: only the lock file still in the directory counts.
  struct stat locked {}, current {};
  if (::fstat(fd, &locked) != 0 || ::lstat(lock.c_str(), &current) != 0 || locked.st_dev != current.st_dev ||
      locked.st_ino != current.st_ino)
    return;
  const int64_t bytes = tree_bytes(dir);
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (ec) {
    say(log, fmt::format("could not remove swap files of a run that ended without cleaning up: {}: {}",
                         dir.string(), ec.message()));
    return;
  }
  say(log, fmt::format("removed swap files of a run that ended without cleaning up: {} ({})", dir.string(),
                       format_gib_mib(bytes)));
}

}  // namespace

bool is_swap_directory_name(const std::string& name) {
  if (name.rfind("rank", 0) != 0) return false;
  const size_t pid = name.find("-pid", 4);
  if (pid == std::string::npos || !digits(name, 4, pid)) return false;
  const size_t suffix = name.find('-', pid + 4);
  if (suffix == std::string::npos) return digits(name, pid + 4, name.size());
  return digits(name, pid + 4, suffix) && digits(name, suffix + 1, name.size());
}

std::string format_gib_mib(int64_t bytes) {
  if (bytes >= (int64_t(1) << 30)) return fmt::format("{:.1f} GiB", double(bytes) / double(int64_t(1) << 30));
  return fmt::format("{:.1f} MiB", double(bytes) / double(1 << 20));
}

void preflight_swap_path(const fs::path& root, int64_t required_bytes, const std::string& key,
                         const std::string& purpose) {
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT)
      throw zt::ConfigError(fmt::format("{}: '{}' does not exist (expected an existing directory for the swap files)",
                                        key, root.string()));
    throw zt::ConfigError(fmt::format("{}: cannot access '{}': {} (expected a directory for the swap files)", key,
                                      root.string(), errno_text(error)));
  }
  if (!S_ISDIR(st.st_mode))
    throw zt::ConfigError(fmt::format("{}: '{}' is not a directory (expected a directory for the swap files, found {})",
                                      key, root.string(), S_ISREG(st.st_mode) ? "a regular file" : "another kind of file"));
  const fs::path probe = root / fmt::format(".zerotrain-preflight-{}-{}", ::getpid(), g_counter++);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    throw zt::ConfigError(fmt::format("{}: cannot create a file in '{}': {} (expected a writable directory)", key,
                                      root.string(), errno_text(error)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(root.c_str(), &vfs) != 0) {
    const int error = errno;
    throw zt::ConfigError(fmt::format("{}: cannot find the free space of '{}': {}", key, root.string(), errno_text(error)));
  }
  int64_t free_bytes = int64_t(vfs.f_bavail) * int64_t(vfs.f_frsize);
  if (const char* given = std::getenv("ZT_SWAP_FREE_BYTES"); given != nullptr && *given != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(given, &end, 10);
    if (end == nullptr || *end != '\0' || v < 0)
      throw zt::ConfigError(fmt::format("ZT_SWAP_FREE_BYTES: expected bytes (a non-negative integer), found '{}'", given));
    free_bytes = v;
  }
  if (free_bytes < required_bytes)
    throw zt::ConfigError(fmt::format("{}: '{}' has {} free, expected at least {} for {}", key, root.string(),
                                      format_gib_mib(free_bytes), format_gib_mib(required_bytes), purpose));
}

SwapDirectory::SwapDirectory(const fs::path& root, int rank, std::function<void(const std::string&)> log) {
  const fs::path base = root / "zerotrain-swap";
  std::error_code ec;
  for (fs::directory_iterator it(base, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code kind_ec;
    if (is_swap_directory_name(it->path().filename().string()) && it->is_directory(kind_ec) && !it->is_symlink(kind_ec))
      clear_if_stale(it->path(), log);
  }

  const int pid = int(::getpid());
  const fs::path hidden = base / fmt::format(".creating-rank{}-pid{}-{}", rank, pid, g_counter++);
  // A finishing run removes base when it is empty, possibly between our mkdir calls: then base
  // is made again. (std::filesystem::create_directories reports that race as an error.)
  for (int attempt = 0;; ++attempt) {
    if (::mkdir(base.c_str(), 0755) != 0 && errno != EEXIST) {
      const int error = errno;
      throw zt::Error(fmt::format("creating '{}': {}", base.string(), errno_text(error)));
    }
    if (::mkdir(hidden.c_str(), 0700) == 0) break;
    if (errno != ENOENT || attempt == 100) {
      const int error = errno;
      throw zt::Error(fmt::format("creating '{}': {}", hidden.string(), errno_text(error)));
    }
  }
  const fs::path hidden_lock = hidden / kLockName;
  lock_fd_ = ::open(hidden_lock.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (lock_fd_ >= 0) ::close(lock_fd_);
    fs::remove_all(hidden, ec);
    throw zt::Error(fmt::format("locking '{}': {}", hidden_lock.string(), errno_text(error)));
  }
  for (int suffix = 0;; ++suffix) {
    const fs::path name = base / (suffix == 0 ? fmt::format("rank{}-pid{}", rank, pid)
                                              : fmt::format("rank{}-pid{}-{}", rank, pid, suffix));
    // rename() refuses a non-empty target, and every live swap directory holds its lock file.
    if (::rename(hidden.c_str(), name.c_str()) == 0) {
      path_ = name;
      return;
    }
    const int error = errno;
    if ((error != EEXIST && error != ENOTEMPTY) || suffix == 1000) {
      ::close(lock_fd_);
      fs::remove_all(hidden, ec);
      throw zt::Error(fmt::format("creating '{}': {}", name.string(), errno_text(error)));
    }
  }
}

SwapDirectory::~SwapDirectory() {
  std::error_code ec;
  fs::remove_all(path_, ec);
  ::close(lock_fd_);
  ::rmdir(path_.parent_path().c_str());  // only when no other run uses the root
}

}  // namespace zt::io
