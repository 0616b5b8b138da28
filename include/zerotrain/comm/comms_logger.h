// Communication logger: DeepSpeed's "comms_logger" (docs/comm.md "Communication logger"). Counts
// every collective a Communicator completes, with its message size and latency, and summarises
// them per operation and message size the way DeepSpeed's CommsLogger.log_all does.
//
// Contract
// - A Communicator made with CommOptions::comms_logger set calls wants() when it issues a
//   collective and, for those wanted, record() once the collective has completed (when wait()
//   returned, or at once in a world of one). Latency is from issue to that completion; with
//   overlap_comm it includes the computation the collective overlapped.
// - Without a logger the communicator makes no clock call for it.
// - Message size: the bytes this rank contributes — the buffer of an all_reduce or broadcast, the
//   input block of an all_gather, the output block of a reduce_scatter, 0 for a barrier.
// - Bandwidths follow DeepSpeed's calc_bw_log (nccl-tests' definitions), in Gbit/s: all_reduce
//   algbw = 2·size/t, busbw = size/t·2(n-1)/n; all_gather and reduce_scatter algbw = n·size/t,
//   busbw = algbw·(n-1)/n; broadcast and barrier busbw = algbw = size/t.
// - Averages are DeepSpeed's trimmed means (10% cut at each end). Every latency is kept (8 bytes
//   per collective) for that.
// - Thread-safety: record() and the readers may be called from any thread (handles are waited
//   from several); they take one lock.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

struct CommsLoggerConfig;

// DeepSpeed's algorithmic and bus bandwidth in Gbit/s of one collective of `bytes` taking
// `milliseconds` on `world` ranks; {0, 0} for a zero or negative latency. `op` is one of
// CommsLogger::operation_names() (or a DeepSpeed alias).
struct Bandwidth {
  double algbw_gbps = 0;
  double busbw_gbps = 0;
};
Bandwidth comm_bandwidth(std::string_view op, std::uint64_t bytes, double milliseconds, int world);

// DeepSpeed's convert_size: "0B", "512.0 B", "1.5 KB", "2.0 MB", ... (base 1024, two decimals).
std::string comm_size_text(std::uint64_t bytes);

class CommsLogger {
 public:
  // One summary row: a record name (the operation, plus "| [Caller: label]" with debug) and a
  // message size.
  struct Row {
    std::string op;      // the operation ("all_reduce", ...)
    std::string caller;  // the collective's label with debug, else empty
    std::uint64_t message_bytes = 0;
    std::int64_t count = 0;
    double total_ms = 0;
    double avg_ms = 0;      // trimmed mean
    double algbw_gbps = 0;  // trimmed mean of the per-collective figures
    double busbw_gbps = 0;
  };

  // Throws ConfigError naming comms_logger.prof_ops and listing the valid names when prof_all is
  // false and an entry of prof_ops is not an operation. `print` receives the verbose lines
  // (default: standard output, rank 0 only, as DeepSpeed's log_dist).
  CommsLogger(const CommsLoggerConfig& config, int rank, int world_size,
              std::function<void(const std::string&)> print = {});

  // The operations zerotrain issues, by DeepSpeed's names.
  static const std::vector<std::string>& operation_names();

  // Whether collectives of kind `op` are recorded (prof_all, or listed in prof_ops).
  bool wants(std::string_view op) const;
  void record(std::string_view op, std::string_view label, std::uint64_t bytes, double milliseconds);

  // Record names in the order first seen, message sizes ascending within each.
  std::vector<Row> rows() const;
  std::int64_t total_count() const;
  // DeepSpeed's log_all table: a header line, then per record name its name on a line and one
  // line per message size.
  std::string table() const;
  // "op,caller,message_bytes,count,total_latency_ms,avg_latency_ms,algbw_gbps,busbw_gbps" and one
  // line per row.
  std::string csv() const;

 private:
  struct Sizes {
    std::int64_t count = 0;
    std::vector<double> latencies_ms;
  };
  struct Record {
    std::string op, caller;
    std::map<std::uint64_t, Sizes> sizes;
  };

  int rank_, world_;
  bool verbose_, debug_, prof_all_;
  std::vector<std::string> prof_ops_;  // canonical names
  std::function<void(const std::string&)> print_;
  mutable std::mutex mutex_;
  std::vector<Record> records_;               // first seen order
  std::map<std::string, size_t> record_index_;  // record name -> records_ index
};

}  // namespace zt
