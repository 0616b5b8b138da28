// The token caches' shared parts (data/token_cache.h).
#include "data/token_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/mix64.h"
#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

namespace zt::data {

namespace {
constexpr int32_t kCacheMark = 0x4B54545A;  // "ZTTK"
// 2: the caches carry a checksum of their content (a version-1 cache, without it, is rebuilt).
constexpr int32_t kCacheKeyVersion = 2;
constexpr int64_t kProgressMinBytes = 16 << 20;  // smaller files tokenize without progress lines

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

std::vector<int32_t> CacheKey::header_ints() const {
  auto lo = [](uint64_t v) { return int32_t(uint32_t(v)); };
  auto hi = [](uint64_t v) { return int32_t(uint32_t(v >> 32)); };
  return {kCacheMark,      kCacheKeyVersion, lo(tokenizer_hash),    hi(tokenizer_hash),    lo(corpus_size),
          hi(corpus_size), lo(corpus_mtime_ns), hi(corpus_mtime_ns), format, int32_t(eos)};
}

CacheKey key_of(const std::filesystem::path& corpus, int32_t format, uint64_t tokenizer_hash,
                const std::string& eos_token) {
  struct stat st {};
  if (::stat(corpus.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw DataError(fmt::format("data.path: expected a readable file, found none at '{}'", corpus.string()));
  CacheKey key;
  key.tokenizer_hash = tokenizer_hash;
  key.corpus_size = uint64_t(st.st_size);
  key.corpus_mtime_ns = uint64_t(st.st_mtim.tv_sec) * 1'000'000'000ULL + uint64_t(st.st_mtim.tv_nsec);
  key.format = format;
  key.eos = eos_token.empty() ? -1 : int64_t(uint32_t(content_hash(eos_token)) & 0x7fffffff);
  return key;
}

uint64_t content_hash(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

std::string read_file(const std::filesystem::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{} '{}': cannot open the file", what, path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DataError(fmt::format("{} '{}': reading the file failed", what, path.string()));
  return text.str();
}

std::string read_tokenizer_text(const std::filesystem::path& tokenizer_path) {
  try {
    return HfTokenizer::read_json_file(tokenizer_path);
  } catch (const DataError& e) {
    throw DataError(std::string("data.tokenizer: ") + e.what());
  }
}

std::filesystem::path tokenizer_file(const std::filesystem::path& path) {
  std::error_code error;
  return std::filesystem::is_directory(path, error) ? path / "tokenizer.json" : path;
}

Progress::Progress(bool enabled, const std::filesystem::path& file, int64_t total)
    : enabled_(enabled && total >= kProgressMinBytes), file_(file.string()), total_(total), last_ns_(now_ns()) {}

void Progress::update(int64_t done) {
  if (!enabled_) return;
  const int64_t now = now_ns();
  const int64_t tenth = done * 10 / std::max<int64_t>(1, total_);
  if (tenth <= last_tenth_ && now - last_ns_ < 5'000'000'000LL) return;
  last_tenth_ = tenth;
  last_ns_ = now;
  std::fprintf(stderr, "tokenizing %s: %.0f of %.0f MiB (%.0f%%)\n", file_.c_str(), double(done) / (1 << 20),
               double(total_) / (1 << 20), 100.0 * double(done) / double(std::max<int64_t>(1, total_)));
  std::fflush(stderr);
}

nlohmann::json parse_line(std::string_view line, const std::string& file, int64_t number) {
  nlohmann::json value = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded())
    throw DataError(fmt::format("{}:{}: expected one JSON object per line, found text that is not JSON", file, number));
  if (!value.is_object())
    throw DataError(fmt::format("{}:{}: expected a JSON object per line, found a JSON {}", file, number,
                                value.type_name()));
  return value;
}

const std::string& string_field(const nlohmann::json& object, const char* key, const std::string& file,
                                int64_t number, const std::string& what) {
  auto it = object.find(key);
  if (it == object.end())
    throw DataError(fmt::format("{}:{}: expected {} with a string \"{}\", found no \"{}\"", file, number, what, key, key));
  if (!it->is_string())
    throw DataError(fmt::format("{}:{}: \"{}\" must be a string, found a JSON {}", file, number, key, it->type_name()));
  return it->get_ref<const std::string&>();
}

void Checksum::word(uint64_t w) {
  state_ = (state_ ^ w) * 0x9E3779B97F4A7C15ULL;
  state_ ^= state_ >> 29;
}

void Checksum::update(const void* bytes, size_t size) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  length_ += size;
  while (size > 0 && pending_size_ > 0) {
    pending_[pending_size_++] = *p++;
    --size;
    if (pending_size_ == 8) {
      uint64_t w;
      std::memcpy(&w, pending_, 8);
      word(w);
      pending_size_ = 0;
    }
  }
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    word(w);
  }
  std::memcpy(pending_ + pending_size_, p, size);
  pending_size_ += size;
}

uint64_t Checksum::value() const {
  uint64_t tail = 0;
  std::memcpy(&tail, pending_, pending_size_);
  // The length in the result: a stream and the same stream with zero bytes appended differ.
  return mix64(mix64(state_ ^ tail) ^ length_);
}

std::optional<uint64_t> file_checksum(const std::filesystem::path& file, uint64_t offset, uint64_t size) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::vector<unsigned char> piece(1 << 20);
  Checksum sum;
  bool ok = true;
  for (uint64_t done = 0; done < size && ok;) {
    const size_t want = size_t(std::min<uint64_t>(piece.size(), size - done));
    const ssize_t got = ::pread(fd, piece.data(), want, off_t(offset + done));
    if (got < 0 && errno == EINTR) continue;
    ok = got > 0;
    if (!ok) break;
    sum.update(piece.data(), size_t(got));
    done += uint64_t(got);
  }
  ::close(fd);
  if (!ok) return std::nullopt;
  return sum.value();
}

MappedFile::MappedFile(const std::filesystem::path& file, const std::string& what) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw DataError(fmt::format("{} '{}': cannot open the file: {}", what, file.string(), std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    throw DataError(fmt::format("{} '{}': cannot read its size: {}", what, file.string(), std::strerror(error)));
  }
  size_ = uint64_t(st.st_size);
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      const int error = errno;
      map_ = nullptr;
      ::close(fd);
      throw DataError(fmt::format("{} '{}': cannot map {} bytes: {}", what, file.string(), size_,
                                  std::strerror(error)));
    }
    // Ranks read the examples they sample, scattered over the file: no readahead around them.
    ::madvise(map_, size_, MADV_RANDOM);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

void publish_file(const std::filesystem::path& temporary, const std::filesystem::path& target) {
  std::error_code error;
  std::filesystem::rename(temporary, target, error);
  if (error)
    throw DataError(fmt::format("cannot move the token cache '{}' into place as '{}': {}", temporary.string(),
                                target.string(), error.message()));
}

std::filesystem::path temporary_path_for(const std::filesystem::path& target) {
  return target.string() + fmt::format(".tmp-{}", ::getpid());
}

}  // namespace zt::data
