// The asynchronous I/O engine (aio.h). One lock guards the ticket ring, the files and the
// statistics; I/O threads take block requests from the oldest ticket with bytes left, transfer
// them (io_uring or pread/pwrite) outside the lock and post the results back under it.
#include "io/aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef ZT_HAVE_IO_URING
#include <liburing.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "zerotrain/config.h"

namespace zt::io {

int64_t align_up(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

AioOptions aio_options_from(const zt::AioConfig& config) {
  AioOptions options;
  options.block_size = config.block_size;
  options.queue_depth = config.queue_depth;
  options.thread_count = config.thread_count;
  options.single_submit = config.single_submit;
  options.overlap_events = config.overlap_events;
  return options;
}

bool io_uring_available() {
#ifdef ZT_HAVE_IO_URING
  io_uring ring;
  if (io_uring_queue_init(2, &ring, 0) < 0) return false;
  io_uring_queue_exit(&ring);
  return true;
#else
  return false;
#endif
}

AlignedBuffer::AlignedBuffer(int64_t bytes) {
  if (bytes < 0) throw zt::Error(fmt::format("AlignedBuffer: expected a size >= 0, found {}", bytes));
  size_ = align_up(bytes);
  if (size_ == 0) return;
  data_ = std::aligned_alloc(size_t(kAlignment), size_t(size_));
  if (data_ == nullptr) {
    size_ = 0;
    throw std::bad_alloc();
  }
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

IoError::IoError(std::string message, int error_number)
    : zt::Error(std::move(message)), error_number_(error_number) {}

namespace {

using Clock = std::chrono::steady_clock;
enum class Op : unsigned char { Read, Write };

const char* verb(Op op) { return op == Op::Read ? "reading" : "writing"; }

std::string describe_errno(int error) { return fmt::format("{} (errno {})", std::strerror(error), error); }

struct TicketState {
  int64_t id = 0;
  Op op = Op::Read;
  int file = 0;
  int64_t offset = 0, bytes = 0;
  char* data = nullptr;
  int64_t dispatched = 0;  // bytes handed to I/O threads so far
  int outstanding = 0;     // requests in flight
  bool done = false, reported = false;
  // The first failure: errno, the failed request, and for a short transfer what it moved (-1: not short).
  int error = 0;
  int64_t fail_offset = 0, fail_length = 0, fail_transferred = -1;
};

// One block request, in a slot an I/O thread allocated when it started.
struct Request {
  int64_t ticket = 0;
  Op op = Op::Read;
  int fd = -1;
  char* data = nullptr;
  int64_t offset = 0, length = 0;
  int injected = 0;  // errno of an injected failure, 0 for none
  bool short_once = false;  // an injected short transfer: the first call moves half the bytes
};

// pread/pwrite of the request's bytes from `done` on. A call may move fewer bytes than asked (a
// buffered file system may), so the rest is asked for again until all have moved; returns the
// request's length, the bytes moved before the end of the file (reported as a short transfer),
// or -errno.
int64_t transfer_blocking(const Request& r, int64_t done = 0) {
  bool first = true;
  while (done < r.length) {
    int64_t ask = r.length - done;
    // An injected short transfer: about half, still aligned for O_DIRECT.
    if (first && r.short_once) ask = std::max<int64_t>(kAlignment, ask / 2 / kAlignment * kAlignment);
    first = false;
    const ssize_t n = r.op == Op::Read ? ::pread(r.fd, r.data + done, size_t(ask), off_t(r.offset + done))
                                       : ::pwrite(r.fd, r.data + done, size_t(ask), off_t(r.offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -int64_t(errno);
    }
    if (n == 0) break;  // the end of the file: nothing more will come
    done += n;
  }
  return done;
}

Backend backend_from_environment(Backend requested) {
  if (requested != Backend::Auto) return requested;
  const char* value = std::getenv("ZT_IO_BACKEND");
  if (value == nullptr || *value == '\0') return Backend::Auto;
  const std::string text = value;
  if (text == "posix") return Backend::Posix;
  if (text == "io_uring") return Backend::IoUring;
  throw zt::ConfigError("ZT_IO_BACKEND='" + text + "': expected posix or io_uring");
}

}  // namespace

struct AioEngine::Impl {
  AioOptions options;
  std::shared_ptr<IoFaults> faults;
  bool use_uring = false;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // I/O threads wait here for tickets
  std::condition_variable done_cv;  // callers wait here for tickets to finish
  // Tickets [head, tail) live at ring[id & (size - 1)]; ids below head are done. A done ticket
  // leaves the ring once every ticket before it is done, waited for or not, so the ring holds
  // only what is in flight or queued behind it; a failure nobody has been told of yet moves to
  // `unreported` until wait() or wait_all() reports it.
  std::vector<TicketState> ring;
  std::map<int64_t, TicketState> unreported;
  int64_t head = 1, tail = 1;
  int64_t next_dispatch = 1;  // no ticket below this has bytes left to hand out
  int64_t pending = 0;        // tickets not done yet
  bool stopping = false;

  struct File {
    std::filesystem::path path;
    int fd = -1;
    int64_t size = 0;
  };
  std::vector<File> files;
  bool said_no_direct = false;

  Stats totals;
  int reads_in_flight = 0, writes_in_flight = 0;
  Clock::time_point reads_since, writes_since;

  std::vector<std::thread> threads;
#ifdef ZT_HAVE_IO_URING
  std::vector<io_uring> rings;
#endif

  void say(const std::string& line) const {
    if (options.log) {
      options.log(line);
    } else {
      std::cerr << "zerotrain: note: " << line << std::endl;
    }
  }

  TicketState& at(int64_t id) { return ring[size_t(id) & (ring.size() - 1)]; }
  const TicketState& at(int64_t id) const { return ring[size_t(id) & (ring.size() - 1)]; }

  void grow_ring() {
    std::vector<TicketState> bigger(ring.size() * 2);
    for (int64_t id = head; id < tail; ++id) bigger[size_t(id) & (bigger.size() - 1)] = at(id);
    ring.swap(bigger);
  }

  void advance_head() {
    for (; head < tail && at(head).done; ++head)
      if (at(head).error != 0 && !at(head).reported) unreported.emplace(head, at(head));
    next_dispatch = std::max(next_dispatch, head);
  }

  // Under mu: the next block request into `r`; false when there is none (or the engine stops).
  bool take(Request& r) {
    if (stopping) return false;
    while (next_dispatch < tail) {
      TicketState& t = at(next_dispatch);
      if (t.dispatched < t.bytes && t.error == 0) {
        const int64_t length = std::min(options.block_size, t.bytes - t.dispatched);
        r.ticket = t.id;
        r.op = t.op;
        r.fd = files[size_t(t.file)].fd;
        r.data = t.data + t.dispatched;
        r.offset = t.offset + t.dispatched;
        r.length = length;
        r.injected = 0;
        r.short_once = false;
        if (faults) r.injected = t.op == Op::Read ? faults->next_read_error() : faults->next_write_error(&r.short_once);
        t.dispatched += length;
        ++t.outstanding;
        ++totals.requests;
        const auto now = Clock::now();
        if (t.op == Op::Read) {
          if (reads_in_flight++ == 0) reads_since = now;
        } else if (writes_in_flight++ == 0) {
          writes_since = now;
        }
        return true;
      }
      ++next_dispatch;
    }
    return false;
  }

  // Under mu: the result of a request taken with take(); `result` is bytes moved or -errno.
  // Returns whether its ticket finished.
  bool complete(const Request& r, int64_t result) {
    const auto now = Clock::now();
    if (r.op == Op::Read) {
      if (--reads_in_flight == 0) totals.read_seconds += std::chrono::duration<double>(now - reads_since).count();
    } else if (--writes_in_flight == 0) {
      totals.write_seconds += std::chrono::duration<double>(now - writes_since).count();
    }
    TicketState& t = at(r.ticket);
    if (result > 0) (r.op == Op::Read ? totals.bytes_read : totals.bytes_written) += result;
    // Of several failed requests of one ticket, the first in the file is reported: the same
    // message whatever order the requests finished in.
    if (result != r.length && (t.error == 0 || r.offset < t.fail_offset)) {
      t.error = result < 0 ? int(-result) : EIO;
      t.fail_transferred = result < 0 ? -1 : result;
      t.fail_offset = r.offset;
      t.fail_length = r.length;
    }
    --t.outstanding;
    if (t.outstanding == 0 && (t.dispatched == t.bytes || t.error != 0)) {
      t.done = true;
      --pending;
      return true;
    }
    return false;
  }

  IoError failure(const TicketState& t) const {
    const std::string& path = files[size_t(t.file)].path.string();
    std::string what = describe_errno(t.error);
    if (t.fail_transferred >= 0)
      what = fmt::format("short {}, {} of {} bytes transferred: {}", t.op == Op::Read ? "read" : "write",
                         t.fail_transferred, t.fail_length, what);
    return IoError(fmt::format("{} '{}' at offset {} ({} bytes): {}", verb(t.op), path, t.fail_offset,
                               t.fail_length, what),
                   t.error);
  }

  // Validates and queues a ticket; the I/O threads split it into requests.
  Ticket issue(Op op, int file, int64_t offset, const void* data, int64_t bytes) {
    Impl& d = *this;
    Ticket id;
    {
      std::lock_guard lock(d.mu);
      if (file < 0 || size_t(file) >= d.files.size())
        throw zt::Error(fmt::format("AioEngine: {} file handle {}: no such file (open() returned 0 to {})", verb(op),
                                    file, int64_t(d.files.size()) - 1));
      const auto& f = d.files[size_t(file)];
      if (f.fd < 0)
        throw zt::Error(fmt::format("AioEngine: {} '{}': the file was closed", verb(op), f.path.string()));
      const auto address = reinterpret_cast<uintptr_t>(data);
      if (offset < 0 || bytes < 0 || offset % kAlignment != 0 || bytes % kAlignment != 0 || address % kAlignment != 0)
        throw zt::Error(fmt::format(
            "{} '{}': offset {}, length {} and buffer address {:#x} must each be a multiple of {} (O_DIRECT)",
            verb(op), f.path.string(), offset, bytes, address, kAlignment));
      if (offset + bytes > f.size)
        throw zt::Error(fmt::format("{} '{}' at offset {} ({} bytes): beyond the file's size of {} bytes", verb(op),
                                    f.path.string(), offset, bytes, f.size));
      d.advance_head();  // retire the done tickets nobody waited for
      if (d.tail - d.head == int64_t(d.ring.size())) d.grow_ring();
      id = d.tail++;
      TicketState& t = d.at(id);
      t = TicketState{};
      t.id = id;
      t.op = op;
      t.file = file;
      t.offset = offset;
      t.bytes = bytes;
      t.data = static_cast<char*>(const_cast<void*>(data));
      if (bytes == 0) {
        t.done = true;
      } else {
        ++d.pending;
      }
    }
    if (bytes > 0) d.work_cv.notify_all();
    return id;
  }

  void posix_loop() {
    Request r;
    for (;;) {
      {
        std::unique_lock lock(mu);
        while (!take(r)) {
          if (stopping) return;
          work_cv.wait(lock);
        }
      }
      const int64_t result = r.injected != 0 ? -int64_t(r.injected) : transfer_blocking(r);
      bool finished;
      {
        std::lock_guard lock(mu);
        finished = complete(r, result);
      }
      if (finished) done_cv.notify_all();
    }
  }

#ifdef ZT_HAVE_IO_URING
  void uring_loop(io_uring& ring_) {
    const int depth = options.queue_depth;
    std::vector<Request> slots(static_cast<size_t>(depth));
    std::vector<int> free_slots(static_cast<size_t>(depth));
    std::iota(free_slots.rbegin(), free_slots.rend(), 0);
    std::vector<int> taken, retry;
    std::vector<std::pair<int, int64_t>> results;
    taken.reserve(size_t(depth));
    retry.reserve(size_t(depth));
    results.reserve(size_t(depth));
    int in_flight = 0;       // submitted to the ring, not yet reaped
    bool ring_failed = false;  // after a submission error the ring is no longer used (see below)

    for (;;) {
      taken.swap(retry);
      retry.clear();
      {
        std::unique_lock lock(mu);
        for (;;) {
          // Without overlap_events a batch is submitted and then reaped in full before the next.
          if (options.overlap_events || in_flight == 0) {
            while (!free_slots.empty() && take(slots[size_t(free_slots.back())])) {
              taken.push_back(free_slots.back());
              free_slots.pop_back();
            }
          }
          if (!taken.empty() || in_flight > 0) break;
          if (stopping) return;
          work_cv.wait(lock);
        }
      }

      int batch = 0;
      for (size_t i = 0; i < taken.size(); ++i) {
        const int s = taken[i];
        const Request& r = slots[size_t(s)];
        if (r.injected != 0 || r.short_once || ring_failed) {
          results.emplace_back(s, r.injected != 0 ? -int64_t(r.injected) : transfer_blocking(r));
          continue;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr && batch > 0) {
          const int unconsumed = submit(ring_, batch, taken, i, results);
          in_flight -= unconsumed;
          ring_failed = unconsumed > 0;
          batch = 0;
          if (!ring_failed) sqe = io_uring_get_sqe(&ring_);
        }
        if (sqe == nullptr || ring_failed) {  // cannot happen with depth slots; stay correct anyway
          results.emplace_back(s, transfer_blocking(r));
          continue;
        }
        if (r.op == Op::Read) {
          io_uring_prep_read(sqe, r.fd, r.data, unsigned(r.length), __u64(r.offset));
        } else {
          io_uring_prep_write(sqe, r.fd, r.data, unsigned(r.length), __u64(r.offset));
        }
        io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(uintptr_t(s)));
        ++in_flight;
        ++batch;
        if (options.single_submit) {
          const int unconsumed = submit(ring_, batch, taken, i + 1, results);
          in_flight -= unconsumed;
          ring_failed = unconsumed > 0;
          batch = 0;
        }
      }
      if (batch > 0) {
        const int unconsumed = submit(ring_, batch, taken, taken.size(), results);
        in_flight -= unconsumed;
        ring_failed = unconsumed > 0;
      }
      taken.clear();

      if (in_flight > 0 && results.empty()) {
        const unsigned want = options.overlap_events ? 1u : unsigned(in_flight);
        io_uring_cqe* cqe = nullptr;
        int rc;
        do {
          rc = io_uring_wait_cqe_nr(&ring_, &cqe, want);
        } while (rc == -EINTR || rc == -EAGAIN);
      }
      unsigned cq_head, reaped = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, cq_head, cqe) {
        const int s = int(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqe)));
        ++reaped;
        if (cqe->res == -EAGAIN || cqe->res == -EINTR) {
          retry.push_back(s);  // transient: issue the same request again
        } else if (cqe->res > 0 && cqe->res < slots[size_t(s)].length) {
          // A short transfer: the rest is moved here (pread/pwrite), as the fallback does.
          results.emplace_back(s, transfer_blocking(slots[size_t(s)], int64_t(cqe->res)));
        } else {
          results.emplace_back(s, int64_t(cqe->res));
        }
      }
      io_uring_cq_advance(&ring_, reaped);
      in_flight -= int(reaped);

      if (!results.empty()) {
        bool finished = false;
        {
          std::lock_guard lock(mu);
          for (const auto& [s, result] : results) {
            finished |= complete(slots[size_t(s)], result);
            free_slots.push_back(s);
          }
        }
        results.clear();
        if (finished) done_cv.notify_all();
      }
    }
  }

  // Submits the `count` prepared entries (the last ones of taken[0, end)); returns how many the
  // kernel did not consume (0 on success). A hard failure of io_uring_enter
  // (not EINTR/EAGAIN/EBUSY, which are retried) leaves entries in the submission queue that the
  // kernel may or may not have consumed; this thread then stops submitting (waiting for
  // completions submits nothing) and does its remaining requests with pread/pwrite. The requests
  // of this batch that were not consumed complete with the error.
  int submit(io_uring& ring_, int count, const std::vector<int>& taken, size_t end,
              std::vector<std::pair<int, int64_t>>& results) {
    int left = count;
    while (left > 0) {
      const int rc = io_uring_submit(&ring_);
      if (rc > 0) {
        left -= rc;
        continue;
      }
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY || rc == 0) {
        if (rc != -EINTR) std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      // The last `left` prepared entries of the batch were not consumed.
      size_t i = end;
      for (int failed = 0; failed < left && i > 0;) {
        --i;
        results.emplace_back(taken[i], int64_t(rc));
        ++failed;
      }
      say(fmt::format("io_uring_submit failed: {}; this I/O thread continues with pread/pwrite",
                      describe_errno(-rc)));
      return left;
    }
    return 0;
  }
#endif
};

AioEngine::AioEngine(AioOptions options, std::shared_ptr<IoFaults> faults) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  if (options.block_size < kAlignment || options.block_size % kAlignment != 0 || options.block_size > (int64_t(1) << 30))
    throw zt::ConfigError(fmt::format(
        "aio.block_size: expected a multiple of {} bytes between {} and 1073741824, found {}", kAlignment,
        kAlignment, options.block_size));
  if (options.queue_depth < 1 || options.queue_depth > 4096)
    throw zt::ConfigError(fmt::format("aio.queue_depth: expected 1 to 4096, found {}", options.queue_depth));
  if (options.thread_count < 1 || options.thread_count > 64)
    throw zt::ConfigError(fmt::format("aio.thread_count: expected 1 to 64, found {}", options.thread_count));
  d.options = std::move(options);
  d.faults = faults ? std::move(faults) : io_faults_from_environment();
  d.ring.resize(64);

  const Backend backend = backend_from_environment(d.options.backend);
  if (backend != Backend::Posix) {
#ifdef ZT_HAVE_IO_URING
    d.rings.resize(size_t(d.options.thread_count));
    int error = 0;
    size_t made = 0;
    for (; made < d.rings.size(); ++made) {
      error = io_uring_queue_init(unsigned(d.options.queue_depth), &d.rings[made], 0);
      if (error < 0) break;
    }
    if (error < 0) {
      for (size_t i = 0; i < made; ++i) io_uring_queue_exit(&d.rings[i]);
      d.rings.clear();
      if (backend == Backend::IoUring)
        throw zt::Error("io_uring was requested for asynchronous I/O, but io_uring_queue_init failed: " +
                        describe_errno(-error));
      d.say("io_uring is not available (io_uring_queue_init: " + describe_errno(-error) +
            "); asynchronous I/O uses pread/pwrite threads");
    } else {
      d.use_uring = true;
    }
#else
    if (backend == Backend::IoUring)
      throw zt::ConfigError("io_uring was requested for asynchronous I/O, but this build has no liburing");
    d.say("this build has no liburing; asynchronous I/O uses pread/pwrite threads");
#endif
  }

  for (int i = 0; i < d.options.thread_count; ++i) {
#ifdef ZT_HAVE_IO_URING
    if (d.use_uring) {
      d.threads.emplace_back([&d, i] { d.uring_loop(d.rings[size_t(i)]); });
      continue;
    }
#endif
    d.threads.emplace_back([&d] { d.posix_loop(); });
  }
}

AioEngine::~AioEngine() {
  Impl& d = *impl_;
  {
    std::lock_guard lock(d.mu);
    d.stopping = true;
  }
  d.work_cv.notify_all();
  for (std::thread& t : d.threads) t.join();
#ifdef ZT_HAVE_IO_URING
  for (io_uring& ring : d.rings) io_uring_queue_exit(&ring);
#endif
  for (const Impl::File& f : d.files)
    if (f.fd >= 0) ::close(f.fd);
}

int AioEngine::open(const std::filesystem::path& path, int64_t bytes) {
  Impl& d = *impl_;
  if (bytes < 0) throw zt::Error(fmt::format("creating '{}': expected a size >= 0, found {}", path.string(), bytes));
  const int64_t size = align_up(bytes);
  const int base_flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  int fd = ::open(path.c_str(), base_flags | (d.options.direct ? O_DIRECT : 0), 0600);
  if (fd < 0 && errno == EINVAL && d.options.direct) {
    fd = ::open(path.c_str(), base_flags, 0600);
    if (fd >= 0) {
      std::lock_guard lock(d.mu);
      if (!d.said_no_direct)
        d.say("the file system of '" + path.parent_path().string() +
              "' refuses O_DIRECT; its swap files go through the page cache");
      d.said_no_direct = true;
    }
  }
  if (fd < 0) {
    const int error = errno;
    throw IoError(fmt::format("creating '{}' ({} bytes): {}", path.string(), size, describe_errno(error)), error);
  }
  if (size > 0) {
    int rc;
    do {
      rc = ::fallocate(fd, 0, 0, off_t(size));
    } while (rc != 0 && errno == EINTR);
    // File systems without fallocate: the size is set, the space is not reserved.
    if (rc != 0 && errno == EOPNOTSUPP) rc = ::ftruncate(fd, off_t(size));
    if (rc != 0) {
      const int error = errno;
      ::close(fd);
      ::unlink(path.c_str());
      throw IoError(fmt::format("allocating '{}' at offset 0 ({} bytes): {}", path.string(), size,
                                describe_errno(error)),
                    error);
    }
  }
  std::lock_guard lock(d.mu);
  d.files.push_back({path, fd, size});
  return int(d.files.size() - 1);
}

void AioEngine::close(int file) {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (file < 0 || size_t(file) >= d.files.size() || d.files[size_t(file)].fd < 0)
    throw zt::Error(fmt::format("AioEngine::close: file handle {} is not open", file));
  for (int64_t id = d.head; id < d.tail; ++id)
    if (d.at(id).file == file && !d.at(id).done)
      throw zt::Error(fmt::format("AioEngine::close: '{}' has a transfer in flight (ticket {})",
                                  d.files[size_t(file)].path.string(), id));
  ::close(d.files[size_t(file)].fd);
  d.files[size_t(file)].fd = -1;
}

void AioEngine::rename(int file, const std::filesystem::path& to) {
  Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (file < 0 || size_t(file) >= d.files.size())
    throw zt::Error(fmt::format("AioEngine::rename: no file handle {}", file));
  Impl::File& f = d.files[size_t(file)];
  if (::rename(f.path.c_str(), to.c_str()) != 0) {
    const int error = errno;
    throw IoError(fmt::format("renaming '{}' to '{}': {}", f.path.string(), to.string(), describe_errno(error)), error);
  }
  f.path = to;
}

AioEngine::Ticket AioEngine::read(int file, int64_t offset, void* destination, int64_t bytes) {
  return impl_->issue(Op::Read, file, offset, destination, bytes);
}

AioEngine::Ticket AioEngine::write(int file, int64_t offset, const void* source, int64_t bytes) {
  return impl_->issue(Op::Write, file, offset, source, bytes);
}

void AioEngine::wait(Ticket ticket) {
  Impl& d = *impl_;
  std::unique_lock lock(d.mu);
  if (ticket <= 0 || ticket >= d.tail)
    throw zt::Error(fmt::format("AioEngine::wait: ticket {} was never issued (issued so far: 1 to {})", ticket,
                                d.tail - 1));
  if (ticket < d.head) {
    const auto failed = d.unreported.find(ticket);
    if (failed == d.unreported.end()) return;
    IoError error = d.failure(failed->second);
    d.unreported.erase(failed);
    throw error;
  }
  d.done_cv.wait(lock, [&] { return d.at(ticket).done; });
  TicketState& t = d.at(ticket);
  if (t.reported) return;
  t.reported = true;
  const bool failed = t.error != 0;
  IoError error = failed ? d.failure(t) : IoError("", 0);
  d.advance_head();
  if (failed) throw error;
}

void AioEngine::wait_all() {
  Impl& d = *impl_;
  std::unique_lock lock(d.mu);
  d.done_cv.wait(lock, [&] { return d.pending == 0; });
  d.advance_head();  // every ticket is done: the ring empties, unreported failures set aside
  if (d.unreported.empty()) return;
  IoError error = d.failure(d.unreported.begin()->second);  // the lowest ticket's
  d.unreported.clear();
  throw error;
}

void AioEngine::drain() noexcept {
  Impl& d = *impl_;
  std::unique_lock lock(d.mu);
  d.done_cv.wait(lock, [&] { return d.pending == 0; });
  d.advance_head();
  d.unreported.clear();
}

bool AioEngine::done(Ticket ticket) const {
  const Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  if (ticket <= 0 || ticket >= d.tail)
    throw zt::Error(fmt::format("AioEngine::done: ticket {} was never issued (issued so far: 1 to {})", ticket,
                                d.tail - 1));
  return ticket < d.head || d.at(ticket).done;
}

const char* AioEngine::backend_name() const { return impl_->use_uring ? "io_uring" : "pread/pwrite"; }

AioEngine::Stats AioEngine::stats() const {
  const Impl& d = *impl_;
  std::lock_guard lock(d.mu);
  Stats s = d.totals;
  s.ticket_slots = int64_t(d.ring.size());
  const auto now = Clock::now();
  if (d.reads_in_flight > 0) s.read_seconds += std::chrono::duration<double>(now - d.reads_since).count();
  if (d.writes_in_flight > 0) s.write_seconds += std::chrono::duration<double>(now - d.writes_since).count();
  return s;
}

}  // namespace zt::io
