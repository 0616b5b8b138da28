// Throughput of the NVMe tiers' I/O engine (src/io/aio.h) beside the disk's plain sequential rate,
// measured in one run on one directory: a single-thread O_DIRECT pwrite/pread loop (what
// `dd oflag=direct` / `iflag=direct` does) is the reference; each engine configuration writes
// then reads the same amount in 64 MiB tickets with several in flight, the way the optimizer
// streams sub-groups. Prints a markdown table.
//
//   io_bench [--dir DIR] [--gib N] [--piece-mib M] [--in-flight K]
//   (defaults: the current directory, 2 GiB, 64 MiB tickets, 4 in flight)
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "io/aio.h"
#include "io/sequential_rate.h"

namespace fs = std::filesystem;
using namespace zt::io;

namespace {

constexpr int64_t MiB = int64_t(1) << 20;

std::string cpu_model() {
  if (FILE* pipe = ::popen("lscpu 2>/dev/null", "r")) {
    char line[512];
    std::string model;
    while (std::fgets(line, sizeof line, pipe) != nullptr) {
      const std::string text = line;
      if (text.rfind("Model name:", 0) == 0) {
        model = text.substr(text.find(':') + 1);
        model.erase(0, model.find_first_not_of(" \t"));
        model.erase(model.find_last_not_of(" \t\n") + 1);
        break;
      }
    }
    ::pclose(pipe);
    if (!model.empty()) return model;
  }
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string text; std::getline(cpuinfo, text);)
    if (text.rfind("model name", 0) == 0) return text.substr(text.find(':') + 2);
  return "unknown";
}

struct Setup {
  Backend backend;
  int64_t block_size;
  int queue_depth;
  int threads;
};

struct Result {
  std::string backend;
  double write_gbps = 0, read_gbps = 0;
};

Result run(const Setup& setup, const fs::path& dir, int64_t bytes, int64_t piece, int in_flight) {
  AioOptions options;
  options.backend = setup.backend;
  options.block_size = setup.block_size;
  options.queue_depth = setup.queue_depth;
  options.thread_count = setup.threads;
  const fs::path path = dir / fmt::format(".zerotrain-io-bench-{}.swap", ::getpid());
  Result result;
  {
    AioEngine engine(options);
    result.backend = engine.backend_name();
    const int file = engine.open(path, bytes);
    std::vector<AlignedBuffer> buffers;
    for (int i = 0; i < in_flight; ++i) {
      buffers.emplace_back(piece);
      std::memset(buffers.back().data(), 0x40 + i, size_t(piece));
    }
    const int64_t pieces = bytes / piece;
    const auto pass = [&](bool write) {
      std::vector<AioEngine::Ticket> tickets(size_t(in_flight), 0);
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < pieces; ++i) {
        const size_t slot = size_t(i % in_flight);
        if (tickets[slot] != 0) engine.wait(tickets[slot]);  // the buffer is free again
        tickets[slot] = write ? engine.write(file, i * piece, buffers[slot].data(), piece)
                              : engine.read(file, i * piece, buffers[slot].data(), piece);
      }
      engine.wait_all();
      return double(pieces * piece) / 1e9 /
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    result.write_gbps = pass(true);
    result.read_gbps = pass(false);
  }
  fs::remove(path);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  fs::path dir = ".";
  double gib = 2;
  int64_t piece_mib = 64;
  int in_flight = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--dir" && has_value) {
      dir = argv[++i];
    } else if (arg == "--gib" && has_value) {
      gib = std::stod(argv[++i]);
    } else if (arg == "--piece-mib" && has_value) {
      piece_mib = std::stoll(argv[++i]);
    } else if (arg == "--in-flight" && has_value) {
      in_flight = std::stoi(argv[++i]);
    } else {
      std::cerr << "usage: io_bench [--dir DIR] [--gib N] [--piece-mib M] [--in-flight K]\n";
      return 2;
    }
  }
  try {
    const int64_t piece = piece_mib * MiB;
    const int64_t bytes = std::max<int64_t>(1, int64_t(gib * 1024 / double(piece_mib))) * piece;
    const SequentialRate reference = measure_sequential_rate(dir, bytes, 4 * MiB);

    std::vector<Setup> setups;
    if (io_uring_available()) {
      setups.push_back({Backend::IoUring, 1 * MiB, 8, 1});  // the aio block's defaults
      setups.push_back({Backend::IoUring, 4 * MiB, 16, 1});
      setups.push_back({Backend::IoUring, 1 * MiB, 8, 2});
    }
    setups.push_back({Backend::Posix, 1 * MiB, 8, 1});
    setups.push_back({Backend::Posix, 4 * MiB, 8, 4});
    std::vector<Result> results;
    for (const Setup& s : setups) results.push_back(run(s, dir, bytes, piece, in_flight));

    std::cout << fmt::format(
        "### I/O engine throughput (`io_bench`)\n\n"
        "CPU: {}; directory: {}; {:.2f} GiB written, then read, in {} MiB tickets with {} in flight. "
        "Reference: one thread, O_DIRECT pwrite then pread in 4 MiB blocks (as `dd oflag=direct` / "
        "`iflag=direct`), same amount, same directory, same run.\n\n",
        cpu_model(), fs::weakly_canonical(fs::absolute(dir)).string(), double(bytes) / double(1024 * MiB), piece_mib,
        in_flight);
    std::cout << "| engine | block | queue depth | I/O threads | write GB/s | read GB/s | write / reference | read / reference |\n"
                 "|---|---|---|---|---|---|---|---|\n";
    std::cout << fmt::format("| reference (pwrite/pread loop) | 4 MiB | 1 | 1 | {:.2f} | {:.2f} | 1.00 | 1.00 |\n",
                             reference.write_gbps, reference.read_gbps);
    for (size_t i = 0; i < setups.size(); ++i) {
      const Setup& s = setups[i];
      const Result& r = results[i];
      std::cout << fmt::format("| {} | {} MiB | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |\n", r.backend,
                               s.block_size / MiB, s.backend == Backend::Posix ? std::string("1 per thread")
                                                                               : std::to_string(s.queue_depth),
                               s.threads, r.write_gbps, r.read_gbps, r.write_gbps / reference.write_gbps,
                               r.read_gbps / reference.read_gbps);
    }
  } catch (const std::exception& e) {
    std::cerr << "io_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
