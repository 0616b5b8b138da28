// Asynchronous file I/O for the NVMe tiers (ZeRO-Infinity): swap files of optimizer
// states and parameter shards, read and written in large aligned pieces while the caller computes.
//
// Contract
// - Ownership: a buffer passed to read()/write() belongs to the engine from the call until
//   wait() (or wait_all()) for its ticket has returned; the caller must neither touch it nor free
//   it before then. wait() returning normally means every byte was transferred.
// - Threads: one caller thread issues read/write/wait/wait_all/done/open (the methods are also
//   safe to call from several threads, under one lock). The transfers themselves run on the
//   engine's own I/O threads (thread_count of them, each with its own io_uring ring or its own
//   pread/pwrite loop) fed from one queue: a read issued before a compute step completes while
//   the caller computes, whether or not anyone waits for it.
// - Order: requests start in the order they were issued, but up to queue_depth × thread_count
//   of them are in flight at once and finish in any order. Overlapping accesses (a write, then a
//   read of the same bytes) must be ordered by the caller: wait for the first before issuing the
//   second.
// - Alignment: offsets, lengths and buffer addresses are multiples of kAlignment (O_DIRECT's
//   rule); anything else is refused with zt::Error before any I/O starts. A request must lie
//   within the size the file was opened with.
// - Failures: any failed transfer (an error from the kernel, a short transfer, an injected
//   fault) becomes an IoError, thrown by wait() of the ticket it belongs to, or by wait_all() when
//   that ticket was not waited for yet. After a failure the rest of that ticket is not issued;
//   other tickets are unaffected. Each failure is reported once.
// - Memory: request slots are allocated when the engine starts; in steady state issuing and
//   completing requests allocates nothing. A ticket needs no wait(): once it and every ticket
//   before it are done, its slot is reused (a failure is kept until reported).
// - Destruction cancels requests not yet started, waits for those in flight (never throws) and
//   closes the files. The files themselves are left in place (their directory owns them).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "io/faults.h"
#include "zerotrain/error.h"

namespace zt {
struct AioConfig;
}

namespace zt::io {

constexpr int64_t kAlignment = 4096;  // O_DIRECT offset/length/address alignment

// `bytes` rounded up to a multiple of kAlignment (bytes >= 0).
int64_t align_up(int64_t bytes);

enum class Backend { Auto, IoUring, Posix };

// Mirrors the config "aio" block (zt::AioConfig in include/zerotrain/config/config.h).
struct AioOptions {
  int64_t block_size = 1 << 20;  // bytes per request; a multiple of kAlignment
  int queue_depth = 8;           // requests in flight per I/O thread (pread/pwrite: one at a time)
  int thread_count = 1;          // I/O threads
  bool single_submit = false;    // io_uring: one io_uring_submit per request instead of per batch
  bool overlap_events = true;    // io_uring: reap completions while still submitting (else a batch
                                 // is submitted, then all of it reaped before the next)
  bool direct = true;            // O_DIRECT; where the file system refuses it, files are opened
                                 // without it and that is said once through `log`
  // Auto: io_uring, falling back to pread/pwrite when io_uring_queue_init fails or the build has
  // no liburing (said once through `log`); the environment variable ZT_IO_BACKEND=posix|io_uring
  // then chooses instead. IoUring fails (zt::Error) where io_uring cannot be used.
  Backend backend = Backend::Auto;
  // One-line notices; unset: stderr with the prefix "zerotrain: note: ".
  std::function<void(const std::string&)> log;
};

AioOptions aio_options_from(const zt::AioConfig& config);

// Whether this build has liburing and io_uring_queue_init succeeds for this process (seccomp
// filters and sysctls such as kernel.io_uring_disabled can forbid it).
bool io_uring_available();

// Heap memory aligned to kAlignment, its size rounded up to kAlignment; allocated once, not
// initialised. Move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t bytes);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() { return data_; }
  const void* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

// Thrown for any failed I/O. The message names the file, the offset, the length, strerror and the
// errno: "writing '/nvme/zerotrain-swap/rank0-pid123/exp_avg.swap' at offset 8388608 (1048576
// bytes): No space left on device (errno 28)".
class IoError : public zt::Error {
 public:
  IoError(std::string message, int error_number);
  int error_number() const { return error_number_; }

 private:
  int error_number_;
};

class AioEngine {
 public:
  // faults: null means io_faults_from_environment() (ZT_IO_FAULT), itself null when unset.
  // Throws zt::ConfigError for options out of range (naming the aio key) and for bad values of
  // ZT_IO_BACKEND / ZT_IO_FAULT.
  explicit AioEngine(AioOptions options, std::shared_ptr<IoFaults> faults = nullptr);
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Creates (or truncates) a swap file of `bytes` (fallocate: the space is reserved now, so a
  // full disk is an IoError here naming the file, not in the middle of a step) and opens it for
  // reading and writing, with O_DIRECT when options.direct. Returns its handle for read/write.
  int open(const std::filesystem::path& path, int64_t bytes);
  // Closes a file opened here, leaving it on disk; its handle is refused from then on. No transfer
  // of it may be in flight (zt::Error otherwise).
  void close(int file);
  // Renames a file opened here to `to` (rename(2): `to` is replaced atomically), so that its
  // errors name it by its new path. IoError naming both paths on failure (nothing changed).
  void rename(int file, const std::filesystem::path& to);

  using Ticket = int64_t;
  // Asynchronous. Split into block_size requests. bytes == 0 gives a ticket that is done at once.
  Ticket read(int file, int64_t offset, void* destination, int64_t bytes);
  Ticket write(int file, int64_t offset, const void* source, int64_t bytes);
  // Blocks until the ticket is done; throws IoError for its failure (a short read or write counts
  // as one, EIO, naming what was transferred). A ticket already reported returns at once.
  void wait(Ticket ticket);
  // Waits for every ticket issued so far; throws the first (lowest ticket) failure not reported
  // yet, and marks every failure as reported.
  void wait_all();
  // Waits for every ticket issued so far and discards their failures without reporting them;
  // afterwards no transfer touches any caller's buffer. For a caller unwinding from an IoError
  // (the other tickets of the failed step are still in flight into buffers about to be freed).
  void drain() noexcept;
  // Whether the ticket has finished (successfully or not), without waiting or reporting.
  bool done(Ticket ticket) const;

  const char* backend_name() const;  // "io_uring" or "pread/pwrite"

  struct Stats {
    int64_t bytes_read = 0, bytes_written = 0;
    // Wall time during which at least one read (write) request was in flight.
    double read_seconds = 0, write_seconds = 0;
    int64_t requests = 0;  // block requests issued to the kernel (injected failures included)
    // Slots of the ticket queue: it grows only with the tickets in flight or queued at once,
    // not with tickets nobody waits for (now, not cumulative).
    int64_t ticket_slots = 0;
  };
  Stats stats() const;  // cumulative since construction

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt::io
