#include "data/hf_pipeline.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "data/hf_utf8.h"
#include "zerotrain/error.h"

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

// The text with every match of `pattern` replaced by `content`; false, leaving `out` partial, as
// soon as it would pass `max_bytes`.
bool replace_all(const Regex& pattern, std::string_view text, std::string_view content, std::string& out,
                 size_t max_bytes = std::string::npos) {
  out.clear();
  size_t previous = 0;
  bool within = true;
  pattern.for_each_match(text, [&](size_t start, size_t end) {
    if (!within) return;
    if (out.size() + (start - previous) + content.size() > max_bytes) {
      within = false;
      return;
    }
    out.append(text.substr(previous, start - previous));
    out.append(content);
    previous = end;
  });
  if (!within || out.size() + (text.size() - previous) > max_bytes) return false;
  out.append(text.substr(previous));
  return true;
}

[[noreturn]] void throw_normalizer_growth(const std::string& where, size_t input, size_t limit) {
  throw DataError(where + " makes a text of " + std::to_string(input) + " bytes longer than " + std::to_string(limit) +
                  " bytes; expected at most " + std::to_string(kNormalizedGrowth) + " times the text's length plus " +
                  std::to_string(kNormalizedSlackBytes) + " bytes");
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
    std::string replaced;
    for (std::string& token : tokens) {
      replace_all(replace->pattern, token, replace->content, replaced);
      token.swap(replaced);
    }
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
  uint32_t node = 0;
  for (const char c : content) {
    const auto byte = static_cast<unsigned char>(c);
    uint32_t next = child(node, byte);
    if (next == 0) {
      next = uint32_t(nodes_.size());
      Node added;
      added.parent = node;
      added.depth = nodes_[node].depth + 1;
      added.byte = byte;
      nodes_.push_back(added);
      if (node == 0)
        root_children_[byte] = next;
      else
        children_.emplace(uint64_t(node) << 8 | byte, next);
    }
    node = next;
  }
  if (nodes_[node].token < 0) {
    nodes_[node].token = int32_t(tokens_.size());
    tokens_.emplace_back(content, id);
  }
  ++count_;
}

uint32_t AddedTokenMatcher::child(uint32_t node, unsigned char byte) const {
  if (node == 0) return root_children_[byte];
  auto it = children_.find(uint64_t(node) << 8 | byte);
  return it == children_.end() ? 0 : it->second;
}

uint32_t AddedTokenMatcher::step(uint32_t node, unsigned char byte, size_t& transitions) const {
  for (;;) {
    ++transitions;
    if (const uint32_t next = child(node, byte)) return next;
    if (node == 0) return 0;
    node = nodes_[node].fail;
  }
}

void AddedTokenMatcher::build() {
  // Failure links in order of depth: a node's parent, and the parent's failure, come first.
  std::vector<uint32_t> order(nodes_.size() - 1);
  for (size_t i = 0; i < order.size(); ++i) order[i] = uint32_t(i + 1);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return nodes_[a].depth < nodes_[b].depth; });
  for (const uint32_t index : order) {
    Node& node = nodes_[index];
    node.fail = 0;
    if (node.parent != 0) {
      uint32_t candidate = nodes_[node.parent].fail;
      size_t ignored = 0;
      node.fail = step(candidate, node.byte, ignored);
    }
    node.longest = node.token >= 0 ? node.token : nodes_[node.fail].longest;
  }
}

size_t AddedTokenMatcher::split(std::string_view text, bool at_origin, std::vector<Piece>& out) const {
  size_t transitions = 0;
  size_t text_start = 0;  // where the stretch of plain text not yet emitted starts
  auto emit_text = [&](size_t end) {
    if (end > text_start)
      out.push_back({std::string(text.substr(text_start, end - text_start)), std::nullopt, at_origin && text_start == 0});
  };
  for (size_t scan = 0; scan < text.size();) {
    // The leftmost, then longest, match from `scan`: once the automaton's path starts past the
    // best match's start, no later byte can give one further left or longer.
    int32_t best = -1;
    size_t best_start = 0;
    uint32_t state = 0;
    for (size_t i = scan; i < text.size(); ++i) {
      state = step(state, static_cast<unsigned char>(text[i]), transitions);
      if (best >= 0 && i + 1 - nodes_[state].depth > best_start) break;
      const int32_t found = nodes_[state].longest;
      if (found < 0) continue;
      const size_t start = i + 1 - tokens_[size_t(found)].first.size();
      if (best < 0 || start < best_start ||
          (start == best_start && tokens_[size_t(found)].first.size() > tokens_[size_t(best)].first.size())) {
        best = found;
        best_start = start;
      }
    }
    if (best < 0) break;
    const auto& [content, id] = tokens_[size_t(best)];
    emit_text(best_start);
    out.push_back({content, id, at_origin && best_start == 0});
    scan = text_start = best_start + content.size();
  }
  emit_text(text.size());
  return transitions;
}

void normalize(const std::vector<Normalizer>& normalizers, std::string& text) {
  const size_t input = text.size();
  const size_t limit = input * kNormalizedGrowth + kNormalizedSlackBytes;
  std::string replaced;
  for (const Normalizer& normalizer : normalizers) {
    if (const auto* prepend = std::get_if<PrependNormalizer>(&normalizer)) {
      if (text.empty()) continue;
      if (text.size() + prepend->prefix.size() > limit) throw_normalizer_growth(prepend->where, input, limit);
      text.insert(0, prepend->prefix);
    } else {
      const auto& replace = std::get<ReplaceNormalizer>(normalizer);
      if (!replace_all(replace.pattern, text, replace.content, replaced, limit))
        throw_normalizer_growth(replace.where, input, limit);
      text.swap(replaced);
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
