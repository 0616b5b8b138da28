// Hugging Face tokenizers (`tokenizer.json`) for the open decoder models: byte-level BPE (GPT-2,
// Llama 3, Qwen2) and SentencePiece-style BPE with byte fallback (Llama 2). encode() gives the ids
// that the Rust `tokenizers` library gives for the same file and text, decode() its text
// (docs/tokenizers.md lists what is supported and what is refused).
//
// Loading: from_file() reads `tokenizer.json` (or DIR/tokenizer.json) and refuses, with
// zt::DataError, anything it would not reproduce exactly: a model other than BPE, a normalizer,
// pre-tokenizer, decoder or post-processor kind it does not implement, options that change the
// ids and are not implemented (BPE dropout, subword prefixes, truncation, padding, added tokens
// with lstrip/rstrip/single_word), malformed JSON and missing fields. The message names the file,
// the field, what is supported and what was found.
//
// Ownership and thread safety: an HfTokenizer is immutable after loading. Copies share the loaded
// tables (cheap to copy, keep the tables alive); encode() and decode() are const and safe to call
// from several threads at once on the same object (the cache of encoded words is internally
// locked).
//
// Ids are uint32_t: vocabularies reach past 65,535 (Llama 3: 128,256).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

using TokenId = uint32_t;

class HfTokenizer {
 public:
  // The most bytes a tokenizer.json may have (the largest published ones have about 35 MB).
  static constexpr size_t kMaxFileBytes = size_t(64) << 20;

  // `path` is a tokenizer.json file or a directory that holds one. Throws zt::DataError.
  static HfTokenizer from_file(const std::filesystem::path& path);
  // The same from the file's text; `source` names it in error messages. The text may have at
  // most kMaxFileBytes and nest at most 32 levels deep.
  static HfTokenizer from_json(std::string_view json_text, const std::string& source = "<memory>");
  // The tokenizer.json that from_file(path) reads: `path`, or path/tokenizer.json for a directory.
  static std::filesystem::path json_file(const std::filesystem::path& path);
  // The text of json_file(path), read as from_file reads it: only a regular file (a device such
  // as /dev/zero or a FIFO is refused without reading it), of at most kMaxFileBytes. Throws
  // zt::DataError.
  static std::string read_json_file(const std::filesystem::path& path);

  // The model's tokens for `text` (UTF-8), without the post-processor's special tokens, like
  // Python's `encode(text, add_special_tokens=False)`. Special tokens written in the text are
  // matched as such. Throws zt::DataError for text that is not valid UTF-8.
  std::vector<TokenId> encode(std::string_view text) const;
  // The same with the post-processor's template applied (e.g. Llama's `<s>` or
  // `<|begin_of_text|>` in front), like Python's default `encode(text)`.
  std::vector<TokenId> encode_with_special_tokens(std::string_view text) const;

  // Text of `ids` through the file's decoder, like Python's `decode(ids, skip_special_tokens)`.
  // Unlike Python, which drops them silently, an id outside the vocabulary throws zt::DataError.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false) const;

  // One more than the largest id of the model's vocabulary and the added tokens.
  size_t vocab_size() const;
  std::optional<TokenId> token_to_id(std::string_view token) const;
  // The token's text as the vocabulary stores it (byte-level tokens in their mapped form).
  std::optional<std::string> id_to_token(TokenId id) const;
  // Whether `id` is an added token marked `special` (skipped by decode(ids, true)).
  bool is_special(TokenId id) const;
  // The file it was read from (or the `source` given to from_json).
  const std::string& source() const;

  struct Impl;

 private:
  explicit HfTokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace zt
