// HfTokenizer: encoding and decoding over the stages of data/hf_pipeline.h.
#include <fstream>
#include <sstream>

#include "data/hf_pipeline.h"
#include "data/hf_utf8.h"
#include "zerotrain/error.h"
#include "zerotrain/tokenizer.h"

namespace zt {

HfTokenizer::HfTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

HfTokenizer HfTokenizer::from_file(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) file = path / "tokenizer.json";
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw DataError("tokenizer " + file.string() + ": cannot open the file (expected a tokenizer.json, or a " +
                    "directory that holds one)");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DataError("tokenizer " + file.string() + ": reading the file failed");
  return from_json(text.str(), file.string());
}

HfTokenizer HfTokenizer::from_json(std::string_view json_text, const std::string& source) {
  return HfTokenizer(hf::load_tokenizer_json(json_text, source));
}

std::vector<TokenId> HfTokenizer::encode(std::string_view text) const {
  if (auto bad = hf::first_invalid_utf8(text))
    throw DataError("tokenizer " + impl_->source + ": the text to encode is not valid UTF-8 (byte " +
                    std::to_string(*bad) + " of " + std::to_string(text.size()) + ")");
  std::vector<hf::Piece> raw_pieces;
  if (impl_->raw_added_tokens.empty())
    raw_pieces.push_back({std::string(text), std::nullopt, true});
  else
    impl_->raw_added_tokens.split(text, true, raw_pieces);

  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<hf::Piece> pieces, words;
  for (hf::Piece& raw : raw_pieces) {
    if (raw.added_id) {
      ids.push_back(*raw.added_id);
      continue;
    }
    hf::normalize(impl_->normalizers, raw.text);
    pieces.clear();
    if (impl_->normalized_added_tokens.empty())
      pieces.push_back(std::move(raw));
    else
      impl_->normalized_added_tokens.split(raw.text, raw.at_origin, pieces);
    for (hf::Piece& piece : pieces) {
      if (piece.added_id) {
        ids.push_back(*piece.added_id);
        continue;
      }
      if (piece.text.empty()) continue;
      words.clear();
      bool byte_level = false;
      hf::pre_tokenize(impl_->pre_tokenizers, std::move(piece), words, byte_level);
      for (const hf::Piece& word : words) impl_->model->encode_word(word.text, byte_level, ids);
    }
  }
  return ids;
}

std::vector<TokenId> HfTokenizer::encode_with_special_tokens(std::string_view text) const {
  std::vector<TokenId> encoded = encode(text);
  if (impl_->single_template.empty()) return encoded;
  std::vector<TokenId> ids;
  ids.reserve(encoded.size() + 4);
  for (const hf::TemplatePart& part : impl_->single_template) {
    if (part.is_sequence)
      ids.insert(ids.end(), encoded.begin(), encoded.end());
    else
      ids.insert(ids.end(), part.ids.begin(), part.ids.end());
  }
  return ids;
}

std::string HfTokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    std::string token;
    if (auto added = impl_->added_tokens_by_id.find(ids[i]); added != impl_->added_tokens_by_id.end()) {
      token = added->second;
    } else if (const std::string* model_token = impl_->model->id_to_token(ids[i])) {
      token = *model_token;
    } else {
      throw DataError("tokenizer " + impl_->source + ": cannot decode id " + std::to_string(ids[i]) + " at position " +
                      std::to_string(i) + " (the vocabulary has no such id; its ids are below " +
                      std::to_string(impl_->vocab_size) + ")");
    }
    if (skip_special_tokens && impl_->special_token_contents.contains(token)) continue;
    tokens.push_back(std::move(token));
  }
  return hf::decode_tokens(impl_->decoders, std::move(tokens), impl_->has_decoder);
}

size_t HfTokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<TokenId> HfTokenizer::token_to_id(std::string_view token) const {
  for (const auto& [id, content] : impl_->added_tokens_by_id)
    if (content == token) return id;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> HfTokenizer::id_to_token(TokenId id) const {
  if (auto added = impl_->added_tokens_by_id.find(id); added != impl_->added_tokens_by_id.end()) return added->second;
  if (const std::string* token = impl_->model->id_to_token(id)) return *token;
  return std::nullopt;
}

bool HfTokenizer::is_special(TokenId id) const {
  auto added = impl_->added_tokens_by_id.find(id);
  return added != impl_->added_tokens_by_id.end() && impl_->special_token_contents.contains(added->second);
}

const std::string& HfTokenizer::source() const { return impl_->source; }

}  // namespace zt
