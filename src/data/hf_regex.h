// The regular expressions of tokenizer.json (Split pre-tokenizers, Replace normalizers and
// decoders, ByteLevel's GPT-2 pattern) on PCRE2 with UTF and Unicode properties, matched as the
// Rust `tokenizers` library matches them with Oniguruma.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace zt::hf {

// Oniguruma's \s is Unicode's White_Space property; PCRE2's (with UCP) also takes U+180E and
// leaves others out. Returns `pattern` with \s and \S spelled as explicit classes of
// White_Space, so that both engines split alike.
std::string oniguruma_compatible_pattern(std::string_view pattern);

class Regex {
 public:
  // Throws zt::DataError naming `where` (file and field) when PCRE2 rejects the pattern.
  Regex(std::string_view pattern, const std::string& where);
  // A pattern matching `literal` exactly (tokenizer.json's {"String": ...} patterns).
  static Regex literal(std::string_view literal, const std::string& where);

  // Calls on_match(start, end) for each non-empty match, left to right, as byte offsets into
  // `text` (valid UTF-8). Thread-safe. Throws zt::DataError when PCRE2 gives up (match limits).
  void for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct CodeDeleter {
    void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  };
  std::string pattern_;
  std::string where_;
  std::shared_ptr<pcre2_code> code_;
};

}  // namespace zt::hf
