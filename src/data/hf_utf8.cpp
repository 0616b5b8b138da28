#include "data/hf_utf8.h"

namespace zt::hf {
namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";

// Length of the well-formed sequence at `at` (Unicode's table 3-7), or 0 with `consumed` set to
// the length of its maximal ill-formed prefix (at least 1).
size_t well_formed_length(std::string_view s, size_t at, size_t& consumed) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(at);
  consumed = 1;
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < length; ++k) {
    if (at + k >= s.size()) return 0;
    const unsigned char c = byte(at + k);
    const bool in_range = k == 1 ? (c >= low && c <= high) : (c >= 0x80 && c <= 0xBF);
    if (!in_range) return 0;
    consumed = k + 1;
  }
  return length;
}

}  // namespace

std::string utf8_encode(char32_t c) {
  std::string out;
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
  return out;
}

std::optional<size_t> first_invalid_utf8(std::string_view text) {
  for (size_t at = 0; at < text.size();) {
    size_t consumed = 0;
    const size_t length = well_formed_length(text, at, consumed);
    if (length == 0) return at;
    at += length;
  }
  return std::nullopt;
}

char32_t next_code_point(std::string_view text, size_t& at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  const size_t length = utf8_length(lead);
  char32_t c = length == 1 ? lead : length == 2 ? (lead & 0x1F) : length == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (size_t k = 1; k < length; ++k) c = (c << 6) | (static_cast<unsigned char>(text[at + k]) & 0x3F);
  at += length;
  return c;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t at = 0; at < bytes.size();) {
    size_t consumed = 0;
    const size_t length = well_formed_length(bytes, at, consumed);
    if (length > 0) {
      out.append(bytes.substr(at, length));
      at += length;
    } else {
      out += kReplacementCharacter;
      at += consumed;
    }
  }
  return out;
}

}  // namespace zt::hf
