// UTF-8 helpers of the Hugging Face tokenizers: validation, code points, and the lossy decoding
// that Rust's String::from_utf8_lossy does (the ByteLevel decoder's last step).
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace zt::hf {

std::string utf8_encode(char32_t c);

// Bytes of the character that starts with `lead` (1 for a byte that cannot start one).
inline size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Offset of the first byte that is not part of a well-formed UTF-8 sequence, if any.
std::optional<size_t> first_invalid_utf8(std::string_view text);

// The code point at `at` (a character boundary of valid UTF-8); `at` moves past it.
char32_t next_code_point(std::string_view text, size_t& at);

// `bytes` with every maximal ill-formed subsequence replaced by U+FFFD, as Rust's
// String::from_utf8_lossy does.
std::string utf8_lossy(std::string_view bytes);

}  // namespace zt::hf
