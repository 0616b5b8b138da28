// The stages of a Hugging Face tokenizer around its BPE model, as the Rust `tokenizers` library
// runs them: added tokens split out of the text (those marked `normalized` after normalization),
// normalizers, pre-tokenizers, the model, the post-processor's template; and for decoding, the
// decoder chain. Built by hf_tokenizer_json.cpp from tokenizer.json; immutable afterwards.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "data/hf_bpe.h"
#include "data/hf_regex.h"
#include "zerotrain/tokenizer.h"

namespace zt::hf {

// normalizers
struct PrependNormalizer {
  std::string prefix;
};
struct ReplaceNormalizer {
  Regex pattern;
  std::string content;
};
using Normalizer = std::variant<PrependNormalizer, ReplaceNormalizer>;

// pre-tokenizers
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
enum class PrependScheme { Always, Never, First };
struct SplitPreTokenizer {
  Regex pattern;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
};
struct ByteLevelPreTokenizer {
  bool add_prefix_space = true;
  bool use_regex = true;
};
struct MetaspacePreTokenizer {
  std::string replacement;  // one character, in UTF-8
  PrependScheme prepend_scheme = PrependScheme::Always;
  bool split = true;
};
using PreTokenizer = std::variant<SplitPreTokenizer, ByteLevelPreTokenizer, MetaspacePreTokenizer>;

// decoders
struct ByteLevelDecoder {};
struct ReplaceDecoder {
  Regex pattern;
  std::string content;
};
struct ByteFallbackDecoder {};
struct FuseDecoder {};
struct StripDecoder {
  char32_t content = U' ';
  size_t start = 0;
  size_t stop = 0;
};
struct MetaspaceDecoder {
  char32_t replacement = U'\u2581';
  PrependScheme prepend_scheme = PrependScheme::Always;
};
using Decoder = std::variant<ByteLevelDecoder, ReplaceDecoder, ByteFallbackDecoder, FuseDecoder, StripDecoder,
                             MetaspaceDecoder>;

// A stretch of text on its way to the model, or an added token already matched.
struct Piece {
  std::string text;
  std::optional<TokenId> added_id;
  bool at_origin = false;  // starts at offset 0 of the input (Metaspace's "first" scheme)
};

// Finds added tokens in text: leftmost match first, the longest of those starting there.
class AddedTokenMatcher {
 public:
  void add(const std::string& content, TokenId id);
  bool empty() const { return count_ == 0; }
  // Appends `text` to `out` cut into stretches of text and matched tokens (no empty stretch).
  void split(std::string_view text, bool at_origin, std::vector<Piece>& out) const;

 private:
  // Per first byte, the tokens starting with it, longest first.
  std::array<std::vector<std::pair<std::string, TokenId>>, 256> by_first_byte_;
  size_t count_ = 0;
};

struct TemplatePart {
  bool is_sequence = false;   // the encoded text ($A)
  std::vector<TokenId> ids;   // else a special token's ids
};

// Applies the stages in order; see the file comment.
void normalize(const std::vector<Normalizer>& normalizers, std::string& text);
// Pre-tokenizes one normalized piece into words for the model. Sets `byte_level` when the words
// are still raw text that the model must pass through the byte-to-unicode map.
void pre_tokenize(const std::vector<PreTokenizer>& pre_tokenizers, Piece piece, std::vector<Piece>& words,
                  bool& byte_level);
std::string decode_tokens(const std::vector<Decoder>& decoders, std::vector<std::string> tokens, bool has_decoder);

// The regex of GPT-2 that the ByteLevel pre-tokenizer splits with.
const Regex& gpt2_pattern();

}  // namespace zt::hf

namespace zt {

struct HfTokenizer::Impl {
  std::string source;
  std::vector<hf::Normalizer> normalizers;
  std::vector<hf::PreTokenizer> pre_tokenizers;
  std::unique_ptr<hf::BpeModel> model;
  std::vector<hf::Decoder> decoders;
  bool has_decoder = false;
  hf::AddedTokenMatcher raw_added_tokens;         // matched before normalization
  hf::AddedTokenMatcher normalized_added_tokens;  // matched in normalized text
  std::unordered_map<TokenId, std::string> added_tokens_by_id;
  hf::StringSet special_token_contents;
  std::vector<hf::TemplatePart> single_template;  // empty: no post-processor template
  size_t vocab_size = 0;
};

}  // namespace zt

namespace zt::hf {

// Reads tokenizer.json (hf_tokenizer_json.cpp). Throws zt::DataError naming `source`, the field,
// what is supported and what was found.
std::shared_ptr<const HfTokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source);

}  // namespace zt::hf
