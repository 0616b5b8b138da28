// Flight recorder: a ring of fixed-size records, in a shared file mapping when the launcher asks
// for one (so that it survives any death of the rank without signal handlers), and the analysis
// that finds the rank that left the common sequence of collectives.
#include "comm/flight_recorder.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include "zerotrain/error.h"

namespace zt {

struct FlightRecorder::Header {
  char magic[8];               // "ZTFLIGHT"
  std::uint32_t version;       // 1
  std::uint32_t capacity;      // records that follow
  std::int32_t rank;
  std::int32_t world_size;
  std::uint32_t record_size;   // sizeof(FlightRecord)
  std::int32_t owner_pid;      // the process recording there; 0 once its recorder is gone
};
static_assert(sizeof(FlightRecorder::Header) == 32);

namespace {

constexpr char kMagic[8] = {'Z', 'T', 'F', 'L', 'I', 'G', 'H', 'T'};
constexpr std::size_t kRingBytes = 32 + sizeof(FlightRecord) * kFlightRecorderCapacity;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void copy_cut(char* dst, std::size_t size, std::string_view src) {
  std::size_t n = std::min(size - 1, src.size());
  std::memcpy(dst, src.data(), n);
  std::memset(dst + n, 0, size - n);
}

std::string field_text(const char* field, std::size_t size) { return std::string(field, strnlen(field, size)); }

std::string clock_text(std::int64_t ns) {
  std::time_t secs = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:02}:{:02}:{:02}.{:03}", tm.tm_hour, tm.tm_min, tm.tm_sec, (ns / 1000000) % 1000);
}

std::string bytes_text(std::uint64_t b) {
  if (b >= (1u << 20)) return fmt::format("{:.1f} MiB", double(b) / (1 << 20));
  if (b >= (1u << 10)) return fmt::format("{:.1f} KiB", double(b) / (1 << 10));
  return fmt::format("{} B", b);
}

}  // namespace

const char* to_string(CollectiveState state) {
  switch (state) {
    case CollectiveState::Issued: return "issued";
    case CollectiveState::Completed: return "completed";
    case CollectiveState::Failed: return "failed";
    case CollectiveState::TimedOut: return "timed-out";
  }
  return "unknown";
}

std::string FlightRecord::kind_text() const { return field_text(kind, sizeof(kind)); }
std::string FlightRecord::label_text() const { return field_text(label, sizeof(label)); }

FlightRecorder::FlightRecorder(int rank, int world_size) : rank_(rank), world_size_(world_size) {
  memory_.assign(kRingBytes, 0);
  mapping_ = memory_.data();
  mapping_size_ = memory_.size();
  std::memcpy(header()->magic, kMagic, sizeof(kMagic));
  header()->version = 1;
  header()->capacity = kFlightRecorderCapacity;
  header()->rank = rank;
  header()->world_size = world_size;
  header()->record_size = sizeof(FlightRecord);
}

namespace {
// Files mapped by live recorders of this process: a second communicator of the same rank, or a
// child process that inherited ZT_FLIGHT_RECORDER_FILE, must not take over (and truncate) a ring
// that is still being written.
std::mutex g_claimed_mutex;
std::set<std::string> g_claimed;
}  // namespace

FlightRecorder::FlightRecorder(int rank, int world_size, const std::string& path)
    : rank_(rank), world_size_(world_size), path_(path) {
  {
    std::lock_guard lock(g_claimed_mutex);
    if (!g_claimed.insert(path).second)
      throw Error(fmt::format("flight recorder: '{}' is in use by another communicator of this process", path));
  }
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    int err = errno;
    release_claim();
    throw Error(fmt::format("flight recorder: cannot create '{}': {}", path, std::strerror(err)));
  }
  Header existing{};
  if (::pread(fd, &existing, sizeof(existing), 0) == ssize_t(sizeof(existing)) &&
      std::memcmp(existing.magic, kMagic, sizeof(kMagic)) == 0 && existing.owner_pid > 0 &&
      existing.owner_pid != ::getpid() && ::kill(existing.owner_pid, 0) == 0) {
    ::close(fd);
    release_claim();
    throw Error(fmt::format("flight recorder: '{}' is in use by process {}", path, existing.owner_pid));
  }
  if (::ftruncate(fd, 0) != 0 || ::ftruncate(fd, static_cast<off_t>(kRingBytes)) != 0) {
    int err = errno;
    ::close(fd);
    release_claim();
    throw Error(fmt::format("flight recorder: cannot size '{}' to {} bytes: {}", path, kRingBytes, std::strerror(err)));
  }
  void* p = ::mmap(nullptr, kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) {
    release_claim();
    throw Error(fmt::format("flight recorder: cannot map '{}': {}", path, std::strerror(err)));
  }
  mapping_ = p;
  mapping_size_ = kRingBytes;
  header()->version = 1;
  header()->capacity = kFlightRecorderCapacity;
  header()->rank = rank;
  header()->world_size = world_size;
  header()->record_size = sizeof(FlightRecord);
  header()->owner_pid = ::getpid();
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(header()->magic, kMagic, sizeof(kMagic));  // last: a reader sees a whole header or none
}

FlightRecorder::~FlightRecorder() {
  if (!path_.empty() && mapping_) {
    header()->owner_pid = 0;  // the ring stays readable; the file is free for another recorder
    ::munmap(mapping_, mapping_size_);
  }
  if (!path_.empty()) release_claim();
}

void FlightRecorder::release_claim() {
  std::lock_guard lock(g_claimed_mutex);
  g_claimed.erase(path_);
}

FlightRecorder::Header* FlightRecorder::header() { return static_cast<Header*>(mapping_); }
const FlightRecorder::Header* FlightRecorder::header() const { return static_cast<const Header*>(mapping_); }
FlightRecord* FlightRecorder::slots() { return reinterpret_cast<FlightRecord*>(static_cast<char*>(mapping_) + 32); }
const FlightRecord* FlightRecorder::slots() const {
  return reinterpret_cast<const FlightRecord*>(static_cast<const char*>(mapping_) + 32);
}

void FlightRecorder::issued(std::uint64_t sequence, std::string_view kind, std::string_view label,
                            std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  FlightRecord& r = slots()[sequence % kFlightRecorderCapacity];
  // Invalidate first and commit last, so that a reader of a dead rank's file never takes half
  // of a new record for the old one.
  r.commit = 0;
  std::atomic_thread_fence(std::memory_order_release);
  r.sequence = sequence;
  r.start_ns = now_ns();
  r.end_ns = 0;
  r.bytes = bytes;
  r.state = static_cast<std::uint32_t>(CollectiveState::Issued);
  copy_cut(r.kind, sizeof(r.kind), kind);
  copy_cut(r.label, sizeof(r.label), label);
  std::atomic_thread_fence(std::memory_order_release);
  r.commit = sequence + 1;
}

void FlightRecorder::finished(std::uint64_t sequence, CollectiveState state) {
  std::lock_guard lock(mutex_);
  FlightRecord& r = slots()[sequence % kFlightRecorderCapacity];
  if (r.commit != sequence + 1) return;  // overwritten by a newer collective
  r.end_ns = now_ns();
  r.state = static_cast<std::uint32_t>(state);
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard lock(mutex_);
  std::vector<FlightRecord> out;
  for (int i = 0; i < kFlightRecorderCapacity; ++i)
    if (slots()[i].commit != 0 && slots()[i].commit == slots()[i].sequence + 1) out.push_back(slots()[i]);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.sequence < b.sequence; });
  return out;
}

std::string FlightRecorder::dump() const { return format_flight_ring(FlightRing{rank_, world_size_, records()}); }

std::string format_flight_ring(const FlightRing& ring) {
  std::string out = fmt::format("flight recorder of rank {}/{}: the last {} collective{}, oldest first{}\n", ring.rank,
                                ring.world_size, ring.records.size(), ring.records.size() == 1 ? "" : "s",
                                ring.records.empty() ? " (none issued)" : "");
  for (const auto& r : ring.records) {
    std::string timing = clock_text(r.start_ns) + " UTC";
    if (r.end_ns != 0)
      timing += fmt::format(", ended after {:.1f} ms", double(r.end_ns - r.start_ns) / 1e6);
    out += fmt::format("  seq {:>6}  {:<10} {:<14} '{}'  {}  {}\n", r.sequence, to_string(r.collective_state()),
                       r.kind_text(), r.label_text(), bytes_text(r.bytes), timing);
  }
  return out;
}

std::optional<FlightRing> read_flight_ring(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  FlightRecorder::Header h{};
  if (data.size() < sizeof(h))
    throw DataError(fmt::format("flight recorder file '{}': expected at least {} bytes, found {}", path, sizeof(h),
                                data.size()));
  std::memcpy(&h, data.data(), sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != 1 || h.record_size != sizeof(FlightRecord))
    throw DataError(fmt::format("flight recorder file '{}': expected a version 1 ring of {}-byte records, found "
                                "another format",
                                path, sizeof(FlightRecord)));
  std::size_t need = sizeof(h) + std::size_t(h.capacity) * sizeof(FlightRecord);
  if (data.size() < need)
    throw DataError(fmt::format("flight recorder file '{}': expected {} bytes for {} records, found {}", path, need,
                                h.capacity, data.size()));
  FlightRing ring;
  ring.rank = h.rank;
  ring.world_size = h.world_size;
  for (std::uint32_t i = 0; i < h.capacity; ++i) {
    FlightRecord r;
    std::memcpy(&r, data.data() + sizeof(h) + i * sizeof(FlightRecord), sizeof(r));
    r.kind[sizeof(r.kind) - 1] = 0;
    r.label[sizeof(r.label) - 1] = 0;
    if (r.commit != 0 && r.commit == r.sequence + 1) ring.records.push_back(r);
  }
  std::sort(ring.records.begin(), ring.records.end(), [](const auto& a, const auto& b) { return a.sequence < b.sequence; });
  return ring;
}

// ---------------------------------------------------------------------------------------------
// Divergence.

namespace {

struct Key {
  std::string kind, label;
  bool operator==(const Key&) const = default;
  std::string text() const { return fmt::format("{} '{}'", kind, label); }
};

// Every rank's ring by sequence number, and the range of sequences the comparison can speak for.
class RingIndex {
 public:
  explicit RingIndex(const std::vector<FlightRing>& rings) : rings_(rings), by_seq_(rings.size()) {
    for (size_t i = 0; i < rings.size(); ++i) {
      for (const auto& r : rings[i].records) by_seq_[i][r.sequence] = &r;
      if (rings[i].records.empty()) continue;
      // A full ring forgot what came before its oldest record; a ring that is not full holds
      // everything from sequence 0 of that rank.
      if (rings[i].records.size() >= size_t(kFlightRecorderCapacity)) lo = std::max(lo, rings[i].records.front().sequence);
      hi = any ? std::max(hi, rings[i].records.back().sequence) : rings[i].records.back().sequence;
      any = true;
    }
  }

  std::optional<std::uint64_t> last_of(size_t i) const {
    if (rings_[i].records.empty()) return std::nullopt;
    return rings_[i].records.back().sequence;
  }
  std::optional<Key> key_at(size_t i, std::uint64_t s) const {
    auto it = by_seq_[i].find(s);
    if (it == by_seq_[i].end()) return std::nullopt;
    return Key{it->second->kind_text(), it->second->label_text()};
  }
  std::string state_at(size_t i, std::uint64_t s) const {
    auto it = by_seq_[i].find(s);
    return it == by_seq_[i].end() ? std::string("?") : std::string(to_string(it->second->collective_state()));
  }
  int rank(size_t i) const { return rings_[i].rank; }

  std::uint64_t lo = 0;  // first sequence every ring can speak for
  std::uint64_t hi = 0;  // last sequence any rank issued
  bool any = false;      // some rank issued a collective

 private:
  const std::vector<FlightRing>& rings_;
  std::vector<std::map<std::uint64_t, const FlightRecord*>> by_seq_;
};

// Sequence s, which the ranks in `have` issued and those in `lack` did not: the rank that stopped
// first (fewest collectives; ties: the lowest rank).
Divergence stopped_before(const RingIndex& index, std::uint64_t s, const std::vector<size_t>& have,
                          const std::vector<size_t>& lack) {
  size_t d = lack.front();
  for (size_t i : lack) {
    auto li = index.last_of(i), ld = index.last_of(d);
    if ((!li && ld) || (li && ld && *li < *ld)) d = i;
  }
  const size_t ref = have.front();
  const Key k = index.key_at(ref, s).value_or(Key{"?", "?"});
  Divergence out;
  out.kind = Divergence::Kind::Stopped;
  out.rank = index.rank(d);
  out.sequence = s;
  out.label = k.label;
  out.kind_name = k.kind;
  const auto last = index.last_of(d);
  const std::string before = last ? fmt::format("its last was seq {} {} ({})", *last,
                                                index.key_at(d, *last).value_or(Key{"?", "?"}).text(),
                                                index.state_at(d, *last))
                                  : std::string("it issued none");
  out.description = fmt::format("rank {} stopped issuing collectives before seq {} {}, which rank {} issued ({}); {}",
                                out.rank, s, k.text(), index.rank(ref), index.state_at(ref, s), before);
  return out;
}

// Sequence s, which every rank issued: the first rank outside the largest group of ranks that
// issued the same collective, if any; a skip when what it issued is what that group issued a
// little later, a mismatch otherwise.
std::optional<Divergence> disagreement_at(const RingIndex& index, std::uint64_t s, const std::vector<size_t>& have) {
  std::vector<std::pair<Key, std::vector<size_t>>> groups;
  for (size_t i : have) {
    Key k = index.key_at(i, s).value_or(Key{"?", "?"});
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == k; });
    if (g == groups.end()) groups.push_back({k, {i}});
    else g->second.push_back(i);
  }
  if (groups.size() == 1) return std::nullopt;
  // Groups are in order of their lowest rank, so the first largest one wins ties.
  auto reference = std::max_element(groups.begin(), groups.end(),
                                    [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  size_t d = have.size();
  for (size_t i : have)
    if (std::find(reference->second.begin(), reference->second.end(), i) == reference->second.end()) {
      d = i;
      break;
    }
  const size_t ref = reference->second.front();
  const Key& expected = reference->first;
  const Key found = index.key_at(d, s).value_or(Key{"?", "?"});
  Divergence out;
  out.rank = index.rank(d);
  out.sequence = s;
  out.label = expected.label;
  out.kind_name = expected.kind;
  std::optional<std::uint64_t> later;
  for (std::uint64_t j = s + 1; j <= s + kFlightRecorderCapacity; ++j) {
    auto k = index.key_at(ref, j);
    if (!k) break;
    if (*k == found) {
      later = j;
      break;
    }
  }
  if (later) {
    out.kind = Divergence::Kind::Skipped;
    out.description = fmt::format(
        "rank {} skipped {} at seq {}: it issued {} there, which rank {} issued as seq {} (rank {}: {}, rank {}: {})",
        out.rank, expected.text(), s, found.text(), index.rank(ref), *later, out.rank, index.state_at(d, s),
        index.rank(ref), index.state_at(ref, s));
  } else {
    out.kind = Divergence::Kind::Mismatch;
    out.description = fmt::format("rank {} issued {} at seq {} where rank {} issued {} (rank {}: {}, rank {}: {})",
                                  out.rank, found.text(), s, index.rank(ref), expected.text(), out.rank,
                                  index.state_at(d, s), index.rank(ref), index.state_at(ref, s));
  }
  return out;
}

}  // namespace

std::optional<Divergence> find_divergence(const std::vector<FlightRing>& rings) {
  if (rings.size() < 2) return std::nullopt;
  const RingIndex index(rings);
  if (!index.any) return std::nullopt;
  for (std::uint64_t s = index.lo; s <= index.hi; ++s) {
    std::vector<size_t> have, lack;
    for (size_t i = 0; i < rings.size(); ++i) {
      auto last = index.last_of(i);
      (last && *last >= s ? have : lack).push_back(i);
    }
    if (!lack.empty()) return stopped_before(index, s, have, lack);
    if (auto out = disagreement_at(index, s, have)) return out;
  }
  return std::nullopt;
}

}  // namespace zt
