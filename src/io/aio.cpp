// The I/O engine's public face (aio.h): options, aligned buffers, the choice of backend, files and
// the caller's side of tickets. One lock guards the ticket ring, the files and the statistics; I/O
// threads take block requests from the oldest ticket with bytes left, transfer them (io_uring,
// aio_uring.cpp, or pread/pwrite, aio_posix.cpp) outside the lock and post the results back under it
// (aio_queue.cpp).
#include "io/aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/aio_impl.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "zerotrain/config/config.h"

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