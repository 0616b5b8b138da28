#include <string>

#include "zerotrain/data/data.h"
#include "zerotrain/error.h"

namespace zt {

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string ByteTokenizer::decode(std::span<const uint16_t> tokens) const {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= kVocabSize)
      throw DataError("ByteTokenizer::decode: token " + std::to_string(tokens[i]) + " at position " +
                      std::to_string(i) + " is not a byte (expected ids < 256)");
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

}  // namespace zt
