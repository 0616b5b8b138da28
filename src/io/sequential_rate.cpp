#include "io/sequential_rate.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstring>

#include "io/aio.h"

namespace zt::io {

SequentialRate measure_sequential_rate(const std::filesystem::path& dir, int64_t bytes, int64_t block_size) {
  if (block_size < kAlignment || block_size % kAlignment != 0)
    throw zt::Error(fmt::format("measure_sequential_rate: expected a block size that is a positive multiple of {}, found {}",
                                kAlignment, block_size));
  const int64_t blocks = std::max<int64_t>(1, bytes / block_size);
  const std::filesystem::path path = dir / fmt::format(".zerotrain-rate-{}.tmp", ::getpid());
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    const int error = errno;
    throw IoError(fmt::format("creating '{}': {} (errno {})", path.string(), std::strerror(error), error), error);
  }
  struct Remove {
    int fd;
    const std::filesystem::path& path;
    ~Remove() {
      ::close(fd);
      ::unlink(path.c_str());
    }
  } remove{fd, path};

  AlignedBuffer buffer(block_size);
  std::memset(buffer.data(), 0x5a, size_t(block_size));
  using Clock = std::chrono::steady_clock;
  const auto pass = [&](bool write) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < blocks; ++i) {
      const off_t offset = off_t(i * block_size);
      const ssize_t n = write ? ::pwrite(fd, buffer.data(), size_t(block_size), offset)
                              : ::pread(fd, buffer.data(), size_t(block_size), offset);
      if (n != block_size) {
        const int error = n < 0 ? errno : EIO;
        throw IoError(fmt::format("{} '{}' at offset {} ({} bytes): {} (errno {})", write ? "writing" : "reading",
                                  path.string(), int64_t(offset), block_size,
                                  n < 0 ? std::strerror(error) : "short transfer", error),
                      error);
      }
    }
    return double(blocks * block_size) / 1e9 / std::chrono::duration<double>(Clock::now() - start).count();
  };
  SequentialRate rate;
  rate.write_gbps = pass(true);
  rate.read_gbps = pass(false);
  return rate;
}

}  // namespace zt::io
