#include "checkpoint/file_system.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& doing, const fs::path& path, int error) {
  throw Error(doing + " '" + path.string() + "': " + std::strerror(error));
}

class PosixFile : public WritableFile {
 public:
  PosixFile(fs::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void write_at(const void* data, int64_t n, int64_t offset) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t done = ::pwrite(fd_, p, size_t(std::min<int64_t>(n, 1 << 30)), offset);
      if (done < 0) {
        if (errno == EINTR) continue;
        fail("writing", path_, errno);
      }
      p += done;
      n -= done;
      offset += done;
    }
  }
  void sync() override {
    if (::fsync(fd_) != 0) fail("flushing to disk", path_, errno);
  }
  void close() override {
    const int fd = fd_;
    fd_ = -1;
    if (fd >= 0 && ::close(fd) != 0) fail("closing", path_, errno);
  }
  const fs::path& path() const override { return path_; }

 private:
  fs::path path_;
  int fd_;
};

class RealFileSystem : public FileSystem {
 public:
  std::unique_ptr<WritableFile> create(const fs::path& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("cannot create", path, errno);
    return std::make_unique<PosixFile>(path, fd);
  }
  void sync_path(const fs::path& path, bool directory) override {
    const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) fail("cannot open to flush", path, errno);
    const int rc = ::fsync(fd);
    const int error = errno;
    ::close(fd);
    if (rc != 0) fail("flushing to disk", path, error);
  }
  void rename(const fs::path& from, const fs::path& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw Error("renaming '" + from.string() + "' to '" + to.string() + "': " + std::strerror(errno));
  }
  void create_directories(const fs::path& path) override {
    std::error_code error;
    fs::create_directories(path, error);
    if (error) throw Error("creating directory '" + path.string() + "': " + error.message());
  }
  void remove_all(const fs::path& path) override {
    std::error_code error;
    fs::remove_all(path, error);
    if (error) throw Error("removing '" + path.string() + "': " + error.message());
  }
};

class FaultyFile : public WritableFile {
 public:
  FaultyFile(FaultInjectingFileSystem& owner, std::unique_ptr<WritableFile> base)
      : owner_(owner), base_(std::move(base)) {}
  void write_at(const void* data, int64_t n, int64_t offset) override {
    if (const int error = owner_.next_write_error()) fail("writing", path(), error);
    base_->write_at(data, n, offset);
  }
  void sync() override {
    if (const int error = owner_.next_sync_error()) fail("flushing to disk", path(), error);
    base_->sync();
  }
  void close() override { base_->close(); }
  const fs::path& path() const override { return base_->path(); }

 private:
  FaultInjectingFileSystem& owner_;
  std::unique_ptr<WritableFile> base_;
};

}  // namespace

FileSystem& FileSystem::real() {
  static RealFileSystem instance;
  return instance;
}

FaultInjectingFileSystem::FaultInjectingFileSystem(FileSystem& base, Fault fault, int k)
    : base_(base), fault_(fault), k_(k) {}

int FaultInjectingFileSystem::next(Fault kind, std::atomic<int>& counter) {
  const int n = ++counter;
  if (fault_ == Fault::DiskFull && kind == Fault::Write && n >= k_) {
    hit_ = true;
    return ENOSPC;
  }
  if (fault_ != kind || n != k_) return 0;
  hit_ = true;
  return kind == Fault::Create || kind == Fault::Mkdir ? EACCES : EIO;
}

int FaultInjectingFileSystem::next_write_error() { return next(Fault::Write, writes_); }
int FaultInjectingFileSystem::next_sync_error() { return next(Fault::Sync, syncs_); }

std::unique_ptr<WritableFile> FaultInjectingFileSystem::create(const fs::path& path) {
  if (const int error = next(Fault::Create, creates_)) fail("cannot create", path, error);
  return std::make_unique<FaultyFile>(*this, base_.create(path));
}

void FaultInjectingFileSystem::sync_path(const fs::path& path, bool directory) {
  if (const int error = next_sync_error()) fail("flushing to disk", path, error);
  base_.sync_path(path, directory);
}

void FaultInjectingFileSystem::rename(const fs::path& from, const fs::path& to) {
  if (const int error = next(Fault::Rename, renames_))
    throw Error("renaming '" + from.string() + "' to '" + to.string() + "': " + std::strerror(error));
  base_.rename(from, to);
}

void FaultInjectingFileSystem::create_directories(const fs::path& path) {
  if (const int error = next(Fault::Mkdir, mkdirs_))
    throw Error("creating directory '" + path.string() + "': " + std::strerror(error));
  base_.create_directories(path);
}

void FaultInjectingFileSystem::remove_all(const fs::path& path) { base_.remove_all(path); }

const char* to_string(FaultInjectingFileSystem::Fault fault) {
  switch (fault) {
    case FaultInjectingFileSystem::Fault::None: return "none";
    case FaultInjectingFileSystem::Fault::Create: return "create";
    case FaultInjectingFileSystem::Fault::Write: return "write";
    case FaultInjectingFileSystem::Fault::Sync: return "fsync";
    case FaultInjectingFileSystem::Fault::Rename: return "rename";
    case FaultInjectingFileSystem::Fault::Mkdir: return "mkdir";
    case FaultInjectingFileSystem::Fault::DiskFull: return "disk full";
  }
  return "?";
}

}  // namespace zt
