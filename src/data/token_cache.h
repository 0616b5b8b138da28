// What the token caches of src/data share (tokenized_data.cpp's corpora, finetune_cache.cpp's
// fine-tuning examples): the content checksum a cache carries so that a truncated or altered one
// is rebuilt rather than trusted, a read-only map of a whole file, and publishing a temporary
// file into place. Internal to src/data.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace zt::data {

// What a cache was made from, kept in its header: a cache with another key is stale.
struct CacheKey {
  uint64_t tokenizer_hash = 0;
  uint64_t corpus_size = 0;
  uint64_t corpus_mtime_ns = 0;
  int32_t format = 0;  // what the data file is read as (CorpusFormat, or a fine-tuning layout)
  int64_t eos = -1;    // none, else 31 bits of the token's hash

  // A mark, the key's layout version, then the fields, 64-bit ones in halves (10 ints).
  std::vector<int32_t> header_ints() const;
};

// The key a cache of `corpus` must carry; stat()s the corpus (a DataError naming data.path when it
// is not a readable file).
CacheKey key_of(const std::filesystem::path& corpus, int32_t format, uint64_t tokenizer_hash,
                const std::string& eos_token);

// FNV-1a over the bytes: a tokenizer file's identity.
uint64_t content_hash(std::string_view bytes);

// The whole file; a DataError naming `what` and the path when it cannot be read.
std::string read_file(const std::filesystem::path& path, const std::string& what);
// The text of data.tokenizer's tokenizer.json, read as HfTokenizer::from_file reads it (a regular
// file of bounded size; a FIFO or a device such as /dev/zero is refused unread), errors prefixed
// with "data.tokenizer".
std::string read_tokenizer_text(const std::filesystem::path& tokenizer_path);

// `path`, or path/tokenizer.json when it is a directory.
std::filesystem::path tokenizer_file(const std::filesystem::path& path);

// Prints "tokenizing FILE: x of y MiB (p%)" on stderr at most every 10% and every 5 s, for a file
// of 16 MiB or more when enabled.
class Progress {
 public:
  Progress(bool enabled, const std::filesystem::path& file, int64_t total);
  void update(int64_t done);

 private:
  bool enabled_;
  std::string file_;
  int64_t total_;
  int64_t last_tenth_ = 0;
  int64_t last_ns_ = 0;
};

// The JSON object of one jsonl line, or a DataError naming the file and line.
nlohmann::json parse_line(std::string_view line, const std::string& file, int64_t number);

// object[key] as a string, or a DataError naming the file, the line and `what` (the kind of line).
const std::string& string_field(const nlohmann::json& object, const char* key, const std::string& file,
                                int64_t number, const std::string& what);

// `line` without a trailing '\r'; whether it is blank (spaces and tabs only).
inline bool trim_line(std::string_view& line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line.find_first_not_of(" \t") == std::string_view::npos;
}

// Calls fn(line, number, end) for every non-blank line of `text`; `end` is the offset past it.
template <typename Fn>
void for_each_line(std::string_view text, Fn&& fn) {
  int64_t number = 0;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    ++number;
    std::string_view line = text.substr(at, end - at);
    if (!trim_line(line)) fn(line, number, end);
    at = end + 1;
  }
}

// A 64-bit checksum of a byte stream, the same whatever pieces it is fed in. Eight bytes per
// multiply, so hashing a cache costs little beside reading it; it detects damage (truncation,
// changed ids), it is not a defence against someone who rewrites the checksum too.
class Checksum {
 public:
  void update(const void* bytes, size_t size);
  uint64_t value() const;

 private:
  void word(uint64_t w);
  uint64_t state_ = 0x6a09e667f3bcc908ULL;
  uint64_t length_ = 0;
  unsigned char pending_[8] = {};
  size_t pending_size_ = 0;
};

// The checksum of `size` bytes of `file` from `offset`, read in pieces (nothing held beyond one
// piece); nullopt when the file cannot be read that far.
std::optional<uint64_t> file_checksum(const std::filesystem::path& file, uint64_t offset, uint64_t size);

// A whole file mapped read-only (empty files are not mapped). Pages are read when first touched.
class MappedFile {
 public:
  // Throws zt::DataError naming `what` and the file when it cannot be opened or mapped.
  MappedFile(const std::filesystem::path& file, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return static_cast<const unsigned char*>(map_); }
  uint64_t size() const { return size_; }

 private:
  void* map_ = nullptr;
  uint64_t size_ = 0;
};

// `temporary` renamed to `target` (a reader sees the old file or the whole new one); throws
// zt::DataError naming both when the rename fails.
void publish_file(const std::filesystem::path& temporary, const std::filesystem::path& target);

// A path beside `target` for this process's temporary copy of it.
std::filesystem::path temporary_path_for(const std::filesystem::path& target);

}  // namespace zt::data
