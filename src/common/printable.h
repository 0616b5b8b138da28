// Untrusted text quoted in an error message (a token, a field's value, a file name, a parser's
// excerpt of bad input): whatever the bytes, the message stays one line of valid UTF-8, so that
// logs, terminals and JSON summaries that carry it are not broken by it.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace zt {

// `text` with well-formed UTF-8 kept as it is, each byte of an ill-formed sequence written as
// \xNN, and control characters (C0, DEL, C1, U+2028, U+2029) written as \n, \t, \r or \u{NN}.
// Longer than `limit` bytes of output: cut at a character boundary and ended with "...".
std::string printable_utf8(std::string_view text, size_t limit = 200);

// The length of the well-formed UTF-8 character at the start of `text` (a code point from
// U+0000 to U+10FFFF, not a surrogate, in its shortest form), or 0 when it starts ill-formed.
size_t utf8_char_length(std::string_view text);

}  // namespace zt
