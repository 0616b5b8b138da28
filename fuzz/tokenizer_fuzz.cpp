// libFuzzer target: the Hugging Face tokenizer.json reader (src/data/hf_tokenizer_json.cpp) and,
// for a file it accepts, encoding and decoding with it (src/data/hf_*.cpp). Input: the file's text
// up to the first NUL byte, then the text to encode. Contract under test (zerotrain/data/tokenizer.h):
// a file from the internet, however hostile (nested without end, oversized, with regexes that
// backtrack, normalizers that multiply the text, thousands of added tokens), loads or is one
// zt::DataError; the text then encodes or is one zt::DataError, and the ids decode or are one.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view file = input.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos ? std::string_view("Hello world") : input.substr(nul + 1);
  try {
    const zt::HfTokenizer tokenizer = zt::HfTokenizer::from_json(file, "fuzz/tokenizer.json");
    const std::vector<zt::TokenId> ids = tokenizer.encode_with_special_tokens(text);
    tokenizer.decode(ids, false);
    tokenizer.decode(ids, true);
  } catch (const zt::DataError&) {
  }
  return 0;
}
