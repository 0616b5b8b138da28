#include "data/hf_regex.h"

#include <cctype>
#include <memory>

#include "common/printable.h"
#include "zerotrain/error.h"

namespace zt::hf {
namespace {

// Unicode's White_Space property: what Oniguruma's \s matches in the UTF-8 encoding.
constexpr std::string_view kWhiteSpaceRanges =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: a match block and a JIT stack larger than PCRE2's 32 KiB default, so
// that long runs of whitespace under `\s+(?!\S)` do not exhaust it.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, jit_stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

// PCRE2's own default is 10,000,000 steps; starting lower lets a pattern that backtracks without
// end fail sooner, and the retries below give a legitimate long match what it needs.
constexpr uint64_t kFirstMatchLimit = 1'000'000;
constexpr uint64_t kRetryBudgetBase = 64'000'000;
constexpr uint64_t kRetryBudgetPerByte = 8;

size_t next_char_end(std::string_view text, size_t at) {
  size_t end = at + 1;
  while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
  return end;
}

}  // namespace

std::string oniguruma_compatible_pattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char escaped = pattern[++i];
      if (escaped == 's' && in_class) {
        out += kWhiteSpaceRanges;
      } else if ((escaped == 's' || escaped == 'S') && !in_class) {
        out += escaped == 's' ? "[" : "[^";
        out += kWhiteSpaceRanges;
        out += ']';
      } else {
        out += c;
        out += escaped;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(std::string_view pattern, const std::string& where) : pattern_(pattern), where_(where) {
  const std::string compiled = oniguruma_compatible_pattern(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (!code)
    throw DataError(where + ": the regular expression \"" + printable_utf8(pattern, 200) + "\" does not compile (" +
                    pcre2_message(error_code) + " at offset " + std::to_string(error_offset) + ")");
  // Without JIT (a platform PCRE2 lacks it for) the interpreter gives the same matches, slower.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = std::shared_ptr<pcre2_code>(code, CodeDeleter{});
}

Regex Regex::literal(std::string_view literal, const std::string& where) {
  std::string quoted;
  for (const char c : literal) {
    // Every ASCII punctuation character may be escaped in PCRE2; letters, digits and bytes of
    // multi-byte characters must not be.
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u) && c != ' ' && c != '_') quoted += '\\';
    quoted += c;
  }
  Regex regex(quoted, where);
  regex.pattern_ = std::string(literal);
  return regex;
}

void Regex::for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const {
  thread_local MatchState state;
  // A match that needs more than the first limit (Llama 3's \s*[\r\n]+ takes a step per byte of
  // a run of spaces) is tried again with twice the limit, then four times..., each retry charged
  // to a budget that grows with the text: a long run costs time in proportion to its length, and a
  // pattern that backtracks without end still stops.
  uint64_t budget = kRetryBudgetBase + kRetryBudgetPerByte * uint64_t(text.size());
  size_t at = 0;
  while (at <= text.size()) {
    uint64_t limit = kFirstMatchLimit;
    int rc = 0;
    for (;;) {
      pcre2_set_match_limit(state.context, uint32_t(limit));
      pcre2_set_depth_limit(state.context, uint32_t(limit));
      rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at, PCRE2_NO_UTF_CHECK,
                       state.data, state.context);
      if ((rc != PCRE2_ERROR_MATCHLIMIT && rc != PCRE2_ERROR_DEPTHLIMIT) || 2 * limit > budget ||
          2 * limit > UINT32_MAX)
        break;
      limit *= 2;
      budget -= limit;
    }
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0)
      throw DataError(where_ + ": matching the regular expression \"" + printable_utf8(pattern_, 200) +
                      "\" failed at byte " + std::to_string(at) + " of a text of " + std::to_string(text.size()) +
                      " bytes (" + pcre2_message(rc) + ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t start = ovector[0], end = ovector[1];
    if (end > start) {
      on_match(start, end);
      at = end;
    } else {
      // Empty matches split nothing; step over one character as Oniguruma's iterator does.
      if (start >= text.size()) return;
      at = next_char_end(text, start);
    }
  }
}

}  // namespace zt::hf
