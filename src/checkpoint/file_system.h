// The file operations of checkpoint and export writers, behind one small interface (after
// leveldb's Env), so that tests can make any one of them fail and show that a failed save never
// damages or half-publishes anything (docs/checkpoint.md "Failures while saving").
//
// Contract
// - FileSystem::real() performs each operation with the POSIX call of the same name. Every
//   failure throws zt::Error naming the path and the operating system's error (strerror), e.g.
//   "writing '/ckpt/.partial-step-4/rank-00000-of-00001.safetensors': No space left on device".
// - FaultInjectingFileSystem forwards to another FileSystem and fails exactly one chosen
//   operation (the k-th of one kind, counted from construction), or with DiskFull every write
//   from the k-th on, the way the real one reports that error. fault_hit() says whether the fault
//   was reached. Readers do not go through this interface: they only read.
// - Thread-safe for distinct files; the fault counters are atomic.
#pragma once
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace zt {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes all `n` bytes at `offset`, or throws.
  virtual void write_at(const void* data, int64_t n, int64_t offset) = 0;
  virtual void sync() = 0;   // fsync
  virtual void close() = 0;  // close, reporting its error; the destructor closes silently
  virtual const std::filesystem::path& path() const = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates or truncates a file for writing.
  virtual std::unique_ptr<WritableFile> create(const std::filesystem::path& path) = 0;
  // fsync of a file or directory that already exists (to make renames and new entries durable).
  virtual void sync_path(const std::filesystem::path& path, bool directory) = 0;
  // rename(2): atomic replacement of `to`.
  virtual void rename(const std::filesystem::path& from, const std::filesystem::path& to) = 0;
  virtual void create_directories(const std::filesystem::path& path) = 0;
  virtual void remove_all(const std::filesystem::path& path) = 0;

  static FileSystem& real();
};

class FaultInjectingFileSystem : public FileSystem {
 public:
  enum class Fault {
    None,
    Create,    // the k-th create fails (EACCES)
    Write,     // the k-th write fails (EIO)
    Sync,      // the k-th fsync (of a file or a directory) fails (EIO)
    Rename,    // the k-th rename fails (EIO)
    Mkdir,     // the k-th create_directories fails (EACCES)
    DiskFull,  // every write from the k-th on fails (ENOSPC)
  };
  FaultInjectingFileSystem(FileSystem& base, Fault fault, int k);

  std::unique_ptr<WritableFile> create(const std::filesystem::path& path) override;
  void sync_path(const std::filesystem::path& path, bool directory) override;
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) override;
  void create_directories(const std::filesystem::path& path) override;
  void remove_all(const std::filesystem::path& path) override;

  bool fault_hit() const { return hit_; }

  // For the files it creates: whether the next write / fsync must fail, and with which errno
  // (0: no fault).
  int next_write_error();
  int next_sync_error();

 private:
  int next(Fault kind, std::atomic<int>& counter);
  FileSystem& base_;
  Fault fault_;
  int k_;
  std::atomic<int> creates_{0}, writes_{0}, syncs_{0}, renames_{0}, mkdirs_{0};
  std::atomic<bool> hit_{false};
};

const char* to_string(FaultInjectingFileSystem::Fault fault);

}  // namespace zt
