#include "common/printable.h"

#include <cstdint>
#include <cstdio>

namespace zt {

size_t utf8_char_length(std::string_view text) {
  if (text.empty()) return 0;
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  // Unicode's table of well-formed sequences (3-7): the second byte's range depends on the lead,
  // which rules out overlong forms, surrogates and code points past U+10FFFF.
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
  if (text.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < length; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  return length;
}

namespace {

// The escape for a control character (`c` its code point), or "" for any other character.
std::string control_escape(uint32_t c) {
  if (c == '\n') return "\\n";
  if (c == '\t') return "\\t";
  if (c == '\r') return "\\r";
  if (c >= 0x20 && c != 0x7F && !(c >= 0x80 && c <= 0x9F) && c != 0x2028 && c != 0x2029) return "";
  char buffer[16];
  std::snprintf(buffer, sizeof buffer, "\\u{%X}", static_cast<unsigned>(c));
  return buffer;
}

uint32_t code_point(std::string_view text, size_t length) {
  const auto byte = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i])); };
  if (length == 1) return byte(0);
  uint32_t c = byte(0) & (0xFF >> (length + 1));
  for (size_t i = 1; i < length; ++i) c = (c << 6) | (byte(i) & 0x3F);
  return c;
}

}  // namespace

std::string printable_utf8(std::string_view text, size_t limit) {
  std::string out;
  for (size_t at = 0; at < text.size();) {
    const size_t length = utf8_char_length(text.substr(at));
    std::string piece;
    if (length == 0) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\x%02X", static_cast<unsigned>(static_cast<unsigned char>(text[at])));
      piece = buffer;
    } else {
      piece = control_escape(code_point(text.substr(at), length));
      if (piece.empty()) piece = std::string(text.substr(at, length));
    }
    if (out.size() + piece.size() > limit) return out + "...";
    out += piece;
    at += length == 0 ? 1 : length;
  }
  return out;
}

}  // namespace zt
