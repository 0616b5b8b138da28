#include "zerotrain/comm/comms_logger.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

// DeepSpeed's names for the same operations (the torch functions its wrappers are named after).
std::string canonical_op(std::string_view op) {
  if (op == "all_gather_into_tensor") return "all_gather";
  if (op == "reduce_scatter_tensor") return "reduce_scatter";
  return std::string(op);
}

// DeepSpeed's trim_mean: sorted, round(n·10%) cut at each end (Python rounds half to even, as
// nearbyint does in the default rounding mode).
double trimmed_mean(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const size_t k = size_t(std::nearbyint(double(n) * 0.1));
  double sum = 0;
  for (size_t i = k; i < n - k; ++i) sum += values[i];
  return n > 2 * k ? sum / double(n - 2 * k) : 0.0;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

Bandwidth comm_bandwidth(std::string_view op_in, std::uint64_t bytes, double milliseconds, int world) {
  if (!(milliseconds > 0)) return {};
  const std::string op = canonical_op(op_in);
  const double n = double(std::max(world, 1));
  double size = double(bytes);
  double algbw = 0, busbw = 0;
  if (op == "all_gather" || op == "reduce_scatter") {
    size *= n;
    algbw = size / milliseconds;
    busbw = algbw * ((n - 1) / n);
  } else if (op == "all_reduce") {
    algbw = size * 2 / milliseconds;
    busbw = size / milliseconds * (2 * (n - 1) / n);
  } else {  // broadcast, barrier
    algbw = busbw = size / milliseconds;
  }
  // bytes per millisecond -> Gbit/s
  return {algbw * 8 / 1e6, busbw * 8 / 1e6};
}

std::string comm_size_text(std::uint64_t bytes) {
  if (bytes == 0) return "0B";
  static const char* const kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
  int i = int(std::floor(std::log(double(bytes)) / std::log(1024.0)));
  i = std::clamp(i, 0, 6);
  // Python's str(round(x, 2)): at most two decimals, at least one.
  std::string value = fmt::format("{:.2f}", double(bytes) / std::pow(1024.0, i));
  if (value.back() == '0') value.pop_back();
  return value + " " + kUnits[i];
}

const std::vector<std::string>& CommsLogger::operation_names() {
  static const std::vector<std::string> names = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"};
  return names;
}

CommsLogger::CommsLogger(const CommsLoggerConfig& config, int rank, int world_size,
                         std::function<void(const std::string&)> print)
    : rank_(rank),
      world_(world_size),
      verbose_(config.verbose),
      debug_(config.debug),
      prof_all_(config.prof_all),
      print_(std::move(print)) {
  const auto& names = operation_names();
  for (const std::string& given : config.prof_ops) {
    const std::string op = canonical_op(given);
    if (std::find(names.begin(), names.end(), op) == names.end()) {
      std::string valid;
      for (const auto& n : names) valid += (valid.empty() ? "" : ", ") + n;
      throw ConfigError(fmt::format("comms_logger.prof_ops: expected operation names ({}; or DeepSpeed's "
                                    "all_gather_into_tensor, reduce_scatter_tensor), found \"{}\"",
                                    valid, given));
    }
    prof_ops_.push_back(op);
  }
  if (!print_) {
    print_ = [](const std::string& line) {
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
    };
  }
}

bool CommsLogger::wants(std::string_view op) const {
  if (prof_all_) return true;
  return std::find(prof_ops_.begin(), prof_ops_.end(), op) != prof_ops_.end();
}

void CommsLogger::record(std::string_view op_in, std::string_view label, std::uint64_t bytes, double milliseconds) {
  const std::string op = canonical_op(op_in);
  const std::string caller = debug_ ? std::string(label) : std::string();
  const std::string name = caller.empty() ? op : op + " | [Caller: " + caller + "]";
  {
    std::lock_guard lock(mutex_);
    auto [it, added] = record_index_.emplace(name, records_.size());
    if (added) records_.push_back(Record{op, caller, {}});
    Sizes& sizes = records_[it->second].sizes[bytes];
    ++sizes.count;
    sizes.latencies_ms.push_back(milliseconds);
  }
  if (verbose_ && rank_ == 0) {
    const Bandwidth bw = comm_bandwidth(op, bytes, milliseconds, world_);
    print_(fmt::format("comm op: {} | time (ms): {:.2f} | msg size: {} | algbw (Gbps): {:.2f} | busbw (Gbps): {:.2f}",
                       name, milliseconds, comm_size_text(bytes), bw.algbw_gbps, bw.busbw_gbps));
  }
}

std::vector<CommsLogger::Row> CommsLogger::rows() const {
  std::lock_guard lock(mutex_);
  std::vector<Row> out;
  for (const Record& record : records_) {
    for (const auto& [bytes, sizes] : record.sizes) {
      Row row;
      row.op = record.op;
      row.caller = record.caller;
      row.message_bytes = bytes;
      row.count = sizes.count;
      std::vector<double> algbw, busbw;
      for (double ms : sizes.latencies_ms) {
        row.total_ms += ms;
        const Bandwidth bw = comm_bandwidth(record.op, bytes, ms, world_);
        algbw.push_back(bw.algbw_gbps);
        busbw.push_back(bw.busbw_gbps);
      }
      row.avg_ms = trimmed_mean(sizes.latencies_ms);
      row.algbw_gbps = trimmed_mean(std::move(algbw));
      row.busbw_gbps = trimmed_mean(std::move(busbw));
      out.push_back(std::move(row));
    }
  }
  return out;
}

std::int64_t CommsLogger::total_count() const {
  std::lock_guard lock(mutex_);
  std::int64_t n = 0;
  for (const Record& record : records_)
    for (const auto& [bytes, sizes] : record.sizes) n += sizes.count;
  return n;
}

std::string CommsLogger::table() const {
  std::string out = fmt::format("{:<20}{:<20}{:<20}{:<20}{:<20}{:<20}{:<20}\n", "Comm. Op", "Message Size", "Count",
                                "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)");
  std::string previous;
  bool first = true;
  for (const Row& row : rows()) {
    const std::string name = row.caller.empty() ? row.op : row.op + " | [Caller: " + row.caller + "]";
    if (first || name != previous) out += name + "\n";
    first = false;
    previous = name;
    out += fmt::format("{:<20}{:<20}{:<20}{:<20.2f}{:<20.2f}{:<20.2f}{:<20.2f}\n", " ", comm_size_text(row.message_bytes),
                       row.count, row.total_ms, row.avg_ms, row.algbw_gbps, row.busbw_gbps);
  }
  return out;
}

std::string CommsLogger::csv() const {
  std::string out = "op,caller,message_bytes,count,total_latency_ms,avg_latency_ms,algbw_gbps,busbw_gbps\n";
  for (const Row& row : rows())
    out += fmt::format("{},{},{},{},{:.6f},{:.6f},{:.6f},{:.6f}\n", row.op, csv_field(row.caller), row.message_bytes,
                       row.count, row.total_ms, row.avg_ms, row.algbw_gbps, row.busbw_gbps);
  return out;
}

}  // namespace zt
