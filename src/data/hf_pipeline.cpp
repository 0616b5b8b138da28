#include "data/hf_pipeline.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "data/hf_utf8.h"

namespace zt::hf {
namespace {

// A stretch [start, end) of a piece and whether the pattern matched it.
struct Span {
  size_t start;
  size_t end;
  bool is_match;
};

// The pattern's matches and the gaps between them, covering all of `text` (Rust's
// Pattern::find_matches), with `invert` swapping the two.
std::vector<Span> find_spans(const Regex& pattern, std::string_view text, bool invert) {
  std::vector<Span> spans;
  size_t previous = 0;
  pattern.for_each_match(text, [&](size_t start, size_t end) {
    if (start != previous) spans.push_back({previous, start, invert});
    spans.push_back({start, end, !invert});
    previous = end;
  });
  if (previous != text.size()) spans.push_back({previous, text.size(), invert});
  return spans;
}

// The same for a literal (Metaspace's replacement character and space).
std::vector<Span> find_literal_spans(std::string_view literal, std::string_view text) {
  std::vector<Span> spans;
  size_t previous = 0;
  for (size_t at = text.find(literal); at != std::string_view::npos; at = text.find(literal, previous)) {
    if (at != previous) spans.push_back({previous, at, false});
    spans.push_back({at, at + literal.size(), true});
    previous = at + literal.size();
  }
  if (previous != text.size()) spans.push_back({previous, text.size(), false});
  return spans;
}

// Rust's NormalizedString::split: which stretches become pieces under each behavior.
std::vector<Span> apply_behavior(std::vector<Span> spans, SplitBehavior behavior) {
  std::vector<Span> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (Span& s : spans) s.is_match = false;
      return spans;
    case SplitBehavior::Removed:
      for (const Span& s : spans)
        if (!s.is_match) kept.push_back(s);
      return kept;
    case SplitBehavior::Contiguous:
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !kept.empty())
          kept.back().end = s.end;
        else
          kept.push_back({s.start, s.end, false});
        previous_match = s.is_match;
      }
      return kept;
    case SplitBehavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !kept.empty())
          kept.back().end = s.end;
        else
          kept.push_back({s.start, s.end, false});
        previous_match = s.is_match;
      }
      return kept;
    case SplitBehavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty())
          kept.back().start = it->start;
        else
          kept.push_back({it->start, it->end, false});
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      return kept;
  }
  return kept;
}

void split_piece(const Piece& piece, std::vector<Span> spans, SplitBehavior behavior, std::vector<Piece>& out) {
  for (const Span& s : apply_behavior(std::move(spans), behavior)) {
    if (s.end == s.start) continue;
    out.push_back({piece.text.substr(s.start, s.end - s.start), std::nullopt, piece.at_origin && s.start == 0});
  }
}

std::string replace_all(const Regex& pattern, std::string_view text, std::string_view content) {
  std::string out;
  size_t previous = 0;
  pattern.for_each_match(text, [&](size_t start, size_t end) {
    out.append(text.substr(previous, start - previous));
    out.append(content);
    previous = end;
  });
  out.append(text.substr(previous));
  return out;
}

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

void apply_metaspace(const MetaspacePreTokenizer& step, std::vector<Piece>& pieces) {
  std::vector<Piece> out;
  for (Piece& piece : pieces) {
    std::string replaced;
    for (const char c : piece.text) {
      if (c == ' ')
        replaced += step.replacement;
      else
        replaced += c;
    }
    piece.text = std::move(replaced);
    const bool prepend = step.prepend_scheme == PrependScheme::Always ||
                         (step.prepend_scheme == PrependScheme::First && piece.at_origin);
    if (prepend && !starts_with(piece.text, step.replacement)) piece.text.insert(0, step.replacement);
    if (step.split)
      split_piece(piece, find_literal_spans(step.replacement, piece.text), SplitBehavior::MergedWithNext, out);
    else
      out.push_back(std::move(piece));
  }
  pieces = std::move(out);
}

void apply_byte_map(std::vector<Piece>& pieces) {
  for (Piece& piece : pieces) {
    std::string mapped;
    ByteUnicodeMap::instance().append_mapped(piece.text, mapped);
    piece.text = std::move(mapped);
  }
}

// Token texts through the ByteLevel decoder: characters back to bytes (a token with a character
// outside the map keeps its own bytes), then lossy UTF-8 over the whole.
std::string byte_level_decode(const std::vector<std::string>& tokens) {
  const ByteUnicodeMap& map = ByteUnicodeMap::instance();
  std::string bytes;
  for (const std::string& token : tokens) {
    std::string token_bytes;
    bool all_mapped = true;
    for (size_t at = 0; at < token.size() && all_mapped;) {
      const auto byte = map.byte_of(next_code_point(token, at));
      if (byte)
        token_bytes += char(*byte);
      else
        all_mapped = false;
    }
    bytes += all_mapped ? token_bytes : token;
  }
  return utf8_lossy(bytes);
}

std::vector<std::string> byte_fallback_decode(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string pending_bytes;
  auto flush = [&] {
    if (pending_bytes.empty()) return;
    if (!first_invalid_utf8(pending_bytes))
      out.push_back(pending_bytes);
    else
      for (size_t i = 0; i < pending_bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
    pending_bytes.clear();
  };
  for (std::string& token : tokens) {
    const bool is_byte = token.size() == 6 && starts_with(token, "<0x") && token.back() == '>' &&
                         std::isxdigit(static_cast<unsigned char>(token[3])) &&
                         std::isxdigit(static_cast<unsigned char>(token[4]));
    if (is_byte) {
      pending_bytes += char(std::stoi(token.substr(3, 2), nullptr, 16));
    } else {
      flush();
      out.push_back(std::move(token));
    }
  }
  flush();
  return out;
}

std::u32string code_points(std::string_view text) {
  std::u32string out;
  for (size_t at = 0; at < text.size();) out += next_code_point(text, at);
  return out;
}

std::string strip_decode(const StripDecoder& step, const std::string& token) {
  const std::u32string chars = code_points(token);
  size_t start_cut = 0;
  for (size_t i = 0; i < std::min(step.start, chars.size()) && chars[i] == step.content; ++i) start_cut = i + 1;
  size_t stop_cut = chars.size();
  for (size_t i = 0; i < std::min(step.stop, chars.size()) && chars[chars.size() - i - 1] == step.content; ++i)
    stop_cut = chars.size() - i - 1;
  std::string out;
  for (size_t i = start_cut; i < std::max(start_cut, stop_cut); ++i) out += utf8_encode(chars[i]);
  return out;
}

std::vector<std::string> apply_decoder(const Decoder& decoder, std::vector<std::string> tokens) {
  if (std::holds_alternative<ByteLevelDecoder>(decoder)) return {byte_level_decode(tokens)};
  if (std::holds_alternative<ByteFallbackDecoder>(decoder)) return byte_fallback_decode(std::move(tokens));
  if (std::holds_alternative<FuseDecoder>(decoder)) {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    return {joined};
  }
  if (const auto* replace = std::get_if<ReplaceDecoder>(&decoder)) {
    for (std::string& token : tokens) token = replace_all(replace->pattern, token, replace->content);
    return tokens;
  }
  if (const auto* strip = std::get_if<StripDecoder>(&decoder)) {
    for (std::string& token : tokens) token = strip_decode(*strip, token);
    return tokens;
  }
  const auto& metaspace = std::get<MetaspaceDecoder>(decoder);
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::string out;
    for (const char32_t c : code_points(tokens[i])) {
      if (c != metaspace.replacement)
        out += utf8_encode(c);
      else if (i != 0 || metaspace.prepend_scheme == PrependScheme::Never)
        out += ' ';
    }
    tokens[i] = std::move(out);
  }
  return tokens;
}

}  // namespace

const Regex& gpt2_pattern() {
  static const Regex pattern(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
                             "the ByteLevel pre-tokenizer");
  return pattern;
}

void AddedTokenMatcher::add(const std::string& content, TokenId id) {
  if (content.empty()) return;  // an empty token can never be matched
  auto& candidates = by_first_byte_[static_cast<unsigned char>(content[0])];
  candidates.emplace_back(content, id);
  ++count_;
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

void AddedTokenMatcher::split(std::string_view text, bool at_origin, std::vector<Piece>& out) const {
  size_t text_start = 0;
  auto emit_text = [&](size_t end) {
    if (end > text_start)
      out.push_back({std::string(text.substr(text_start, end - text_start)), std::nullopt, at_origin && text_start == 0});
  };
  for (size_t at = 0; at < text.size();) {
    const std::pair<std::string, TokenId>* match = nullptr;
    for (const auto& candidate : by_first_byte_[static_cast<unsigned char>(text[at])])
      if (text.compare(at, candidate.first.size(), candidate.first) == 0) {
        match = &candidate;
        break;
      }
    if (!match) {
      ++at;
      continue;
    }
    emit_text(at);
    out.push_back({match->first, match->second, at_origin && at == 0});
    at += match->first.size();
    text_start = at;
  }
  emit_text(text.size());
}

void normalize(const std::vector<Normalizer>& normalizers, std::string& text) {
  for (const Normalizer& normalizer : normalizers) {
    if (const auto* prepend = std::get_if<PrependNormalizer>(&normalizer)) {
      if (!text.empty()) text.insert(0, prepend->prefix);
    } else {
      const auto& replace = std::get<ReplaceNormalizer>(normalizer);
      text = replace_all(replace.pattern, text, replace.content);
    }
  }
}

void pre_tokenize(const std::vector<PreTokenizer>& pre_tokenizers, Piece piece, std::vector<Piece>& words,
                  bool& byte_level) {
  std::vector<Piece> pieces;
  pieces.push_back(std::move(piece));
  byte_level = false;
  for (const PreTokenizer& step : pre_tokenizers) {
    // The byte map is applied lazily by the model; a later step must see mapped text.
    if (byte_level) apply_byte_map(pieces);
    byte_level = false;
    if (const auto* split = std::get_if<SplitPreTokenizer>(&step)) {
      std::vector<Piece> out;
      for (const Piece& p : pieces) split_piece(p, find_spans(split->pattern, p.text, split->invert), split->behavior, out);
      pieces = std::move(out);
    } else if (const auto* bytes = std::get_if<ByteLevelPreTokenizer>(&step)) {
      std::vector<Piece> out;
      for (Piece& p : pieces) {
        if (bytes->add_prefix_space && !starts_with(p.text, " ")) p.text.insert(p.text.begin(), ' ');
        if (bytes->use_regex)
          split_piece(p, find_spans(gpt2_pattern(), p.text, false), SplitBehavior::Isolated, out);
        else
          out.push_back(std::move(p));
      }
      pieces = std::move(out);
      byte_level = true;
    } else {
      apply_metaspace(std::get<MetaspacePreTokenizer>(step), pieces);
    }
  }
  for (Piece& p : pieces)
    if (!p.text.empty()) words.push_back(std::move(p));
}

std::string decode_tokens(const std::vector<Decoder>& decoders, std::vector<std::string> tokens, bool has_decoder) {
  std::string out;
  if (!has_decoder) {
    // No decoder: Rust joins the token texts with spaces.
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const Decoder& decoder : decoders) tokens = apply_decoder(decoder, std::move(tokens));
  for (const std::string& token : tokens) out += token;
  return out;
}

}  // namespace zt::hf
