// The BPE model of tokenizer.json and GPT-2's byte-to-unicode map, as the Rust `tokenizers`
// library implements them (models/bpe, pre_tokenizers/byte_level).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "zerotrain/data/tokenizer.h"

namespace zt::hf {

// Hash of strings that also finds by string_view without building a string.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
template <class Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;
using StringSet = std::unordered_set<std::string, StringHash, std::equal_to<>>;

// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
// themselves, the 68 others to U+0100 onwards in byte order.
class ByteUnicodeMap {
 public:
  static const ByteUnicodeMap& instance();
  char32_t char_of(uint8_t byte) const { return chars_[byte]; }
  // The UTF-8 of char_of(byte).
  std::string_view utf8_of(uint8_t byte) const { return utf8_[byte]; }
  // The byte whose character is `c`, if any.
  std::optional<uint8_t> byte_of(char32_t c) const;
  // Each byte of `raw` as its character, in UTF-8.
  void append_mapped(std::string_view raw, std::string& out) const;

 private:
  ByteUnicodeMap();
  std::array<char32_t, 256> chars_{};
  std::array<std::string, 256> utf8_{};
  std::array<int16_t, 512> byte_of_char_{};  // every mapped character is below U+0200
};

struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

// A BPE model: vocabulary, merges by rank, the unknown token and byte fallback, and a bounded
// cache of encoded words. Thread-safe after construction.
class BpeModel {
 public:
  // `merges` in rank order (rank = index). Throws zt::DataError naming `where` for a merge whose
  // parts or result are not in the vocabulary, or an unk_token outside it.
  BpeModel(StringMap<TokenId> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
           BpeOptions options, const std::string& where);
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-token. With `byte_level`, `word` is raw text whose bytes go
  // through the byte-to-unicode map first (the cache is keyed by the raw text).
  void encode_word(std::string_view word, bool byte_level, std::vector<TokenId>& out) const;

  std::optional<TokenId> token_to_id(std::string_view token) const;
  const std::string* id_to_token(TokenId id) const;
  size_t id_limit() const { return tokens_by_id_.size(); }

 private:
  struct MergeResult {
    uint32_t rank;
    TokenId new_id;
  };
  // Merges the characters of `word` (already in the vocabulary's alphabet) by rank.
  void merge_word(std::string_view word, std::vector<TokenId>& out) const;
  // The word's characters as vocabulary ids, with byte fallback and unknown-token fusing.
  void initial_symbols(std::string_view word, std::vector<TokenId>& ids, std::vector<uint32_t>& lengths) const;
  std::optional<MergeResult> find_merge(TokenId left, TokenId right) const;

  StringMap<TokenId> vocab_;
  std::vector<std::string> tokens_by_id_;  // "" where no token has that id
  std::unordered_map<uint64_t, MergeResult> merges_;
  BpeOptions options_;
  std::optional<TokenId> unk_id_;
  std::array<std::optional<TokenId>, 256> byte_fallback_ids_{};

  // Words up to kCacheMaxWordBytes, at most kCacheCapacity of them (as the Rust library bounds
  // its own), in shards so that threads rarely wait on one another.
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  struct CacheShard {
    std::mutex mutex;
    StringMap<std::vector<TokenId>> words;
  };
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace zt::hf
