// HfTokenizer: encoding and decoding over the stages of data/hf_pipeline.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/printable.h"
#include "data/hf_pipeline.h"
#include "data/hf_utf8.h"
#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

namespace zt {

HfTokenizer::HfTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

std::filesystem::path HfTokenizer::json_file(const std::filesystem::path& path) {
  std::error_code error;
  return std::filesystem::is_directory(path, error) ? path / "tokenizer.json" : path;
}

std::string HfTokenizer::read_json_file(const std::filesystem::path& path) {
  const std::filesystem::path file = json_file(path);
  const std::string label = "tokenizer " + printable_utf8(file.string(), 400);
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below like any other
  // file that is not regular (a device such as /dev/zero would never end).
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0)
    throw DataError(label + ": cannot open the file: " + std::strerror(errno) +
                    " (expected a tokenizer.json, or a directory that holds one)");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw DataError(label + ": not a regular file (expected a tokenizer.json, or a directory that holds one)");
  const auto too_large = [&](const std::string& size) {
    return DataError(label + ": " + size + " bytes; expected at most " + std::to_string(kMaxFileBytes) +
                     " for a tokenizer.json");
  };
  if (uint64_t(st.st_size) > kMaxFileBytes) throw too_large(std::to_string(st.st_size));
  // Read at most one byte past the limit: a file growing while it is read is bounded too.
  std::string text(size_t(st.st_size) + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw DataError(label + ": reading the file failed: " + std::strerror(errno));
    if (n == 0) break;
    got += size_t(n);
    if (got == text.size() && text.size() <= kMaxFileBytes) text.resize(std::min(text.size() * 2, kMaxFileBytes + 1));
  }
  if (got > kMaxFileBytes) throw too_large("more than " + std::to_string(kMaxFileBytes));
  text.resize(got);
  return text;
}

HfTokenizer HfTokenizer::from_file(const std::filesystem::path& path) {
  return from_json(read_json_file(path), json_file(path).string());
}

HfTokenizer HfTokenizer::from_json(std::string_view json_text, const std::string& source) {
  return HfTokenizer(hf::load_tokenizer_json(json_text, source));
}

std::vector<TokenId> HfTokenizer::encode(std::string_view text) const {
  if (auto bad = hf::first_invalid_utf8(text))
    throw DataError("tokenizer " + printable_utf8(impl_->source, 400) + ": the text to encode is not valid UTF-8 (byte " +
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
      throw DataError("tokenizer " + printable_utf8(impl_->source, 400) + ": cannot decode id " + std::to_string(ids[i]) + " at position " +
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
