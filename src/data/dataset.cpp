// TokenDataset: flat uint16/uint32 token storage, `.bin` readers/writers and splitting.
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "zerotrain/data/data.h"
// GCC 12 reports a false -Wstringop-overflow inside std::string concatenation at -O2 (GCC bug
// 105329); the concatenations here are ordinary.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
#include "zerotrain/error.h"

namespace zt {

// Both formats store little-endian values; reading them in place needs a little-endian host.
static_assert(std::endian::native == std::endian::little, "token files are read in place as little-endian");

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersionU16 = 1;
constexpr int32_t kLlmcVersionU32 = 2;  // llm.c's own layout for Llama 3's tokens
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

std::string quote(const std::filesystem::path& p) {
  std::string quoted = "'";  // appended, not concatenated: GCC 12's -Wrestrict misfires on "'" + s
  quoted += p.string();
  quoted += '\'';
  return quoted;
}

}  // namespace

// Owns the bytes: either a vector or a read-only private memory map of a whole file.
struct TokenDataset::Storage {
  std::vector<uint16_t> vec;
  std::vector<uint32_t> vec32;
  void* map = nullptr;
  size_t map_bytes = 0;
  ~Storage() {
    if (map) munmap(map, map_bytes);
  }
};

TokenDataset::TokenDataset(std::shared_ptr<const Storage> storage, const void* data, TokenWidth width, int64_t size,
                           std::string source)
    : storage_(std::move(storage)), data_(data), width_(width), size_(size), source_(std::move(source)) {}

TokenDataset::TokenDataset(std::vector<uint16_t> tokens, std::string source) : source_(std::move(source)) {
  auto s = std::make_shared<Storage>();
  s->vec = std::move(tokens);
  data_ = s->vec.data();
  size_ = static_cast<int64_t>(s->vec.size());
  storage_ = std::move(s);
}

TokenDataset::TokenDataset(std::vector<uint32_t> tokens, std::string source)
    : width_(TokenWidth::U32), source_(std::move(source)) {
  auto s = std::make_shared<Storage>();
  s->vec32 = std::move(tokens);
  data_ = s->vec32.data();
  size_ = static_cast<int64_t>(s->vec32.size());
  storage_ = std::move(s);
}

const uint16_t* TokenDataset::data16() const {
  if (width_ != TokenWidth::U16)
    throw DataError("token data " + source_ +
                    " holds uint32 ids (an llm.c version 2 file); expected uint16 ids (the BERT's data is uint16 only)");
  return static_cast<const uint16_t*>(data_);
}

const uint32_t* TokenDataset::data32() const {
  if (width_ != TokenWidth::U32)
    throw DataError("token data " + source_ + " holds uint16 ids, read as uint32");
  return static_cast<const uint32_t*>(data_);
}

TokenDataset TokenDataset::from_text(std::string_view text, const ByteTokenizer& tokenizer) {
  return TokenDataset(tokenizer.encode(text), "<text>");
}

TokenDataset TokenDataset::from_bin_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw DataError("cannot open token file " + quote(path) + ": " + std::strerror(errno) +
                    " (expected a nanoGPT or llm.c .bin token file)");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError("token file " + quote(path) + " is not a regular file");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    throw DataError("token file " + quote(path) + " is empty (expected tokens)");
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED)
    throw DataError("cannot map token file " + quote(path) + ": " + std::strerror(map_errno));
  auto storage = std::make_shared<Storage>();
  storage->map = map;
  storage->map_bytes = bytes;
  // Sequential scans (max_token, validate) and random windows both benefit from readahead hints
  // being left at the default; no madvise.

  const auto* base = static_cast<const unsigned char*>(map);
  int32_t magic = 0;
  if (bytes >= sizeof(int32_t)) std::memcpy(&magic, base, sizeof magic);
  if (magic == kLlmcMagic) {
    if (bytes < kLlmcHeaderBytes)
      throw DataError("llm.c token file " + quote(path) + " is truncated: expected a " +
                      std::to_string(kLlmcHeaderBytes) + "-byte header, found " + std::to_string(bytes) + " bytes");
    int32_t header[kLlmcHeaderInts];
    std::memcpy(header, base, kLlmcHeaderBytes);
    if (header[1] != kLlmcVersionU16 && header[1] != kLlmcVersionU32)
      throw DataError("llm.c token file " + quote(path) + " has version " + std::to_string(header[1]) +
                      "; expected version 1 (uint16 tokens) or 2 (uint32 tokens)");
    const TokenWidth width = header[1] == kLlmcVersionU16 ? TokenWidth::U16 : TokenWidth::U32;
    const size_t id_bytes = static_cast<size_t>(width);
    const int64_t n = header[2];
    const size_t payload = bytes - kLlmcHeaderBytes;
    if (n < 0 || static_cast<size_t>(n) * id_bytes != payload)
      throw DataError("llm.c token file " + quote(path) + " header says " + std::to_string(n) + " tokens (" +
                      std::to_string(n * int64_t(id_bytes)) + " bytes after the header), found " +
                      std::to_string(payload) + " bytes (truncated or corrupt)");
    if (n == 0) throw DataError("llm.c token file " + quote(path) + " holds no tokens");
    return TokenDataset(std::move(storage), base + kLlmcHeaderBytes, width, n, path.string());
  }
  if (bytes % 2 != 0)
    throw DataError("token file " + quote(path) + " has an odd byte count (" + std::to_string(bytes) +
                    "); expected raw uint16 tokens (nanoGPT) or an llm.c header with magic " +
                    std::to_string(kLlmcMagic));
  return TokenDataset(std::move(storage), base, TokenWidth::U16, static_cast<int64_t>(bytes / 2), path.string());
}

void TokenDataset::write_bin_file(const std::filesystem::path& path, std::span<const uint16_t> tokens,
                                  BinFormat format) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw DataError("cannot create token file " + quote(path) + ": " + std::strerror(errno));
  if (format == BinFormat::LlmC) {
    if (tokens.size() > static_cast<size_t>(INT32_MAX))
      throw DataError("cannot write " + std::to_string(tokens.size()) + " tokens to llm.c file " + quote(path) +
                      ": its header counts tokens in an int32");
    int32_t header[kLlmcHeaderInts] = {};
    header[0] = kLlmcMagic;
    header[1] = kLlmcVersionU16;
    header[2] = static_cast<int32_t>(tokens.size());
    out.write(reinterpret_cast<const char*>(header), sizeof header);
  }
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size_bytes()));
  out.close();
  if (!out) throw DataError("error writing token file " + quote(path));
}

void TokenDataset::write_bin_file(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                                  std::span<const int32_t> header_extra) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    throw DataError("cannot write " + std::to_string(tokens.size()) + " tokens to llm.c file " + quote(path) +
                    ": its header counts tokens in an int32");
  if (header_extra.size() > kLlmcHeaderInts - 3)
    throw DataError("llm.c token file " + quote(path) + ": " + std::to_string(header_extra.size()) +
                    " extra header ints do not fit the header's " + std::to_string(kLlmcHeaderInts - 3));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw DataError("cannot create token file " + quote(path) + ": " + std::strerror(errno));
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = kLlmcMagic;
  header[1] = kLlmcVersionU32;
  header[2] = static_cast<int32_t>(tokens.size());
  std::copy(header_extra.begin(), header_extra.end(), header + 3);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size_bytes()));
  out.close();
  if (!out) throw DataError("error writing token file " + quote(path));
}

std::pair<TokenDataset, TokenDataset> TokenDataset::split(double val_fraction) const {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw ConfigError("split: val_fraction must be in [0, 1), found " + std::to_string(val_fraction));
  const auto n_val = static_cast<int64_t>(std::llround(static_cast<double>(size_) * val_fraction));
  const int64_t n_train = size_ - n_val;
  const auto* bytes = static_cast<const unsigned char*>(data_);
  const size_t id_bytes = static_cast<size_t>(width_);
  return {TokenDataset(storage_, data_, width_, n_train, source_ + " [train]"),
          TokenDataset(storage_, bytes + size_t(n_train) * id_bytes, width_, n_val, source_ + " [val]")};
}

namespace {

template <typename Id>
Id max_of(const Id* ids, int64_t n) {
  Id m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, ids[i]);
  return m;
}

template <typename Id>
int64_t first_at_or_above(const Id* ids, int64_t n, int64_t bound) {
  for (int64_t i = 0; i < n; ++i)
    if (int64_t(ids[i]) >= bound) return i;
  return -1;
}

}  // namespace

uint32_t TokenDataset::max_token() const {
  return width_ == TokenWidth::U16 ? uint32_t(max_of(static_cast<const uint16_t*>(data_), size_))
                                   : max_of(static_cast<const uint32_t*>(data_), size_);
}

void TokenDataset::validate(int64_t vocab_size) const {
  const int64_t i = width_ == TokenWidth::U16 ? first_at_or_above(static_cast<const uint16_t*>(data_), size_, vocab_size)
                                              : first_at_or_above(static_cast<const uint32_t*>(data_), size_, vocab_size);
  if (i >= 0)
    throw DataError("token data " + source_ + ": token id " + std::to_string((*this)[i]) + " at position " +
                    std::to_string(i) + " is outside the model's vocabulary (expected ids < " +
                    std::to_string(vocab_size) + ")");
}

void TokenDataset::require_tokens(int64_t n, const std::string& what) const {
  if (size_ < n)
    throw DataError("token data " + source_ + " has " + std::to_string(size_) + " tokens; " + what + " needs at least " +
                    std::to_string(n));
}

}  // namespace zt
