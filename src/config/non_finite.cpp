// Infinity and NaN in configuration text (non_finite.h).
#include "config/non_finite.h"

#include <fmt/format.h>

#include <cctype>
#include <cstdint>
#include <limits>
#include <string_view>

#include "zerotrain/error.h"

namespace zt::config_detail {

using nlohmann::json;

namespace {

constexpr std::string_view kNonFinite = "\x01zerotrain-non-finite:";          // the parsed string
constexpr std::string_view kNonFiniteJson = "\\u0001zerotrain-non-finite:";  // as written into the text

bool word_char(char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; }

}  // namespace

std::string mark_non_finite(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      out += ch;
      if (ch == '\\' && i + 1 < text.size()) out += text[++i];
      else if (ch == '"') in_string = false;
      continue;
    }
    if (ch == '/' && i + 1 < text.size() && (text[i + 1] == '/' || text[i + 1] == '*')) {
      const bool line = text[i + 1] == '/';
      const size_t end = line ? text.find('\n', i) : text.find("*/", i + 2);
      const size_t stop = end == std::string::npos ? text.size() : end + (line ? 0 : 2);
      out.append(text, i, stop - i);
      i = stop - 1;
      continue;
    }
    std::string_view matched;
    if (i == 0 || !word_char(text[i - 1]))
      for (std::string_view token : {"-Infinity", "Infinity", "NaN"})
        if (text.compare(i, token.size(), token) == 0 &&
            (i + token.size() == text.size() || !word_char(text[i + token.size()]))) {
          matched = token;
          break;
        }
    if (matched.empty()) {
      in_string = ch == '"';
      out += ch;
      continue;
    }
    ((out += '"') += kNonFiniteJson) += matched;
    out += '"';
    i += matched.size() - 1;
  }
  return out;
}

// steps_per_print: Infinity is DeepSpeed's "never report", the largest count here; any other
// non-finite number is refused with its key.
void resolve_non_finite(json& node, const std::string& path, const std::string& origin) {
  if (node.is_string() && node.get_ref<const std::string&>().starts_with(kNonFinite)) {
    const std::string token = node.get<std::string>().substr(kNonFinite.size());
    if (path == "steps_per_print" && token == "Infinity") {
      node = std::numeric_limits<int64_t>::max();
      return;
    }
    throw ConfigError(fmt::format("{}: {}: expected a finite number, found {} (only steps_per_print may be Infinity, "
                                  "DeepSpeed's 'never')", origin, (path.empty() ? std::string("(top level)") : path.substr(0, 80)),
                                  token));
  }
  if (node.is_object())
    for (auto& [key, value] : node.items()) resolve_non_finite(value, path.empty() ? key : path + "." + key, origin);
  else if (node.is_array())
    for (auto& value : node) resolve_non_finite(value, path + "[]", origin);
}

}  // namespace zt::config_detail
