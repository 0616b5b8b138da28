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
#include "zerotrain/data/tokenizer.h"

namespace zt::hf {

// normalizers
struct PrependNormalizer {
  std::string prefix;
  std::string where;  // the file and field, for messages
};
struct ReplaceNormalizer {
  Regex pattern;
  std::string content;
  std::string where;
};
// A normalizer may make a text at most this many times longer, plus kNormalizedSlackBytes: the
// supported ones grow it threefold at most (Llama 2's " " to "▁"), and a hostile file must not
// turn a small corpus into gigabytes.
constexpr size_t kNormalizedGrowth = 8;
constexpr size_t kNormalizedSlackBytes = 4096;
// The added tokens' text, in all: the matcher keeps a node per byte. Published files have a few
// hundred kilobytes at most.
constexpr size_t kMaxAddedTokenBytes = size_t(4) << 20;
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

// Finds added tokens in text: leftmost match first, the longest of those starting there (the
// Rust library's Aho-Corasick with MatchKind::LeftmostLongest). An Aho-Corasick automaton over
// the tokens' bytes, so that the cost of a text does not grow with the number of tokens that share
// a prefix: thousands of near misses cost what plain text does.
class AddedTokenMatcher {
 public:
  // Adds a token; build() must follow the last add(). Of two tokens with the same content the
  // first added is matched.
  void add(const std::string& content, TokenId id);
  void build();
  bool empty() const { return count_ == 0; }
  // Appends `text` to `out` cut into stretches of text and matched tokens (no empty stretch).
  // Returns the number of automaton transitions taken (at most a few per byte of text, plus the
  // bytes scanned again after each match), which tests bound.
  size_t split(std::string_view text, bool at_origin, std::vector<Piece>& out) const;

 private:
  struct Node {
    uint32_t parent = 0;
    uint32_t fail = 0;
    uint32_t depth = 0;
    int32_t token = -1;    // index into tokens_ of the token ending here, or -1
    int32_t longest = -1;  // the longest token that is a suffix of this node's bytes, or -1
    unsigned char byte = 0;
  };
  uint32_t child(uint32_t node, unsigned char byte) const;
  uint32_t step(uint32_t node, unsigned char byte, size_t& transitions) const;

  std::vector<std::pair<std::string, TokenId>> tokens_;
  std::vector<Node> nodes_ = std::vector<Node>(1);  // the root
  std::unordered_map<uint64_t, uint32_t> children_;  // (node << 8 | byte) -> child
  std::array<uint32_t, 256> root_children_{};        // 0: none
  size_t count_ = 0;
};

struct TemplatePart {
  bool is_sequence = false;   // the encoded text ($A)
  std::vector<TokenId> ids;   // else a special token's ids
};

// Applies the stages in order; see the file comment. normalize throws zt::DataError naming the
// normalizer when its output would pass kNormalizedGrowth times the input plus
// kNormalizedSlackBytes.
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

constexpr size_t kMaxTokenizerJsonBytes = HfTokenizer::kMaxFileBytes;

// Reads tokenizer.json (hf_tokenizer_json.cpp). Throws zt::DataError naming `source`, the field,
// what is supported and what was found.
std::shared_ptr<const HfTokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source);

}  // namespace zt::hf
