// libFuzzer target: the configuration parser (parse_config, with --set overrides) on arbitrary
// bytes. Contract under test (zerotrain/config/config.h): a valid configuration or one zt::ConfigError
// with a one-line message; any other exception, a crash, a leak or a hang is a finding.
//
// Input: the configuration text up to the first NUL byte; each further NUL-separated piece is an
// override "key.path=value" (at most four). The world size comes from the input's length.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> pieces;
  size_t start = 0;
  while (pieces.size() < 5) {
    const size_t nul = input.find('\0', start);
    pieces.push_back(input.substr(start, nul == std::string::npos ? std::string::npos : nul - start));
    if (nul == std::string::npos) break;
    start = nul + 1;
  }
  const std::string text = pieces.front();
  const std::vector<std::string> overrides(pieces.begin() + 1, pieces.end());
  const int world_size = 1 + static_cast<int>(size % 3);
  try {
    const zt::TrainConfig config = zt::parse_config(text, overrides, world_size);
    // A configuration that parses must be consistent and printable.
    if (config.train_batch_size !=
        config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps * world_size)
      __builtin_trap();
    (void)zt::describe(config);
  } catch (const zt::ConfigError& e) {
    if (std::string(e.what()).find('\n') != std::string::npos) __builtin_trap();  // one line
  }
  return 0;
}
