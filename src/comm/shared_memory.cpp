// Shared-memory collectives for ranks on one machine (docs/comm.md "Shared memory").
//
// The segment holds, per rank, three round counters and two data slots of kSlotBytes. A
// collective is cut into rounds of at most one slot per rank; round c uses buffer c % 2 of every
// slot, so a rank may fill round c + 1 while its peers still read round c. In a round each rank
// copies its part into its own slot and publishes `posted = c`; the others read it once they see
// that, and publish `consumed = c` when done, which frees the buffer for round c + 2. A reduction
// adds a middle step: rank r sums its share of the round over every slot, in rank order, into its
// own slot and publishes `reduced = c`; every rank then copies each rank's summed share out. The
// slots are small enough to stay in cache between the writer and the readers, so a byte costs
// about one copy from and one into the caller's memory, against several through loopback TCP.
//
// Waiting spins briefly, then sleeps on a futex of the counter it waits for; a counter's writer
// wakes its sleepers. Counters wrap (compared by difference), so a run never runs out of rounds.
#include "comm/shared_memory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "zerotrain/error.h"

namespace zt {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x7a7473686d303031ULL;  // "ztshm001"
constexpr int64_t kPage = 4096;

// What a rank is doing in a round: every rank must be in the same collective (the n-th of the
// transport, of the same kind and size), or the ranks issued different collectives.
struct Signature {
  uint64_t collective = 0;  // 1-based count of this transport's collectives
  int64_t bytes = 0;        // this rank's payload
  uint32_t kind = 0;        // index into kKindNames
  int32_t detail = 0;       // the broadcast's root; the reduction and dtype
};
constexpr const char* kKindNames[] = {"?", "all_gather", "broadcast", "all_reduce", "reduce_scatter"};

struct alignas(64) RankWords {
  Signature signature[2];  // by round parity: written before `posted`, stable until `consumed`
  std::atomic<uint32_t> posted{0};
  std::atomic<uint32_t> reduced{0};
  std::atomic<uint32_t> consumed{0};
  int32_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22: tells a pid reused by another process apart
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain 32-bit integers");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

struct Header {
  uint64_t magic = 0;
  uint64_t token = 0;
  int64_t world = 0;
  int64_t slot_bytes = 0;
};

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

int64_t words_offset() { return round_up(int64_t(sizeof(Header)), 64); }
int64_t slots_offset(int world) { return round_up(words_offset() + int64_t(world) * int64_t(sizeof(RankWords)), kPage); }
int64_t segment_bytes(int world) {
  return slots_offset(world) + int64_t(world) * 2 * SharedMemoryTransport::kSlotBytes;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// 0 when the process is gone or unreadable.
uint64_t process_start_time(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string state;
  fields >> state;
  if (state == "Z" || state == "X") return 0;  // exited, not yet reaped
  std::string skip;
  for (int field = 4; field < 22; ++field) fields >> skip;  // fields 4..21
  uint64_t start = 0;
  fields >> start;
  return start;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool reduced_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

at::ScalarType accumulation_type(at::ScalarType t) {
  if (reduced_precision(t)) return at::kFloat;
  return t;
}

}  // namespace

struct SharedMemoryTransport::Segment {
  void* base = nullptr;
  int64_t bytes = 0;
  int world = 0;
  Header* header() const { return static_cast<Header*>(base); }
  RankWords& words(int rank) const {
    return reinterpret_cast<RankWords*>(static_cast<char*>(base) + words_offset())[rank];
  }
  char* slot(int rank, int64_t round) const {
    return static_cast<char*>(base) + slots_offset(world) + (int64_t(rank) * 2 + (round & 1)) * kSlotBytes;
  }
  ~Segment() {
    if (base != nullptr) ::munmap(base, size_t(bytes));
  }
};

namespace {

class SharedMemoryWork final : public c10d::Work {
 public:
  bool isCompleted() override {
    std::lock_guard lock(mutex_);
    return done_;
  }
  bool isSuccess() const override {
    std::lock_guard lock(mutex_);
    return done_ && !error_;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    auto finished = [&] { return done_; };
    if (timeout.count() <= 0) {
      cv_done_.wait(lock, finished);
    } else if (!cv_done_.wait_for(lock, timeout, finished)) {
      throw std::runtime_error(fmt::format("timed out after {:.1f} s in the shared-memory collective",
                                           double(timeout.count()) / 1000.0));
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  void complete(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_done_.notify_all();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_done_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

struct SharedMemoryTransport::Worker {
  Worker(Segment& segment, int rank, int world, std::chrono::milliseconds timeout, std::string who, bool liveness)
      : segment(segment), rank(rank), world(world), timeout(timeout), who(std::move(who)), check_liveness(liveness) {
    thread = std::thread([this] { loop(); });
  }
  ~Worker() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    stopping.store(true);
    cv.notify_all();
    thread.join();
  }

  using Op = std::function<void()>;
  c10::intrusive_ptr<c10d::Work> enqueue(Op op) {
    auto work = c10::make_intrusive<SharedMemoryWork>();
    {
      std::lock_guard lock(mutex);
      queue.emplace_back(std::move(op), work);
    }
    cv.notify_one();
    return work;
  }

  void loop() {
    // The worker's own ATen calls (the reductions) run on this thread alone, beside the rank's
    // compute threads.
    omp_set_num_threads(1);
    while (true) {
      std::pair<Op, c10::intrusive_ptr<SharedMemoryWork>> item;
      {
        std::unique_lock lock(mutex);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        item = std::move(queue.front());
        queue.pop_front();
      }
      std::exception_ptr error;
      if (!failure.empty()) {
        error = std::make_exception_ptr(std::runtime_error("an earlier shared-memory collective failed: " + failure));
      } else if (stop) {
        error = std::make_exception_ptr(std::runtime_error("the communicator was destroyed before the collective ran"));
      } else {
        try {
          deadline = Clock::now() + timeout;
          item.first();
        } catch (const std::exception& e) {
          failure = e.what();
          error = std::current_exception();
        }
      }
      item.first = nullptr;  // drops the tensors before the waiter sees the collective complete
      item.second->complete(error);
    }
  }

  // ---- rounds

  // Until every other rank's `counter` has reached `round` (its low 32 bits, compared by
  // difference); round 0 or below: nothing to wait for.
  void await(std::atomic<uint32_t> RankWords::*counter, int64_t round, const char* what) {
    if (round <= 0) return;
    const uint32_t target = uint32_t(round);
    for (int q = 0; q < world; ++q) {
      if (q == rank) continue;
      std::atomic<uint32_t>& word = segment.words(q).*counter;
      int spins = 0;
      while (true) {
        const uint32_t seen = word.load(std::memory_order_acquire);
        if (int32_t(seen - target) >= 0) break;
        if (++spins < 256) {
          cpu_relax();
          continue;
        }
        if (stopping.load()) throw std::runtime_error("the communicator was destroyed during the collective");
        const auto now = Clock::now();
        if (now >= deadline)
          throw std::runtime_error(fmt::format("timed out after {:.1f} s waiting for rank {} to {} (shared memory)",
                                               double(timeout.count()) / 1000.0, q, what));
        if (check_liveness && now >= next_liveness_check) {
          next_liveness_check = now + std::chrono::milliseconds(200);
          const RankWords& peer = segment.words(q);
          if (process_start_time(peer.pid) != peer.start_time)
            throw std::runtime_error(fmt::format(
                "rank {} (process {}) exited while this rank waited for it to {} (shared memory)", q, peer.pid, what));
        }
        timespec nap{0, 10'000'000};  // wakes now and then to watch the deadline and the peer
        futex(&word, FUTEX_WAIT, seen, &nap);
      }
    }
  }

  void publish(std::atomic<uint32_t> RankWords::*counter, int64_t round) {
    std::atomic<uint32_t>& word = segment.words(rank).*counter;
    word.store(uint32_t(round), std::memory_order_release);
    futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
  }

  // Publishes this rank's part of round c and waits for every other rank's, which must belong to
  // the same collective: ranks that issued different collectives fail here instead of pairing
  // their data silently.
  void post_and_check(int64_t c, const Signature& mine, const char* what) {
    segment.words(rank).signature[c & 1] = mine;
    publish(&RankWords::posted, c);
    await(&RankWords::posted, c, what);
    for (int q = 0; q < world; ++q) {
      const Signature& theirs = segment.words(q).signature[c & 1];
      if (theirs.collective != mine.collective || theirs.kind != mine.kind || theirs.bytes != mine.bytes ||
          theirs.detail != mine.detail)
        throw std::runtime_error(fmt::format(
            "rank {} is in another collective than this rank: its shared-memory collective {} ({}, {} bytes), "
            "this rank's {} ({}, {} bytes) (the ranks issued different collectives)",
            q, theirs.collective, kKindNames[theirs.kind < 5 ? theirs.kind : 0], theirs.bytes, mine.collective,
            kKindNames[mine.kind], mine.bytes));
    }
  }

  Signature next_collective(uint32_t kind, int64_t bytes, int32_t detail) {
    return Signature{++collectives, bytes, kind, detail};
  }

  // Starts the next round: this rank's buffer of it is free once every rank has read it two
  // rounds ago.
  int64_t begin_round() {
    ++round;
    await(&RankWords::consumed, round - 2, "finish reading the round before the last");
    return round;
  }

  // dst[i] = op over ranks q (in rank order) of srcs[q][i]; dst may be one of the sources.
  void reduce(void* dst, const std::vector<const char*>& srcs, int64_t count, at::ScalarType dtype, ReduceOp op) {
    if (count == 0) return;
    const auto options = at::TensorOptions().dtype(dtype);
    auto source = [&](int q) { return at::from_blob(const_cast<char*>(srcs[size_t(q)]), {count}, options); };
    at::Tensor out = at::from_blob(dst, {count}, options);
    if (world == 2) {
      // One rounding for every dtype: ATen adds bf16/fp16 in fp32.
      if (op == ReduceOp::Max) {
        at::maximum_out(out, source(0), source(1));
      } else {
        at::add_out(out, source(0), source(1));
        if (op == ReduceOp::Avg) out.div_(world);
      }
      return;
    }
    const at::ScalarType acc_type = accumulation_type(dtype);
    const int64_t acc_bytes = count * int64_t(c10::elementSize(acc_type));
    if (int64_t(scratch.size()) < acc_bytes) scratch.resize(size_t(acc_bytes));
    at::Tensor acc = at::from_blob(scratch.data(), {count}, at::TensorOptions().dtype(acc_type));
    acc.copy_(source(0));
    for (int q = 1; q < world; ++q) {
      if (op == ReduceOp::Max) {
        at::maximum_out(acc, acc, source(q));
      } else {
        acc.add_(source(q));
      }
    }
    if (op == ReduceOp::Avg) acc.div_(world);
    out.copy_(acc);
  }

  void all_gather(const char* in, char* out, int64_t bytes) {
    const Signature mine = next_collective(1, bytes, 0);
    char* own = out + int64_t(rank) * bytes;
    if (own != in) std::memcpy(own, in, size_t(bytes));
    for (int64_t off = 0; off < bytes; off += kSlotBytes) {
      const int64_t len = std::min(kSlotBytes, bytes - off);
      const int64_t c = begin_round();
      std::memcpy(segment.slot(rank, c), in + off, size_t(len));
      post_and_check(c, mine, "post its part of the all_gather");
      for (int k = 1; k < world; ++k) {
        const int q = (rank + k) % world;
        std::memcpy(out + int64_t(q) * bytes + off, segment.slot(q, c), size_t(len));
      }
      publish(&RankWords::consumed, c);
    }
  }

  void broadcast(char* data, int64_t bytes, int root) {
    const Signature mine = next_collective(2, bytes, root);
    for (int64_t off = 0; off < bytes; off += kSlotBytes) {
      const int64_t len = std::min(kSlotBytes, bytes - off);
      const int64_t c = begin_round();
      if (rank == root) std::memcpy(segment.slot(rank, c), data + off, size_t(len));
      post_and_check(c, mine, "post its part of the broadcast");
      if (rank != root) std::memcpy(data + off, segment.slot(root, c), size_t(len));
      publish(&RankWords::consumed, c);
    }
  }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, ReduceOp op) {
    const int64_t es = int64_t(c10::elementSize(dtype));
    const Signature mine = next_collective(3, numel * es, int32_t(op) * 256 + int32_t(dtype));
    const int64_t per_round = kSlotBytes / es;
    std::vector<const char*> srcs(static_cast<size_t>(world));
    for (int64_t off = 0; off < numel; off += per_round) {
      const int64_t len = std::min(per_round, numel - off);
      auto share = [&](int q) { return std::pair<int64_t, int64_t>(len * q / world, len * (q + 1) / world); };
      const int64_t c = begin_round();
      std::memcpy(segment.slot(rank, c), data + off * es, size_t(len * es));
      post_and_check(c, mine, "post its part of the all_reduce");
      const auto [lo, hi] = share(rank);
      for (int q = 0; q < world; ++q) srcs[size_t(q)] = segment.slot(q, c) + lo * es;
      reduce(segment.slot(rank, c) + lo * es, srcs, hi - lo, dtype, op);
      publish(&RankWords::reduced, c);
      await(&RankWords::reduced, c, "reduce its share of the all_reduce");
      for (int q = 0; q < world; ++q) {
        const auto [qlo, qhi] = share(q);
        std::memcpy(data + (off + qlo) * es, segment.slot(q, c) + qlo * es, size_t((qhi - qlo) * es));
      }
      publish(&RankWords::consumed, c);
    }
  }

  // `out` may be this rank's block of `in`.
  void reduce_scatter(const char* in, char* out, int64_t n, at::ScalarType dtype, ReduceOp op) {
    const int64_t es = int64_t(c10::elementSize(dtype));
    const Signature mine = next_collective(4, n * es, int32_t(op) * 256 + int32_t(dtype));
    const int64_t per_round = std::max<int64_t>(1, kSlotBytes / es / world);
    std::vector<const char*> srcs(static_cast<size_t>(world));
    for (int64_t off = 0; off < n; off += per_round) {
      const int64_t len = std::min(per_round, n - off);
      const int64_t c = begin_round();
      char* slot = segment.slot(rank, c);
      for (int d = 0; d < world; ++d)
        std::memcpy(slot + int64_t(d) * len * es, in + (int64_t(d) * n + off) * es, size_t(len * es));
      post_and_check(c, mine, "post its part of the reduce_scatter");
      for (int q = 0; q < world; ++q) srcs[size_t(q)] = segment.slot(q, c) + int64_t(rank) * len * es;
      reduce(out + off * es, srcs, len, dtype, op);
      publish(&RankWords::consumed, c);
    }
  }

  Segment& segment;
  const int rank, world;
  const std::chrono::milliseconds timeout;
  const std::string who;
  const bool check_liveness;

  // The worker thread's own.
  uint64_t collectives = 0;  // collectives run
  int64_t round = 0;  // rounds begun; the counters hold its low 32 bits
  Clock::time_point deadline;
  Clock::time_point next_liveness_check;
  std::vector<char> scratch;
  std::string failure;

  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::pair<Op, c10::intrusive_ptr<SharedMemoryWork>>> queue;
  bool stop = false;
  std::atomic<bool> stopping{false};
  std::thread thread;
};

namespace {

std::string get_string(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}

void set_string(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// Maps `fd` (of `bytes`) read-write; null on failure.
void* map(int fd, int64_t bytes) {
  void* base = ::mmap(nullptr, size_t(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return base == MAP_FAILED ? nullptr : base;
}

}  // namespace

std::unique_ptr<SharedMemoryTransport> SharedMemoryTransport::connect(c10d::Store& store, int rank, int world,
                                                                      std::chrono::milliseconds timeout,
                                                                      std::string who) {
  if (world < 2) return nullptr;
  auto segment = std::make_unique<Segment>();
  segment->world = world;
  segment->bytes = segment_bytes(world);
  std::string name;
  bool ok = false;
  if (rank == 0) {
    std::random_device random;
    const uint64_t token = (uint64_t(random()) << 32) ^ random() ^ uint64_t(::getpid());
    name = fmt::format("/zt-{}-{:016x}", ::getpid(), token);
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) {
      // Reserved now: a full /dev/shm is a fallback to Gloo here, not a SIGBUS mid-run.
      if (::posix_fallocate(fd, 0, segment->bytes) == 0) segment->base = map(fd, segment->bytes);
      ::close(fd);
    }
    if (segment->base != nullptr) {
      Header* h = segment->header();
      h->token = token;
      h->world = world;
      h->slot_bytes = kSlotBytes;
      for (int q = 0; q < world; ++q) new (&segment->words(q)) RankWords();
      std::atomic_thread_fence(std::memory_order_release);
      h->magic = kMagic;
      ok = true;
    } else if (fd >= 0) {
      ::shm_unlink(name.c_str());
    }
    set_string(store, "zt/shm/segment", ok ? fmt::format("{} {:016x}", name, token) : std::string());
  } else {
    const std::string published = get_string(store, "zt/shm/segment");
    const size_t space = published.find(' ');
    if (space != std::string::npos) {
      name = published.substr(0, space);
      const uint64_t token = std::stoull(published.substr(space + 1), nullptr, 16);
      const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
      struct stat st {};
      if (fd >= 0) {
        if (::fstat(fd, &st) == 0 && st.st_size == segment->bytes) segment->base = map(fd, segment->bytes);
        ::close(fd);
      }
      // A segment of this name on another machine's /dev/shm cannot carry this job's token.
      ok = segment->base != nullptr && segment->header()->magic == kMagic && segment->header()->token == token &&
           segment->header()->world == world && segment->header()->slot_bytes == kSlotBytes;
    }
  }
  if (ok) {
    RankWords& mine = segment->words(rank);
    mine.pid = int32_t(::getpid());
    mine.start_time = process_start_time(::getpid());
  }
  set_string(store, fmt::format("zt/shm/mapped/{}", rank), ok ? "1" : "0");
  bool all = true;
  for (int q = 0; q < world; ++q) all = get_string(store, fmt::format("zt/shm/mapped/{}", q)) == "1" && all;
  // Every rank has mapped it (or given up): the name is no longer needed.
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
  if (!all) return nullptr;
  return std::unique_ptr<SharedMemoryTransport>(
      new SharedMemoryTransport(std::move(segment), rank, world, timeout, std::move(who)));
}

SharedMemoryTransport::SharedMemoryTransport(std::unique_ptr<Segment> segment, int rank, int world,
                                             std::chrono::milliseconds timeout, std::string who)
    : segment_(std::move(segment)) {
  // A peer's pid tells whether it still runs only when this rank sees it as the peer itself does
  // (the same pid namespace): then a peer that exits fails the collective at once instead of at
  // the timeout.
  bool liveness = true;
  for (int q = 0; q < world; ++q) {
    const RankWords& peer = segment_->words(q);
    liveness = liveness && peer.start_time != 0 && process_start_time(peer.pid) == peer.start_time;
  }
  worker_ = std::make_unique<Worker>(*segment_, rank, world, timeout, std::move(who), liveness);
}

SharedMemoryTransport::~SharedMemoryTransport() { worker_.reset(); }

bool SharedMemoryTransport::reduces(at::ScalarType dtype, ReduceOp op) {
  if (at::isFloatingType(dtype)) return true;
  const bool integer = at::isIntegralType(dtype, /*includeBool=*/false);
  return integer && op != ReduceOp::Avg;
}

c10::intrusive_ptr<c10d::Work> SharedMemoryTransport::all_reduce(at::Tensor flat, ReduceOp op) {
  return worker_->enqueue([w = worker_.get(), flat, op] {
    w->all_reduce(static_cast<char*>(flat.data_ptr()), flat.numel(), flat.scalar_type(), op);
  });
}

c10::intrusive_ptr<c10d::Work> SharedMemoryTransport::reduce_scatter(at::Tensor input, at::Tensor output,
                                                                     ReduceOp op) {
  return worker_->enqueue([w = worker_.get(), input, output, op] {
    w->reduce_scatter(static_cast<const char*>(input.data_ptr()), static_cast<char*>(output.data_ptr()),
                      output.numel(), output.scalar_type(), op);
  });
}

c10::intrusive_ptr<c10d::Work> SharedMemoryTransport::all_gather(at::Tensor input, at::Tensor output) {
  return worker_->enqueue([w = worker_.get(), input, output] {
    w->all_gather(static_cast<const char*>(input.data_ptr()), static_cast<char*>(output.data_ptr()),
                  int64_t(input.nbytes()));
  });
}

c10::intrusive_ptr<c10d::Work> SharedMemoryTransport::broadcast(at::Tensor tensor, int root) {
  return worker_->enqueue([w = worker_.get(), tensor, root] {
    w->broadcast(static_cast<char*>(tensor.data_ptr()), int64_t(tensor.nbytes()), root);
  });
}

}  // namespace zt
