// The fine-tuning cache (zerotrain/data/tokenized_data.h load_finetune_cache): a jsonl file of examples
// tokenized once, a line at a time, into a file that ranks map and read by example.
//
// Layout, little-endian: a 1024-byte header (Header below, then zeros), then
//   tokens         uint32[n_tokens]
//   trained        uint8[n_tokens], then zeros up to a multiple of 8 bytes from the file's start
//   starts         int64[n_examples + 1]   (starts[0] = 0, ascending, starts[n] = n_tokens)
//   lines          int64[n_examples]
//   first_targets  int64[n_examples]
// The checksum covers everything after the header.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <fstream>

#include <sys/stat.h>

#include "data/finetune_storage.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kMagic = 0x5446545A;  // "ZTFT"
constexpr int32_t kLayout = 1;
constexpr uint64_t kHeaderBytes = 1024;
// Far past any real file, and small enough that the layout's sums cannot overflow.
constexpr int64_t kMaxCount = int64_t(1) << 40;

struct Header {
  int32_t magic = kMagic, layout = kLayout;
  int32_t key[10] = {};
  int32_t unused = 0;
  int64_t tokens = 0, examples = 0, max_id = 0;
  uint64_t checksum = 0;
};
static_assert(sizeof(Header) <= kHeaderBytes && offsetof(Header, tokens) == 56);

// Byte offsets of the columns.
struct Layout {
  uint64_t trained, starts, lines, first_targets, end;
};

Layout layout_of(int64_t n_tokens, int64_t n_examples) {
  Layout l;
  const uint64_t tokens = uint64_t(n_tokens), examples = uint64_t(n_examples);
  l.trained = kHeaderBytes + 4 * tokens;
  l.starts = (l.trained + tokens + 7) / 8 * 8;  // the int64 columns 8-byte aligned
  l.lines = l.starts + 8 * (examples + 1);
  l.first_targets = l.lines + 8 * examples;
  l.end = l.first_targets + 8 * examples;
  return l;
}

// 16 + the template's index: the cache key's format field (the corpora use 1 and 2).
int32_t format_of(const std::string& chat_template) {
  const char* names[] = {"auto", "chatml", "llama3"};
  for (int32_t i = 0; i < 3; ++i)
    if (chat_template == names[i]) return 16 + i;
  return 16 + 3 + int32_t(data::content_hash(chat_template) & 0xffff);
}

std::optional<Header> read_header(const fs::path& cache) {
  std::ifstream in(cache, std::ios::binary);
  if (!in) return std::nullopt;
  char bytes[sizeof(Header)];
  in.read(bytes, sizeof bytes);
  if (in.gcount() != std::streamsize(sizeof bytes)) return std::nullopt;
  Header h;
  std::memcpy(&h, bytes, sizeof h);
  return h;
}

// The checksum of the body and the largest token id, in one pass of reads (nothing mapped).
struct BodyFigures {
  uint64_t checksum = 0;
  int64_t max_id = 0;
};
std::optional<BodyFigures> read_body(const fs::path& cache, const Layout& l) {
  std::ifstream in(cache, std::ios::binary);
  if (!in) return std::nullopt;
  in.seekg(std::streamoff(kHeaderBytes));
  std::vector<char> piece(1 << 20);  // a multiple of 4: token ids never straddle two pieces
  data::Checksum sum;
  BodyFigures out;
  for (uint64_t at = kHeaderBytes; at < l.end;) {
    const size_t want = size_t(std::min<uint64_t>(piece.size(), l.end - at));
    in.read(piece.data(), std::streamsize(want));
    if (in.gcount() != std::streamsize(want)) return std::nullopt;
    sum.update(piece.data(), want);
    for (uint64_t k = at; k < std::min<uint64_t>(at + want, l.trained); k += 4) {
      uint32_t id;
      std::memcpy(&id, piece.data() + (k - at), 4);
      out.max_id = std::max<int64_t>(out.max_id, id);
    }
    at += want;
  }
  out.checksum = sum.value();
  return out;
}

// Whether `cache` carries `key`, has the size its counts give, and its body the recorded checksum
// and largest id. Reads the file through (not mapped: the pages read are not this process's).
std::optional<Header> verified_header(const fs::path& cache, const data::CacheKey& key) {
  const std::optional<Header> h = read_header(cache);
  if (!h || h->magic != kMagic || h->layout != kLayout) return std::nullopt;
  const std::vector<int32_t> want = key.header_ints();
  if (!std::equal(want.begin(), want.end(), h->key)) return std::nullopt;
  if (h->tokens < 0 || h->tokens > kMaxCount || h->examples < 1 || h->examples > kMaxCount) return std::nullopt;
  const Layout l = layout_of(h->tokens, h->examples);
  std::error_code error;
  if (fs::file_size(cache, error) != l.end || error) return std::nullopt;
  const std::optional<BodyFigures> body = read_body(cache, l);
  if (!body || body->checksum != h->checksum || body->max_id != h->max_id) return std::nullopt;
  return h;
}

// The examples of a verified cache, mapped; nullopt when its index is inconsistent (a file whose
// checksum was made to match: never read past the columns).
std::optional<FinetuneExamples> map_examples(const fs::path& cache, const Header& h, const std::string& source) {
  auto storage = std::make_shared<FinetuneExamples::Storage>();
  storage->map = std::make_shared<const data::MappedFile>(cache, "fine-tuning cache");
  const data::MappedFile& map = *storage->map;
  const Layout l = layout_of(h.tokens, h.examples);
  if (map.size() != l.end) return std::nullopt;
  const auto n = size_t(h.examples);
  const std::span<const int64_t> starts(reinterpret_cast<const int64_t*>(map.data() + l.starts), n + 1);
  const std::span<const int64_t> lines(reinterpret_cast<const int64_t*>(map.data() + l.lines), n);
  const std::span<const int64_t> firsts(reinterpret_cast<const int64_t*>(map.data() + l.first_targets), n);
  if (starts[0] != 0 || starts[n] != h.tokens) return std::nullopt;
  for (size_t i = 0; i < n; ++i) {
    const int64_t size = starts[i + 1] - starts[i];
    if (size < 1 || firsts[i] < 1 || firsts[i] > size || lines[i] < 1) return std::nullopt;
  }
  storage->map_setup_bytes = int64_t(kHeaderBytes + (l.end - l.starts));
  const std::span<const uint32_t> tokens(reinterpret_cast<const uint32_t*>(map.data() + kHeaderBytes),
                                         size_t(h.tokens));
  const std::span<const uint8_t> trained(map.data() + l.trained, size_t(h.tokens));
  return FinetuneStorageAccess::mapped(std::move(storage), tokens, trained, starts, lines, firsts,
                                       uint32_t(h.max_id), source);
}

// Writes the examples of `path` into `temporary` a line at a time; the header's counts.
class CacheWriter {
 public:
  explicit CacheWriter(const fs::path& temporary) : temporary_(temporary), side_(temporary.string() + ".trained") {
    out_.open(temporary_, std::ios::binary | std::ios::trunc);
    trained_.open(side_, std::ios::binary | std::ios::trunc);
    if (!out_ || !trained_) throw DataError(fmt::format("cannot create the token cache '{}'", temporary_.string()));
    const std::vector<char> zeros(kHeaderBytes, 0);
    out_.write(zeros.data(), std::streamsize(zeros.size()));
  }
  ~CacheWriter() {
    std::error_code ignored;
    fs::remove(side_, ignored);
  }

  void add(const EncodedExample& e, int64_t line) {
    write(e.tokens.data(), e.tokens.size() * sizeof(uint32_t));
    trained_.write(reinterpret_cast<const char*>(e.trained.data()), std::streamsize(e.trained.size()));
    for (uint32_t id : e.tokens) header_.max_id = std::max<int64_t>(header_.max_id, id);
    header_.tokens += int64_t(e.tokens.size());
    starts_.push_back(header_.tokens);
    lines_.push_back(line);
    first_targets_.push_back(first_target_of(e.trained.data(), int64_t(e.trained.size())));
  }
  int64_t count() const { return int64_t(lines_.size()); }

  // The trained flags and the index after the tokens, then the header.
  void finish(const data::CacheKey& key) {
    trained_.close();
    if (!trained_) throw DataError(fmt::format("error writing the token cache '{}'", side_.string()));
    std::ifstream side(side_, std::ios::binary);
    std::vector<char> piece(1 << 20);
    while (side) {
      side.read(piece.data(), std::streamsize(piece.size()));
      write(piece.data(), size_t(side.gcount()));
    }
    const char zeros[8] = {};
    write(zeros, (8 - uint64_t(header_.tokens) * 5 % 8) % 8);
    write(starts_.data(), starts_.size() * sizeof(int64_t));
    write(lines_.data(), lines_.size() * sizeof(int64_t));
    write(first_targets_.data(), first_targets_.size() * sizeof(int64_t));
    header_.examples = count();
    header_.checksum = sum_.value();
    const std::vector<int32_t> ints = key.header_ints();
    std::copy(ints.begin(), ints.end(), header_.key);
    out_.seekp(0);
    out_.write(reinterpret_cast<const char*>(&header_), sizeof header_);
    out_.close();
    if (!out_ || side.bad()) throw DataError(fmt::format("error writing the token cache '{}'", temporary_.string()));
  }

 private:
  void write(const void* bytes, size_t size) {
    out_.write(static_cast<const char*>(bytes), std::streamsize(size));
    sum_.update(bytes, size);
  }

  fs::path temporary_, side_;
  std::ofstream out_, trained_;
  Header header_;
  data::Checksum sum_;
  std::vector<int64_t> starts_{0}, lines_, first_targets_;
};

// Tokenizes `path` into `cache` (through a temporary file renamed into place).
void build_cache(const fs::path& path, const fs::path& cache, const HfTokenizer& tokenizer,
                 const std::string& chat_template, std::optional<TokenId> eos, const data::CacheKey& key,
                 bool progress_lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("data.path '{}': cannot open the file", path.string()));
  const std::string file = path.string();
  const fs::path temporary = data::temporary_path_for(cache);
  try {
    CacheWriter writer(temporary);
    data::Progress progress(progress_lines, path, int64_t(key.corpus_size));
    std::optional<ChatTemplate> chat;
    std::string text;
    int64_t number = 0, offset = 0;
    while (std::getline(in, text)) {
      ++number;
      offset += int64_t(text.size()) + 1;
      std::string_view line = text;
      if (data::trim_line(line)) continue;
      writer.add(encode_example(line, file, number, tokenizer, chat_template, chat, eos), number);
      progress.update(offset);
    }
    if (in.bad()) throw DataError(fmt::format("data.path '{}': reading the file failed", file));
    if (writer.count() == 0)
      throw DataError(fmt::format("data.path '{}': expected fine-tuning examples, found none", file));
    writer.finish(key);
    data::publish_file(temporary, cache);
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

}  // namespace

FinetuneCache load_finetune_cache(const fs::path& path, const fs::path& tokenizer_path,
                                  const std::string& chat_template, const TokenizeOptions& options) {
  const fs::path tokenizer_json = data::tokenizer_file(tokenizer_path);
  const std::string tokenizer_text = data::read_tokenizer_text(tokenizer_path);
  const data::CacheKey key =
      data::key_of(path, format_of(chat_template), data::content_hash(tokenizer_text), options.eos_token);
  const fs::path dir = options.cache_dir.empty() ? path.parent_path() : options.cache_dir;
  FinetuneCache out;
  out.cache_file = (dir.empty() ? fs::path(".") : dir) /
                   fmt::format("{}.{:08x}.examples.bin", path.filename().string(), uint32_t(key.tokenizer_hash));
  if (const auto h = verified_header(out.cache_file, key))
    if (auto mapped = map_examples(out.cache_file, *h, path.string())) {
      out.examples = std::move(*mapped);
      return out;
    }
  const HfTokenizer tokenizer = HfTokenizer::from_json(tokenizer_text, tokenizer_json.string());
  std::optional<TokenId> eos;
  if (!options.eos_token.empty()) eos = require_token(tokenizer, options.eos_token, "data.eos_token");
  if (!options.cache_dir.empty()) {
    std::error_code error;
    fs::create_directories(options.cache_dir, error);
    if (error)
      throw DataError(fmt::format("data.cache_dir: cannot create '{}': {}", options.cache_dir.string(),
                                  error.message()));
  }
  build_cache(path, out.cache_file, tokenizer, chat_template, eos, key, options.progress);
  const std::optional<Header> h = read_header(out.cache_file);
  std::optional<FinetuneExamples> mapped;
  if (h) mapped = map_examples(out.cache_file, *h, path.string());
  if (!mapped)
    throw DataError(fmt::format("fine-tuning cache '{}': changed while it was being opened", out.cache_file.string()));
  out.examples = std::move(*mapped);
  out.built = true;
  return out;
}

}  // namespace zt
