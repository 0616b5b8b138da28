// Corpora through a Hugging Face tokenizer and their token caches, and the tokens fine-tuning
// needs named (zerotrain/data/tokenized_data.h); the fine-tuning examples are in finetune_examples.cpp
// and their cache in finetune_cache.cpp.
#include "zerotrain/data/tokenized_data.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

#include "data/hf_utf8.h"
#include "data/token_cache.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using data::CacheKey;
using data::Progress;

constexpr size_t kHeaderBytes = 256 * sizeof(int32_t);
constexpr size_t kChecksumInt = 13;  // header ints 13 and 14: the tokens' checksum, low half first

// Whether `cache` exists, carries `key`, and holds exactly the tokens its header counts with the
// checksum it records: a truncated or altered cache is stale, rebuilt rather than trusted.
bool cache_matches(const fs::path& cache, const CacheKey& key) {
  std::ifstream in(cache, std::ios::binary);
  if (!in) return false;
  int32_t header[256] = {};
  in.read(reinterpret_cast<char*>(header), sizeof header);
  if (in.gcount() != sizeof header || header[0] != 20240520) return false;
  const std::vector<int32_t> want = key.header_ints();
  if (!std::equal(want.begin(), want.end(), header + 3)) return false;
  const uint64_t width = header[1] == 1 ? 2 : header[1] == 2 ? 4 : 0;
  if (width == 0 || header[2] < 0) return false;
  const uint64_t body = uint64_t(header[2]) * width;
  std::error_code error;
  if (fs::file_size(cache, error) != kHeaderBytes + body || error) return false;
  const uint64_t recorded = uint64_t(uint32_t(header[kChecksumInt])) | uint64_t(uint32_t(header[kChecksumInt + 1])) << 32;
  return data::file_checksum(cache, kHeaderBytes, body) == recorded;
}

// A printable ASCII character other than space: never part of a whitespace run, in any encoding
// of the regexes' \s (a byte >= 0x80 may begin or end a Unicode space such as U+00A0 or U+3000).
bool is_ascii_graphic(char c) { return c > 0x20 && c < 0x7f; }

// The end of the piece starting at `from`: just after the first newline at or past from + target
// that stands alone between two printable ASCII characters (the end of the text when there is
// none). Byte-level BPE's patterns split there in the whole text as in the piece: the newline is a
// piece of its own and the next character starts a new one. (After a longer whitespace run, e.g.
// "\n\n", they would not: GPT-2's `\s+(?!\S)` leaves the run's last character to the next piece
// in the whole text, but takes the whole run at the end of a piece.)
size_t piece_end(std::string_view text, size_t from, size_t target) {
  for (size_t i = std::max<size_t>(from + target, 2); i < text.size(); ++i)
    if (text[i - 1] == '\n' && is_ascii_graphic(text[i - 2]) && is_ascii_graphic(text[i])) return i;
  return text.size();
}

std::vector<TokenId> tokenize_text(std::string_view text, const fs::path& file, const HfTokenizer& tokenizer,
                                   const TokenizeOptions& options, Progress& progress) {
  std::vector<TokenId> ids;
  const size_t target = size_t(std::max<int64_t>(1, options.text_piece_bytes));
  for (size_t at = 0; at < text.size();) {
    const size_t end = piece_end(text, at, target);
    const std::string_view piece_text = text.substr(at, end - at);
    std::vector<TokenId> piece;
    try {
      piece = tokenizer.encode(piece_text);
    } catch (const DataError&) {
      // The tokenizer sees one piece: name the file and the offset in it instead.
      const std::optional<size_t> bad = hf::first_invalid_utf8(piece_text);
      if (!bad) throw;
      throw DataError(fmt::format("data.path '{}': expected UTF-8 text, found the byte 0x{:02x} that is not valid "
                                  "UTF-8 at byte offset {} of the file",
                                  file.string(), static_cast<unsigned char>(piece_text[*bad]), at + *bad));
    }
    ids.insert(ids.end(), piece.begin(), piece.end());
    at = end;
    progress.update(int64_t(at));
  }
  return ids;
}

std::vector<TokenId> tokenize_jsonl(std::string_view text, const std::string& file, const HfTokenizer& tokenizer,
                                    std::optional<TokenId> eos, Progress& progress) {
  std::vector<TokenId> ids;
  data::for_each_line(text, [&](std::string_view line, int64_t number, size_t end) {
    const json object = data::parse_line(line, file, number);
    const std::string& document = data::string_field(object, "text", file, number, "a document");
    std::vector<TokenId> doc;
    try {
      doc = tokenizer.encode_with_special_tokens(document);
    } catch (const DataError& e) {
      throw DataError(fmt::format("{}:{}: {}", file, number, e.what()));
    }
    ids.insert(ids.end(), doc.begin(), doc.end());
    if (eos) ids.push_back(*eos);
    progress.update(int64_t(end));
  });
  return ids;
}

// Writes `ids` as an llm.c token file carrying `key`, through a temporary file renamed into place.
void write_cache(const fs::path& cache, const std::vector<TokenId>& ids, bool wide, const CacheKey& key) {
  const fs::path temporary = data::temporary_path_for(cache);
  std::vector<int32_t> extra = key.header_ints();
  std::vector<uint16_t> narrow;
  if (!wide) narrow.assign(ids.begin(), ids.end());
  data::Checksum sum;
  if (wide) sum.update(ids.data(), ids.size() * sizeof(TokenId));
  else sum.update(narrow.data(), narrow.size() * sizeof(uint16_t));
  extra.resize(kChecksumInt - 3 + 2);
  extra[kChecksumInt - 3] = int32_t(uint32_t(sum.value()));
  extra[kChecksumInt - 2] = int32_t(uint32_t(sum.value() >> 32));
  try {
    if (wide) {
      TokenDataset::write_bin_file(temporary, std::span<const uint32_t>(ids), extra);
    } else {
      TokenDataset::write_bin_file(temporary, narrow, BinFormat::LlmC);
      // The uint16 writer leaves the spare ints zero: put the key there.
      std::fstream patch(temporary, std::ios::binary | std::ios::in | std::ios::out);
      patch.seekp(3 * sizeof(int32_t));
      patch.write(reinterpret_cast<const char*>(extra.data()), std::streamsize(extra.size() * sizeof(int32_t)));
      patch.close();
      if (!patch) throw DataError(fmt::format("error writing token cache '{}'", temporary.string()));
    }
    data::publish_file(temporary, cache);
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

}  // namespace

TokenizedCorpus load_tokenized_corpus(const fs::path& corpus, CorpusFormat format, const fs::path& tokenizer_path,
                                      const TokenizeOptions& options) {
  const fs::path tokenizer_json = data::tokenizer_file(tokenizer_path);
  const std::string tokenizer_text = data::read_tokenizer_text(tokenizer_path);
  const CacheKey key = data::key_of(corpus, int32_t(format), data::content_hash(tokenizer_text), options.eos_token);
  const fs::path dir = options.cache_dir.empty() ? corpus.parent_path() : options.cache_dir;
  const fs::path cache =
      (dir.empty() ? fs::path(".") : dir) /
      fmt::format("{}.{:08x}.tokens.bin", corpus.filename().string(), uint32_t(key.tokenizer_hash));
  TokenizedCorpus out;
  out.cache_file = cache;
  if (cache_matches(cache, key)) {
    out.tokens = TokenDataset::from_bin_file(cache);
    return out;
  }
  const HfTokenizer tokenizer = HfTokenizer::from_json(tokenizer_text, tokenizer_json.string());
  std::optional<TokenId> eos;
  if (!options.eos_token.empty()) eos = require_token(tokenizer, options.eos_token, "data.eos_token");
  const std::string text = data::read_file(corpus, "data.path");
  Progress progress(options.progress, corpus, int64_t(text.size()));
  std::vector<TokenId> ids = format == CorpusFormat::Text
                                 ? tokenize_text(text, corpus, tokenizer, options, progress)
                                 : tokenize_jsonl(text, corpus.string(), tokenizer, eos, progress);
  if (ids.empty()) throw DataError(fmt::format("data.path '{}': no tokens (the corpus is empty)", corpus.string()));
  if (!options.cache_dir.empty()) {
    std::error_code error;
    fs::create_directories(options.cache_dir, error);
    if (error)
      throw DataError(fmt::format("data.cache_dir: cannot create '{}': {}", options.cache_dir.string(),
                                  error.message()));
  }
  write_cache(cache, ids, tokenizer.vocab_size() > 65536, key);
  out.tokens = TokenDataset::from_bin_file(cache);
  out.built = true;
  return out;
}

// ---- fine-tuning examples ----

TokenId require_token(const HfTokenizer& tokenizer, const std::string& token, const std::string& key) {
  if (auto id = tokenizer.token_to_id(token)) return *id;
  throw DataError(fmt::format("{}: expected a token of the tokenizer {}, found \"{}\", which it does not have", key,
                              tokenizer.source(), token));
}

ChatTemplate resolve_chat_template(const std::string& name, const HfTokenizer& tokenizer) {
  auto has_all = [&](std::initializer_list<const char*> tokens) {
    for (const char* t : tokens)
      if (!tokenizer.token_to_id(t)) return std::string(t);
    return std::string();
  };
  const auto chatml = {"<|im_start|>", "<|im_end|>"};
  const auto llama3 = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  if (name == "chatml" || name == "llama3") {
    const std::string missing = has_all(name == "chatml" ? chatml : llama3);
    if (!missing.empty())
      throw DataError(fmt::format("data.chat_template \"{}\": the tokenizer {} has no token {}", name,
                                  tokenizer.source(), missing));
    return name == "chatml" ? ChatTemplate::ChatML : ChatTemplate::Llama3;
  }
  if (name != "auto")
    throw ConfigError(fmt::format("data.chat_template: expected \"auto\", \"chatml\" or \"llama3\", found \"{}\"", name));
  if (has_all(chatml).empty()) return ChatTemplate::ChatML;
  if (has_all(llama3).empty()) return ChatTemplate::Llama3;
  throw DataError(fmt::format(
      "data.chat_template \"auto\": the tokenizer {} has neither ChatML's <|im_start|>/<|im_end|> nor Llama 3's "
      "<|start_header_id|>/<|end_header_id|>/<|eot_id|>; chat messages need one of them",
      tokenizer.source()));
}

}  // namespace zt
