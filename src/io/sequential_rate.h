// The disk's plain sequential rate, as `dd oflag=direct` / `iflag=direct` would measure it: the
// reference against which the I/O engine's throughput is judged (bench/io_bench.cpp).
#pragma once
#include <cstdint>
#include <filesystem>

namespace zt::io {

struct SequentialRate {
  double write_gbps = 0, read_gbps = 0;  // 1e9 bytes per second
};

// One thread, queue depth 1: pwrite then pread of `bytes` (rounded down to whole blocks, at least
// one) in `block_size` pieces (a multiple of kAlignment) through O_DIRECT (without it where the
// file system refuses it) to a temporary file in `dir`, removed afterwards. Throws IoError.
SequentialRate measure_sequential_rate(const std::filesystem::path& dir, int64_t bytes, int64_t block_size);

}  // namespace zt::io
