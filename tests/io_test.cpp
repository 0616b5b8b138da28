// The asynchronous I/O layer of the NVMe tiers (src/io/): round trips on both backends, refused
// arguments, injected and real failures, the swap directory's lifetime and stale-run clearing.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "io/aio.h"
#include "io/faults.h"
#include "io/sequential_rate.h"
#include "io/swap_directory.h"
#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace fs = std::filesystem;
using namespace zt::io;

namespace {

constexpr int64_t KiB = 1024, MiB = 1024 * KiB;

// Sets (or unsets, for nullptr) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A fresh directory under the build tree, removed with everything in it at the end of the scope
// (swap files are large enough to matter when tests repeat).
struct TempDir {
  explicit TempDir(const std::string& prefix) : path(zt::testing::make_temp_dir(prefix)) {}
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

void fill(void* data, int64_t bytes, uint32_t seed) {
  auto* p = static_cast<uint32_t*>(data);
  for (int64_t i = 0; i < bytes / 4; ++i) p[i] = seed * 2654435761u + uint32_t(i) * 40503u + 1u;
}

std::string backend_label(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::IoUring ? "IoUring" : "Posix";
}

class AioBackend : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() == Backend::IoUring && !io_uring_available())
      GTEST_SKIP() << "io_uring is not available to this process (or the build has no liburing)";
    dir_ = zt::testing::make_temp_dir("io");
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  AioOptions options(int64_t block = 64 * KiB, int depth = 4, int threads = 1) {
    AioOptions o;
    o.backend = GetParam();
    o.block_size = block;
    o.queue_depth = depth;
    o.thread_count = threads;
    o.log = [this](const std::string& line) { notes_.push_back(line); };
    return o;
  }
  const char* expected_name() const { return GetParam() == Backend::IoUring ? "io_uring" : "pread/pwrite"; }

  fs::path dir_;
  std::vector<std::string> notes_;
};

// Writes many tickets of sizes that are not multiples of the block size, all in flight at once,
// then reads them back (also all in flight) and compares.
void round_trip(AioEngine& engine, const fs::path& path) {
  const std::vector<int64_t> sizes = {4 * KiB, 12 * KiB, 64 * KiB, 68 * KiB, 196 * KiB, 132 * KiB};
  constexpr int kTickets = 150;  // more than the engine's initial ticket ring
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (int i = 0; i < kTickets; ++i) {
    offsets.push_back(total);
    total += sizes[size_t(i) % sizes.size()];
  }
  AlignedBuffer source(total), target(total);
  fill(source.data(), total, 7);
  std::memset(target.data(), 0, size_t(total));
  const int file = engine.open(path, total);
  auto* src = static_cast<char*>(source.data());
  auto* dst = static_cast<char*>(target.data());
  for (int i = 0; i < kTickets; ++i) engine.write(file, offsets[size_t(i)], src + offsets[size_t(i)], sizes[size_t(i) % sizes.size()]);
  engine.wait_all();
  std::vector<AioEngine::Ticket> reads;
  for (int i = 0; i < kTickets; ++i)
    reads.push_back(engine.read(file, offsets[size_t(i)], dst + offsets[size_t(i)], sizes[size_t(i) % sizes.size()]));
  for (auto it = reads.rbegin(); it != reads.rend(); ++it) engine.wait(*it);
  ASSERT_EQ(std::memcmp(source.data(), target.data(), size_t(total)), 0);
  const AioEngine::Stats stats = engine.stats();
  EXPECT_EQ(stats.bytes_written, total);
  EXPECT_EQ(stats.bytes_read, total);
  EXPECT_GE(stats.requests, 2 * kTickets);
  EXPECT_GT(stats.read_seconds, 0.0);
  EXPECT_GT(stats.write_seconds, 0.0);
}

TEST_P(AioBackend, RoundTripManyTicketsOddSizes) {
  AioEngine engine(options());
  EXPECT_STREQ(engine.backend_name(), expected_name());
  round_trip(engine, dir_ / "a.swap");
}

TEST_P(AioBackend, RoundTripDepthOneAndSeveralThreads) {
  {
    AioEngine engine(options(64 * KiB, 1, 1));
    round_trip(engine, dir_ / "depth1.swap");
  }
  AioEngine engine(options(16 * KiB, 3, 3));
  round_trip(engine, dir_ / "threads3.swap");
}

TEST_P(AioBackend, RoundTripSingleSubmitAndBatchedEvents) {
  AioOptions o = options(32 * KiB, 8, 2);
  o.single_submit = true;
  {
    AioEngine engine(o);
    round_trip(engine, dir_ / "single.swap");
  }
  o.single_submit = false;
  o.overlap_events = false;
  AioEngine engine(o);
  round_trip(engine, dir_ / "batched.swap");
}

// A request the file system moves only in part (here injected: the third write moves half its
// bytes in its first call) is completed by asking for the rest, not reported as an error.
TEST_P(AioBackend, AShortTransferIsCompletedByAskingForTheRest) {
  auto faults = std::make_shared<IoFaults>(IoFaults::Kind::ShortWrite, 3);
  AioEngine engine(options(64 * KiB, 4, 2), faults);
  round_trip(engine, dir_ / "short.swap");
  EXPECT_TRUE(faults->hit());
}

TEST_P(AioBackend, ReadCompletesWhileTheCallerComputes) {
  AioEngine engine(options(256 * KiB, 4));
  const int64_t bytes = 8 * MiB;
  AlignedBuffer source(bytes), target(bytes);
  fill(source.data(), bytes, 3);
  std::memset(target.data(), 0, size_t(bytes));
  const int file = engine.open(dir_ / "progress.swap", bytes);
  engine.wait(engine.write(file, 0, source.data(), bytes));
  // Let the I/O threads run dry and go idle: the read below must wake them by itself.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const AioEngine::Ticket ticket = engine.read(file, 0, target.data(), bytes);
  // "Compute" without calling wait(): the I/O threads must finish the read on their own.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  volatile double sink = 0;
  while (!engine.done(ticket) && std::chrono::steady_clock::now() < deadline)
    for (int i = 0; i < 100000; ++i) sink = sink + double(i) * 0.5;
  ASSERT_TRUE(engine.done(ticket)) << "the read made no progress while nobody waited for it";
  engine.wait(ticket);
  EXPECT_EQ(std::memcmp(source.data(), target.data(), size_t(bytes)), 0);
}

TEST_P(AioBackend, MisalignedOrOutOfRangeArgumentsAreRefused) {
  AioEngine engine(options());
  const int file = engine.open(dir_ / "b.swap", 64 * KiB);
  AlignedBuffer buffer(64 * KiB);
  char* data = static_cast<char*>(buffer.data());
  const auto refused = [&](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error mentioning '" << needle << "'";
    } catch (const IoError& e) {
      ADD_FAILURE() << "an IoError, expected a refusal before any I/O: " << e.what();
    } catch (const zt::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&] { engine.read(file, 100, data, 4096); }, "offset 100");
  refused([&] { engine.write(file, 0, data, 100); }, "length 100");
  refused([&] { engine.read(file, 0, data + 1, 4096); }, "multiple of 4096");
  refused([&] { engine.write(file, -4096, data, 4096); }, "offset -4096");
  refused([&] { engine.read(file, 60 * KiB, data, 8 * KiB); }, "beyond the file's size");
  refused([&] { engine.read(file + 1, 0, data, 4096); }, "no such file");
  refused([&] { engine.wait(12345); }, "never issued");
  EXPECT_EQ(engine.stats().requests, 0);
  // A zero-length request is done at once.
  const AioEngine::Ticket empty = engine.read(file, 0, data, 0);
  EXPECT_TRUE(engine.done(empty));
  engine.wait(empty);
}

TEST_P(AioBackend, InjectedReadFailureNamesFileOffsetAndErrno) {
  auto faults = std::make_shared<IoFaults>(IoFaults::Kind::Read, 3);
  AioEngine engine(options(64 * KiB, 4), faults);
  const fs::path path = dir_ / "exp_avg.swap";
  const int file = engine.open(path, 512 * KiB);
  AlignedBuffer buffer(512 * KiB);
  fill(buffer.data(), 512 * KiB, 1);
  engine.wait(engine.write(file, 0, buffer.data(), 512 * KiB));
  EXPECT_FALSE(faults->hit());
  const AioEngine::Ticket ticket = engine.read(file, 0, buffer.data(), 512 * KiB);
  try {
    engine.wait(ticket);
    FAIL() << "the injected read failure was not reported";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(what.find("reading '" + path.string() + "' at offset 131072 (65536 bytes)"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string(std::strerror(EIO)) + " (errno 5)"), std::string::npos) << what;
  }
  EXPECT_TRUE(faults->hit());
  engine.wait(ticket);  // reported once
  // The engine stays usable: only the 3rd read request was to fail.
  engine.wait(engine.read(file, 0, buffer.data(), 512 * KiB));
}

// Tickets nobody waits for (the caller polls done()) give
// their slots back once done: the queue stays at the size of what is in flight, and a failure
// among them is still reported once, by wait() of its ticket or by wait_all().
TEST_P(AioBackend, TicketsNobodyWaitsForDoNotGrowTheQueue) {
  auto faults = std::make_shared<IoFaults>(IoFaults::Kind::Write, 1500);
  AioEngine engine(options(4 * KiB, 4, 2), faults);
  const int file = engine.open(dir_ / "unwaited.swap", 64 * KiB);
  AlignedBuffer buffer(64 * KiB);
  fill(buffer.data(), 64 * KiB, 3);
  constexpr int kBatches = 250, kPerBatch = 16;  // 4000 tickets, at most 16 issued at once
  AioEngine::Ticket failed = 0;
  for (int b = 0; b < kBatches; ++b) {
    AioEngine::Ticket first = 0, last = 0;
    for (int i = 0; i < kPerBatch; ++i) {
      last = engine.write(file, int64_t(i) * 4 * KiB, static_cast<char*>(buffer.data()) + i * 4 * KiB, 4 * KiB);
      if (i == 0) first = last;
    }
    for (AioEngine::Ticket t = first; t <= last; ++t)  // they finish in any order
      while (!engine.done(t)) std::this_thread::yield();
    if (failed == 0 && faults->hit()) failed = last;  // the 1500th request fails, in this batch
  }
  EXPECT_LE(engine.stats().ticket_slots, 64) << "the ticket queue grew with tickets nobody waited for";
  ASSERT_TRUE(faults->hit());
  ASSERT_NE(failed, 0);
  try {
    engine.wait_all();
    FAIL() << "the failure of a ticket nobody waited for was not reported";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("writing '"), std::string::npos) << e.what();
  }
  engine.wait_all();  // reported once
  EXPECT_EQ(engine.stats().bytes_written, int64_t(kBatches * kPerBatch - 1) * 4 * KiB);
}

TEST_P(AioBackend, InjectedWriteFailureNamesFileOffsetAndErrno) {
  auto faults = std::make_shared<IoFaults>(IoFaults::Kind::Write, 2);
  AioEngine engine(options(64 * KiB, 4), faults);
  const fs::path path = dir_ / "fp32.swap";
  const int file = engine.open(path, 256 * KiB);
  AlignedBuffer buffer(256 * KiB);
  fill(buffer.data(), 256 * KiB, 2);
  engine.write(file, 0, buffer.data(), 256 * KiB);
  try {
    engine.wait_all();
    FAIL() << "the injected write failure was not reported";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(what.find("writing '" + path.string() + "' at offset 65536 (65536 bytes)"), std::string::npos) << what;
    EXPECT_NE(what.find("(errno 5)"), std::string::npos) << what;
  }
  EXPECT_TRUE(faults->hit());
  engine.wait_all();  // nothing left to report
}

TEST_P(AioBackend, InjectedDiskFullFailsEveryWriteFromTheKth) {
  auto faults = std::make_shared<IoFaults>(IoFaults::Kind::DiskFull, 3);
  AioEngine engine(options(64 * KiB, 2), faults);
  const fs::path path = dir_ / "exp_avg_sq.swap";
  const int file = engine.open(path, 512 * KiB);
  AlignedBuffer buffer(512 * KiB);
  fill(buffer.data(), 512 * KiB, 4);
  engine.wait(engine.write(file, 0, buffer.data(), 128 * KiB));  // requests 1 and 2
  EXPECT_FALSE(faults->hit());
  for (int64_t offset : {128 * KiB, 256 * KiB}) {
    try {
      engine.wait(engine.write(file, offset, buffer.data(), 64 * KiB));
      FAIL() << "a write after the disk became full succeeded";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.error_number(), ENOSPC);
      EXPECT_NE(what.find("writing '" + path.string() + "' at offset " + std::to_string(offset) + " (65536 bytes): " +
                          std::strerror(ENOSPC) + " (errno 28)"),
                std::string::npos)
          << what;
    }
  }
  EXPECT_TRUE(faults->hit());
  engine.wait(engine.read(file, 0, buffer.data(), 128 * KiB));  // reads still work
}

TEST_P(AioBackend, ShortReadIsAnErrorNamingWhatWasTransferred) {
  AioEngine engine(options(64 * KiB, 4));
  const fs::path path = dir_ / "short.swap";
  const int file = engine.open(path, 256 * KiB);
  // Another process shrank the file behind the engine's back.
  ASSERT_EQ(::truncate(path.c_str(), 64 * KiB), 0);
  AlignedBuffer buffer(256 * KiB);
  try {
    engine.wait(engine.read(file, 0, buffer.data(), 256 * KiB));
    FAIL() << "a read past the end of the file succeeded";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(what.find("reading '" + path.string() + "' at offset 65536 (65536 bytes): short read, 0 of 65536 bytes"),
              std::string::npos)
        << what;
  }
}

TEST_P(AioBackend, FullDiskWhenCreatingIsAnIoErrorNamingTheFile) {
  // A real ENOSPC from fallocate, without filling a shared disk: tmpfs refuses at once a
  // reservation larger than its whole size (ext4 or XFS would first allocate what is free).
  const fs::path shm = "/dev/shm";
  struct statfs fsinfo {};
  if (::statfs(shm.c_str(), &fsinfo) != 0 || fsinfo.f_type != TMPFS_MAGIC || fsinfo.f_blocks == 0)
    GTEST_SKIP() << "needs /dev/shm as a tmpfs with a size limit to provoke ENOSPC safely";
  AioEngine engine(options());
  const int64_t too_much = int64_t(fsinfo.f_blocks) * int64_t(fsinfo.f_bsize) + 1024 * MiB;
  const fs::path path = shm / ("zerotrain-io-test-" + std::to_string(::getpid()) + ".swap");
  try {
    engine.open(path, too_much);
    FAIL() << "reserving more than the file system holds succeeded";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.error_number(), ENOSPC) << what;
    EXPECT_NE(what.find("allocating '" + path.string() + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string(std::strerror(ENOSPC)) + " (errno 28)"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(path));
}

// Destroying the engine with writes queued returns, and no transfer outlives it: the buffer
// changed afterwards never reaches the file, which no longer changes.
TEST_P(AioBackend, DestructionWithRequestsInFlightReturns) {
  AlignedBuffer buffer(4 * MiB);
  fill(buffer.data(), 4 * MiB, 5);
  const fs::path path = dir_ / "inflight.swap";
  {
    AioEngine engine(options(64 * KiB, 8, 2));
    const int file = engine.open(path, 4 * MiB);
    for (int i = 0; i < 40; ++i) engine.write(file, 0, buffer.data(), 4 * MiB);
  }
  auto read_file = [&] {
    std::vector<char> bytes(4 * MiB);
    std::ifstream in(path, std::ios::binary);
    in.read(bytes.data(), std::streamsize(bytes.size()));
    EXPECT_EQ(in.gcount(), std::streamsize(bytes.size()));
    return bytes;
  };
  const std::vector<char> after = read_file();
  fill(buffer.data(), 4 * MiB, 9);  // what a transfer still running would now carry
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(read_file(), after) << "the file changed after the engine was destroyed";
  // Each 64 KiB block holds the written values or the zeros of the fresh file, never the new ones.
  std::vector<char> written(4 * MiB);
  fill(written.data(), 4 * MiB, 5);
  const std::vector<char> zeros(64 * KiB, 0);
  for (int64_t at = 0; at < 4 * MiB; at += 64 * KiB) {
    const bool as_written = std::memcmp(after.data() + at, written.data() + at, 64 * KiB) == 0;
    const bool untouched = std::memcmp(after.data() + at, zeros.data(), 64 * KiB) == 0;
    EXPECT_TRUE(as_written || untouched) << "block at " << at << " holds neither the written values nor zeros";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, AioBackend, ::testing::Values(Backend::Posix, Backend::IoUring), backend_label);

TEST(AioEngine, OptionsOutOfRangeNameTheAioKey) {
  const auto refused = [](AioOptions o, const std::string& key) {
    try {
      AioEngine engine(o);
      ADD_FAILURE() << "accepted " << key;
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  AioOptions o;
  o.block_size = 1000;
  refused(o, "aio.block_size");
  o = {};
  o.queue_depth = 0;
  refused(o, "aio.queue_depth");
  o = {};
  o.thread_count = 0;
  refused(o, "aio.thread_count");
}

TEST(AioEngine, OptionsFromConfig) {
  zt::AioConfig config;
  config.block_size = 4 * MiB;
  config.queue_depth = 32;
  config.thread_count = 2;
  config.single_submit = true;
  config.overlap_events = false;
  const AioOptions o = aio_options_from(config);
  EXPECT_EQ(o.block_size, 4 * MiB);
  EXPECT_EQ(o.queue_depth, 32);
  EXPECT_EQ(o.thread_count, 2);
  EXPECT_TRUE(o.single_submit);
  EXPECT_FALSE(o.overlap_events);
}

TEST(AioEngine, AlignedBufferIsAlignedRoundedAndMovable) {
  AlignedBuffer a(5000);
  EXPECT_EQ(a.size(), 8192);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kAlignment, 0u);
  void* data = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(align_up(0), 0);
  EXPECT_EQ(align_up(1), 4096);
  EXPECT_EQ(align_up(4096), 4096);
}

TEST(AioEngine, EnvironmentChoosesBackendAndFaults) {
  const TempDir dir_tmp("io-env");
  const fs::path& dir = dir_tmp.path;
  {
    ScopedEnv backend("ZT_IO_BACKEND", "posix");
    AioEngine engine(AioOptions{});
    EXPECT_STREQ(engine.backend_name(), "pread/pwrite");
  }
  {
    ScopedEnv backend("ZT_IO_BACKEND", "uring");
    try {
      AioEngine engine(AioOptions{});
      FAIL() << "ZT_IO_BACKEND=uring accepted";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ZT_IO_BACKEND"), std::string::npos) << e.what();
    }
  }
  {
    // No faults object given: the engine takes ZT_IO_FAULT.
    ScopedEnv fault("ZT_IO_FAULT", "write:1");
    AioOptions o;
    o.block_size = 64 * KiB;
    AioEngine engine(o);
    const int file = engine.open(dir / "env.swap", 64 * KiB);
    AlignedBuffer buffer(64 * KiB);
    EXPECT_THROW(engine.wait(engine.write(file, 0, buffer.data(), 64 * KiB)), IoError);
  }
}

TEST(IoFaults, ParsesTheEnvironmentVariable) {
  {
    ScopedEnv unset("ZT_IO_FAULT", nullptr);
    EXPECT_EQ(io_faults_from_environment(), nullptr);
  }
  const std::vector<std::pair<std::string, IoFaults::Kind>> good = {
      {"read:3", IoFaults::Kind::Read}, {"write:1", IoFaults::Kind::Write}, {"full:12", IoFaults::Kind::DiskFull},
      {"short:2", IoFaults::Kind::ShortWrite}};
  for (const auto& [text, kind] : good) {
    ScopedEnv set("ZT_IO_FAULT", text.c_str());
    const auto faults = io_faults_from_environment();
    ASSERT_NE(faults, nullptr) << text;
    EXPECT_EQ(faults->kind, kind) << text;
    EXPECT_EQ(faults->k, std::stoi(text.substr(text.find(':') + 1))) << text;
    EXPECT_FALSE(faults->hit());
  }
  for (const char* text : {"read", "read:", "read:x", "read:0", "read:-1", "read:3x", "boom:1", ":1", "write:99999999999"}) {
    ScopedEnv set("ZT_IO_FAULT", text);
    try {
      io_faults_from_environment();
      ADD_FAILURE() << "accepted ZT_IO_FAULT=" << text;
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ZT_IO_FAULT"), std::string::npos) << e.what();
    }
  }
}

TEST(IoFaults, CountsEachKindFromOne) {
  IoFaults read(IoFaults::Kind::Read, 2);
  EXPECT_EQ(read.next_write_error(), 0);
  EXPECT_EQ(read.next_read_error(), 0);
  EXPECT_FALSE(read.hit());
  EXPECT_EQ(read.next_read_error(), EIO);
  EXPECT_TRUE(read.hit());
  EXPECT_EQ(read.next_read_error(), 0);
  IoFaults full(IoFaults::Kind::DiskFull, 2);
  EXPECT_EQ(full.next_read_error(), 0);
  EXPECT_EQ(full.next_write_error(), 0);
  EXPECT_EQ(full.next_write_error(), ENOSPC);
  EXPECT_EQ(full.next_write_error(), ENOSPC);
}

TEST(SequentialRate, MeasuresAndRemovesItsFile) {
  const TempDir dir_tmp("io-rate");
  const fs::path& dir = dir_tmp.path;
  const SequentialRate rate = measure_sequential_rate(dir, 4 * MiB, 1 * MiB);
  EXPECT_GT(rate.write_gbps, 0.0);
  EXPECT_GT(rate.read_gbps, 0.0);
  EXPECT_TRUE(fs::is_empty(dir));
}

// ---- preflight ----

const std::string kKey = "zero_optimization.offload_optimizer.nvme_path";

std::string preflight_error(const fs::path& root, int64_t required) {
  try {
    preflight_swap_path(root, required, kKey);
  } catch (const zt::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(SwapPreflight, AcceptsAWritableDirectoryWithRoomAndLeavesNothing) {
  const TempDir dir_tmp("io-pre");
  const fs::path& dir = dir_tmp.path;
  EXPECT_EQ(preflight_error(dir, 1 * MiB), "");
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(SwapPreflight, MissingPath) {
  const TempDir missing_tmp("io-pre");
  const fs::path missing = missing_tmp.path / "nvme";
  const std::string what = preflight_error(missing, 0);
  EXPECT_NE(what.find(kKey + ": '" + missing.string() + "' does not exist"), std::string::npos) << what;
}

TEST(SwapPreflight, RegularFile) {
  const TempDir file_tmp("io-pre");
  const fs::path file = file_tmp.path / "nvme";
  std::ofstream(file) << "x";
  const std::string what = preflight_error(file, 0);
  EXPECT_NE(what.find(kKey + ": '" + file.string() + "' is not a directory"), std::string::npos) << what;
  EXPECT_NE(what.find("found a regular file"), std::string::npos) << what;
}

TEST(SwapPreflight, UnwritableDirectory) {
  const TempDir tmp("io-pre");
  fs::path dir;
  if (::geteuid() == 0) {
    // root bypasses permission bits; /proc refuses new files whoever asks.
    dir = "/proc";
  } else {
    dir = tmp.path / "readonly";
    fs::create_directory(dir);
    fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
  }
  const std::string what = preflight_error(dir, 0);
  if (::geteuid() != 0) fs::permissions(dir, fs::perms::owner_all);
  EXPECT_NE(what.find(kKey + ": cannot create a file in '" + dir.string() + "'"), std::string::npos) << what;
  EXPECT_NE(what.find("expected a writable directory"), std::string::npos) << what;
}

TEST(SwapPreflight, TooLittleSpaceSaysBothAmounts) {
  const TempDir dir_tmp("io-pre");
  const fs::path& dir = dir_tmp.path;
  const std::string what = preflight_error(dir, int64_t(1) << 60);
  EXPECT_NE(what.find(kKey + ": '" + dir.string() + "' has "), std::string::npos) << what;
  EXPECT_NE(what.find(" free, expected at least 1073741824.0 GiB"), std::string::npos) << what;
}

// ---- swap directory ----

bool lock_is_held(const fs::path& dir) {
  const int fd = ::open((dir / "lock").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

// Forks a child that creates a swap directory with a 1 MiB file in it, sends its path through a
// pipe and then either dies without cleaning up (hold = false) or waits until `release` is
// closed. Returns the child's pid and the path.
std::pair<pid_t, fs::path> child_swap_directory(const fs::path& root, int rank, bool hold, int* release_fd) {
  int report[2], release[2];
  if (::pipe(report) != 0 || ::pipe(release) != 0) return {-1, {}};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(report[0]);
    ::close(release[1]);
    try {
      SwapDirectory swap(root, rank, [](const std::string&) {});
      std::ofstream(swap.file("exp_avg")) << std::string(1 << 20, 'x');
      const std::string path = swap.path().string() + "\n";
      if (::write(report[1], path.data(), path.size()) != ssize_t(path.size())) ::_exit(3);
      if (hold) {
        char c;
        while (::read(release[0], &c, 1) > 0) {
        }
      }
      ::_exit(0);  // with `swap` alive: no destructor runs, the directory stays, as after a kill
    } catch (...) {
      ::_exit(4);
    }
  }
  ::close(report[1]);
  ::close(release[0]);
  std::string path;
  char c;
  while (::read(report[0], &c, 1) == 1 && c != '\n') path += c;
  ::close(report[0]);
  *release_fd = release[1];
  return {pid, path};
}

int wait_child(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(SwapDirectory, CreatedLockedAndRemoved) {
  const TempDir root_tmp("io-swap");
  const fs::path& root = root_tmp.path;
  fs::path path;
  {
    SwapDirectory swap(root, 3);
    path = swap.path();
    EXPECT_EQ(path, root / "zerotrain-swap" / ("rank3-pid" + std::to_string(::getpid())));
    EXPECT_TRUE(fs::is_directory(path));
    EXPECT_EQ(swap.file("exp_avg"), path / "exp_avg.swap");
    std::ofstream(swap.file("exp_avg")) << "data";
    EXPECT_TRUE(lock_is_held(path));
    SwapDirectory second(root, 3);  // the same rank twice in one process: its own directory
    EXPECT_EQ(second.path(), root / "zerotrain-swap" / ("rank3-pid" + std::to_string(::getpid()) + "-1"));
    EXPECT_TRUE(fs::exists(path / "exp_avg.swap"));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(root / "zerotrain-swap"));  // empty: removed too
}

TEST(SwapDirectory, StaleDirectoryOfADeadRunIsRemovedAndReported) {
  const TempDir root_tmp("io-swap");
  const fs::path& root = root_tmp.path;
  int release = -1;
  const auto [pid, stale] = child_swap_directory(root, 0, false, &release);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(wait_child(pid), 0);
  ::close(release);
  ASSERT_TRUE(fs::exists(stale / "exp_avg.swap"));
  // Things that are not swap directories stay, whatever their state.
  const fs::path base = root / "zerotrain-swap";
  std::ofstream(base / "notes.txt") << "keep";
  std::ofstream(base / "rank1-pid2") << "a file with a swap directory's name";
  fs::create_directories(base / "rank0-pid12x");
  fs::create_directories(base / "rankA-pid1");
  std::ofstream(base / "rank0-pid12x" / "lock") << "";

  std::vector<std::string> notes;
  {
    SwapDirectory swap(root, 1, [&](const std::string& line) { notes.push_back(line); });
    EXPECT_FALSE(fs::exists(stale));
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_EQ(notes[0], "removed swap files of a run that ended without cleaning up: " + stale.string() + " (1.0 MiB)");
  }
  EXPECT_TRUE(fs::exists(base / "notes.txt"));
  EXPECT_TRUE(fs::is_regular_file(base / "rank1-pid2"));
  EXPECT_TRUE(fs::exists(base / "rank0-pid12x" / "lock"));
  EXPECT_TRUE(fs::is_directory(base / "rankA-pid1"));
}

TEST(SwapDirectory, DirectoryOfALiveRunIsKept) {
  const TempDir root_tmp("io-swap");
  const fs::path& root = root_tmp.path;
  int release = -1;
  const auto [pid, live] = child_swap_directory(root, 0, true, &release);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(fs::exists(live / "exp_avg.swap"));
  std::vector<std::string> notes;
  {
    SwapDirectory swap(root, 1, [&](const std::string& line) { notes.push_back(line); });
    EXPECT_TRUE(fs::exists(live / "exp_avg.swap"));
    EXPECT_TRUE(notes.empty());
  }
  EXPECT_TRUE(fs::exists(live / "exp_avg.swap"));
  ::close(release);  // the child ends, without cleaning up
  ASSERT_EQ(wait_child(pid), 0);
  SwapDirectory after(root, 1, [&](const std::string& line) { notes.push_back(line); });
  EXPECT_FALSE(fs::exists(live));
  EXPECT_EQ(notes.size(), 1u);
}

TEST(SwapDirectory, ConcurrentRunsUnderOneRoot) {
  const TempDir root_tmp("io-swap");
  const fs::path& root = root_tmp.path;
  std::vector<pid_t> children;
  for (int rank = 0; rank < 4; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        for (int i = 0; i < 150; ++i) {
          SwapDirectory swap(root, rank, [](const std::string&) { ::_exit(5); });  // nothing is stale
          std::ofstream(swap.file("p")) << i;
          std::ifstream in(swap.file("p"));
          int back = -1;
          in >> back;
          if (back != i) ::_exit(6);
        }
      } catch (...) {
        ::_exit(4);
      }
      ::_exit(0);
    }
    ASSERT_GT(pid, 0);
    children.push_back(pid);
  }
  for (pid_t pid : children) EXPECT_EQ(wait_child(pid), 0);
  EXPECT_FALSE(fs::exists(root / "zerotrain-swap"));
}

}  // namespace
