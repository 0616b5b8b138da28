// Flight recorder: every rank keeps its last 64 collectives, so that after a
// hang or a crash one can tell which rank left the common sequence, and where. Internal; not
// installed: zerotrain/comm/comm.h states what a user sees of it.
//
// Contract
// - A Communicator from make_communicator() records every collective it issues: sequence
//   number, kind, label, bytes, start and end time (wall clock) and state. When the variable
//   ZT_FLIGHT_RECORDER_FILE names a file (the local launcher sets <log_dir>/rank<i>.flight),
//   the ring lives in that file through a shared memory mapping: every update is a plain memory
//   write, so the file holds the last records even after SIGKILL or a segmentation fault.
//   Without the variable the ring is kept in memory only.
// - On its first failure (a timeout, or a peer gone) a communicator writes the ring as text to
//   stderr, which under the launcher is the rank's log.
// - Records are fixed-size; a label or kind longer than its field is cut. A record being
//   written when the process died is skipped by the reader (its commit word does not match).
// - find_divergence() is a pure function over the rings of all ranks; the launcher runs it over
//   the files after a failed job and prints its one-line description.
// - Thread-safety: a FlightRecorder may be updated from several threads (handles are waited
//   from any thread); records()/dump() take the same lock.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

enum class CollectiveState : std::uint32_t { Issued = 1, Completed = 2, Failed = 3, TimedOut = 4 };
const char* to_string(CollectiveState state);

// One collective, as stored in the ring (and in the file: little-endian, this exact layout).
struct FlightRecord {
  std::uint64_t commit = 0;    // sequence + 1 once the record is complete; 0 while written
  std::uint64_t sequence = 0;
  std::int64_t start_ns = 0;   // wall clock (ns since the Unix epoch) when issued
  std::int64_t end_ns = 0;     // when completed, failed or timed out; 0 while issued
  std::uint64_t bytes = 0;     // payload of this rank (a gather's output, a scatter's input)
  std::uint32_t state = 0;     // CollectiveState
  char kind[20] = {};          // "all_reduce", ... (NUL-terminated)
  char label[88] = {};         // the caller's label, cut to fit (NUL-terminated)

  std::string kind_text() const;
  std::string label_text() const;
  CollectiveState collective_state() const { return static_cast<CollectiveState>(state); }
};
static_assert(sizeof(FlightRecord) == 152, "the file layout is part of the format");

inline constexpr int kFlightRecorderCapacity = 64;
inline constexpr const char* kFlightRecorderFileVariable = "ZT_FLIGHT_RECORDER_FILE";

class FlightRecorder {
 public:
  // In memory only.
  FlightRecorder(int rank, int world_size);
  // Backed by `path`, created or truncated. Throws zt::Error naming the file when it cannot be
  // created or mapped, or when a live recorder (of this process, or of another process that is
  // still running) records there: the communicator then keeps its ring in memory.
  FlightRecorder(int rank, int world_size, const std::string& path);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  void issued(std::uint64_t sequence, std::string_view kind, std::string_view label, std::uint64_t bytes);
  // Sets the state and end time of `sequence` if it is still in the ring.
  void finished(std::uint64_t sequence, CollectiveState state);

  // The records in the ring, oldest first.
  std::vector<FlightRecord> records() const;
  // Human-readable, one line per collective (docs/comm.md shows one).
  std::string dump() const;
  const std::string& path() const { return path_; }  // empty when in memory

 struct Header;  // the file's first 32 bytes (defined by the implementation)

 private:
  int rank_;
  int world_size_;
  std::string path_;
  mutable std::mutex mutex_;
  void* mapping_ = nullptr;  // Header followed by the records
  std::size_t mapping_size_ = 0;
  std::vector<unsigned char> memory_;  // used when there is no file
  void release_claim();
  Header* header();
  const Header* header() const;
  FlightRecord* slots();
  const FlightRecord* slots() const;
};

// What one rank's ring held; records oldest first (sequence ascending).
struct FlightRing {
  int rank = 0;
  int world_size = 0;
  std::vector<FlightRecord> records;
};

// Reads a ring file written by a FlightRecorder. Returns nullopt when the file does not exist;
// throws zt::DataError naming the file when it is not a flight recorder file.
std::optional<FlightRing> read_flight_ring(const std::string& path);

// The text of FlightRecorder::dump() for a ring.
std::string format_flight_ring(const FlightRing& ring);

struct Divergence {
  enum class Kind {
    Mismatch,  // at `sequence` this rank issued another collective than the others
    Skipped,   // this rank left out the collective the others issued at `sequence`
    Stopped,   // this rank issued nothing at `sequence` while the others did
  } kind = Kind::Mismatch;
  int rank = -1;             // the rank that diverged
  std::uint64_t sequence = 0;
  std::string label;         // what the other ranks issued at `sequence`
  std::string kind_name;     // its kind ("all_gather", ...)
  std::string description;   // one line, naming the rank, the sequence and both sides
};

// The first place where the rings disagree, or nullopt when every rank issued the same
// collectives (as far as the rings reach). Ranks are compared over the sequences every ring
// still holds. At the first sequence where ranks differ:
//  - a rank that issued nothing there while others did "stopped" (the one that stopped first);
//  - else the ranks are grouped by (kind, label); the largest group (ties: the one with the
//    lowest rank) is the reference, and the lowest rank outside it diverged. It "skipped" when
//    its collective there is the one the reference issued a few sequences later.
std::optional<Divergence> find_divergence(const std::vector<FlightRing>& rings);

}  // namespace zt
