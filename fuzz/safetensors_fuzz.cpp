// libFuzzer target: the checkpoint container reader (SafetensorsReader, src/checkpoint/
// safetensors.h) on arbitrary file contents. Contract under test: open() validates everything
// and read() checks the checksum; every failure is a zt::DataError. Any other exception, a crash,
// a leak or a hang is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/safetensors.h"
#include "zerotrain/error.h"

namespace {
std::filesystem::path scratch_file() {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("zt-safetensors-fuzz-" + std::to_string(getpid()) + ".safetensors");
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path = scratch_file();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    zt::SafetensorsReader reader(path);
    (void)reader.metadata();
    for (const zt::SafetensorsEntry& entry : reader.entries()) {
      if (!reader.contains(entry.name)) __builtin_trap();
      try {
        const at::Tensor tensor = reader.read(entry.name);
        if (tensor.numel() * static_cast<int64_t>(tensor.element_size()) != entry.nbytes) __builtin_trap();
      } catch (const zt::DataError&) {
      }
    }
  } catch (const zt::DataError&) {
  }
  return 0;
}
