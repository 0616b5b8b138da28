// libFuzzer target: the checkpoint manifest reader (src/checkpoint/checkpoint.cpp), reached
// through export_checkpoint() on a checkpoint directory whose manifest.json is the input, beside
// the rank files of a real, tiny checkpoint (fuzz/data/checkpoint). Contract under test
// (checkpoint.h): a damaged checkpoint is a zt::DataError naming the file and the problem.
//
// The manifest carries a CRC-32 of itself; when the input has a "checksum" field the harness
// recomputes it the way the writer does, so that mutations reach the structural checks instead of
// all stopping at the checksum (inputs without one still test that rejection).
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "zerotrain/error.h"

#ifndef ZT_FUZZ_CHECKPOINT_FIXTURE
#error "ZT_FUZZ_CHECKPOINT_FIXTURE: the directory of the fixture checkpoint's rank files"
#endif

namespace fs = std::filesystem;

namespace {

constexpr const char* kZeroChecksum = "00000000";

const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("zt-manifest-fuzz-" + std::to_string(getpid()));
    fs::remove_all(d);
    fs::create_directories(d / "tag");
    for (const auto& entry : fs::directory_iterator(ZT_FUZZ_CHECKPOINT_FIXTURE))
      if (entry.path().extension() == ".safetensors") fs::copy_file(entry.path(), d / "tag" / entry.path().filename());
    return d;
  }();
  return dir;
}

// Rewrites the stored checksum to the one the reader will compute: the CRC-32 of the text with
// the field's value replaced by zeros.
std::string with_valid_checksum(std::string text) {
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("checksum") || !doc["checksum"].is_string()) return text;
  const std::string stored = doc["checksum"].get<std::string>();
  const std::string field = "\"checksum\": \"" + stored + "\"";
  const size_t at = text.find(field);
  if (stored.size() != 8 || at == std::string::npos) return text;
  text.replace(at, field.size(), std::string("\"checksum\": \"") + kZeroChecksum + "\"");
  const std::string crc = zt::crc32_hex(text);
  text.replace(at, field.size(), "\"checksum\": \"" + crc + "\"");
  return text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = scratch();
  {
    std::ofstream out(dir / "tag" / "manifest.json", std::ios::binary | std::ios::trunc);
    const std::string text = with_valid_checksum(std::string(reinterpret_cast<const char*>(data), size));
    out << text;
  }
  try {
    zt::export_checkpoint(dir, "tag", dir / "out.safetensors", at::kFloat);
  } catch (const zt::DataError&) {
  } catch (const zt::ConfigError&) {
  }
  return 0;
}
