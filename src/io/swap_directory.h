// Where the NVMe tiers keep their swap files (ZeRO-Infinity): one directory per rank
// and process under the user's nvme_path, removed when the run ends, and cleared by the next run
// when a run was killed before it could remove its own.
//
// Contract
// - preflight_swap_path() runs before training and throws zt::ConfigError (one line naming
//   `key`, the path, what was expected and what was found) when the path is missing, not a
//   directory, not writable (a file is created and removed to find out), or has less free space
//   (statvfs: f_bavail × f_frsize) than required_bytes.
// - SwapDirectory creates root/zerotrain-swap/rank<R>-pid<PID>/ (with a suffix -<n> when that
//   name is taken, e.g. by a second directory of the same process) and holds an exclusive flock on
//   its file "lock" for as long as the object lives. The directory appears under that name only
//   once the lock is held (it is prepared under a hidden name and renamed).
// - Before that it clears stale siblings: a directory under root/zerotrain-swap/ whose name
//   matches rank<digits>-pid<digits>[-<digits>] and whose lock can be taken belongs to a run that
//   ended without cleaning up (a killed process releases its flock); it is removed while holding
//   that lock and reported once through `log`. Directories whose lock is held, names that do not
//   match, and anything that is not a directory are never touched. Several processes (the ranks
//   of a job, parallel tests) may do all of this at once under one root.
// - The destructor removes the directory and everything in it, then releases the lock; it never
//   throws.
// - `log` receives one-line notices; unset: stderr with the prefix "zerotrain: note: ".
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace zt::io {

// `purpose` names what the space is for in the message ("the swap files"). ZT_SWAP_FREE_BYTES
// (bytes), when set, replaces the file system's free space (for tests).
void preflight_swap_path(const std::filesystem::path& root, int64_t required_bytes, const std::string& key,
                         const std::string& purpose = "the swap files");

class SwapDirectory {
 public:
  // Throws zt::Error when the directory cannot be created (naming the path and strerror).
  SwapDirectory(const std::filesystem::path& root, int rank, std::function<void(const std::string&)> log = {});
  ~SwapDirectory();
  SwapDirectory(const SwapDirectory&) = delete;
  SwapDirectory& operator=(const SwapDirectory&) = delete;

  std::filesystem::path file(const std::string& name) const { return path_ / (name + ".swap"); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int lock_fd_ = -1;
};

// Whether `name` is the name of a swap directory: rank<digits>-pid<digits>[-<digits>].
bool is_swap_directory_name(const std::string& name);

// "1.5 GiB" from one GiB up, else "12.0 MiB".
std::string format_gib_mib(int64_t bytes);

}  // namespace zt::io
