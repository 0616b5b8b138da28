// Fault injection for the asynchronous I/O engine (src/io/aio.h): makes one chosen request fail,
// or the disk look full, so that tests (and end-to-end runs through ZT_IO_FAULT) reach the error
// paths of the NVMe tiers. An injected failure takes the same path as one the kernel reports: the
// request completes with that errno instead of being handed to the kernel.
//
// Contract
// - Requests are the block_size pieces an engine hands to the kernel, counted per kind (reads,
//   writes) from 1 and from the object's construction, by every engine sharing the object;
//   counters are atomic, so several I/O threads may share one object.
// - Read: the k-th read request fails with EIO. Write: the k-th write request fails with EIO.
//   DiskFull: every write request from the k-th on fails with ENOSPC. ShortWrite: the k-th write
//   request moves only half its bytes in its first call (as a buffered file system may), and the
//   engine must move the rest. None: nothing fails.
// - hit() says whether a failure was injected.
#pragma once
#include <atomic>
#include <memory>
#include <string>

namespace zt::io {

struct IoFaults {
  enum class Kind { None, Read, Write, DiskFull, ShortWrite };
  IoFaults(Kind kind, int k);

  Kind kind = Kind::None;
  int k = 1;

  // For the request about to be issued: the errno it must fail with, 0 for none; for a write,
  // `short_transfer` (if given) is set when its first call must move only half its bytes.
  int next_read_error();
  int next_write_error(bool* short_transfer = nullptr);
  bool hit() const { return hit_.load(); }

 private:
  std::atomic<int> reads_{0}, writes_{0};
  std::atomic<bool> hit_{false};
};

// Parses the environment variable ZT_IO_FAULT: "read:K", "write:K", "full:K" or "short:K" with K >= 1;
// null when unset or empty. Other text is a zt::ConfigError naming the variable. Each call
// returns a new object (its own counters).
std::shared_ptr<IoFaults> io_faults_from_environment();

// The same parsing for a given text (`variable` names the source in errors).
std::shared_ptr<IoFaults> parse_io_faults(const std::string& text, const std::string& variable);

}  // namespace zt::io
