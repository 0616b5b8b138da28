// TokenDataset: flat uint16 token storage, `.bin` readers/writers and splitting.
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

#include "zerotrain/data.h"
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
constexpr int32_t kLlmcVersionU16 = 1;  // version 2 is llm.c's uint32 (Llama 3) tokens
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

std::string quote(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

}  // namespace

// Owns the bytes: either a vector or a read-only private memory map of a whole file.
struct TokenDataset::Storage {
  std::vector<uint16_t> vec;
  void* map = nullptr;
  size_t map_bytes = 0;
  ~Storage() {
    if (map) munmap(map, map_bytes);
  }
};

TokenDataset::TokenDataset(std::shared_ptr<const Storage> storage, const uint16_t* data, int64_t size,
                           std::string source)
    : storage_(std::move(storage)), data_(data), size_(size), source_(std::move(source)) {}

TokenDataset::TokenDataset(std::vector<uint16_t> tokens, std::string source) : source_(std::move(source)) {
  auto s = std::make_shared<Storage>();
  s->vec = std::move(tokens);
  data_ = s->vec.data();
  size_ = static_cast<int64_t>(s->vec.size());
  storage_ = std::move(s);
}

TokenDataset TokenDataset::from_text(std::string_view text, const ByteTokenizer& tokenizer) {
  return TokenDataset(tokenizer.encode(text), "<text>");
}

TokenDataset TokenDataset::from_bin_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw DataError("cannot open token file " + quote(path) + ": " + std::strerror(errno) +
                    " (expected a nanoGPT or llm.c uint16 .bin file)");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError("token file " + quote(path) + " is not a regular file");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes == 0) {
    ::close(fd);
    throw DataError("token file " + quote(path) + " is empty (expected uint16 tokens)");
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
    if (header[1] != kLlmcVersionU16)
      throw DataError("llm.c token file " + quote(path) + " has version " + std::to_string(header[1]) +
                      "; expected version 1 (uint16 tokens)" +
                      (header[1] == 2 ? " — version 2 holds uint32 tokens, which are not supported" : ""));
    const int64_t n = header[2];
    const size_t payload = bytes - kLlmcHeaderBytes;
    if (n < 0 || static_cast<size_t>(n) * 2 != payload)
      throw DataError("llm.c token file " + quote(path) + " header says " + std::to_string(n) + " tokens (" +
                      std::to_string(n * 2) + " bytes after the header), found " + std::to_string(payload) +
                      " bytes (truncated or corrupt)");
    if (n == 0) throw DataError("llm.c token file " + quote(path) + " holds no tokens");
    const auto* data = reinterpret_cast<const uint16_t*>(base + kLlmcHeaderBytes);
    return TokenDataset(std::move(storage), data, n, path.string());
  }
  if (bytes % 2 != 0)
    throw DataError("token file " + quote(path) + " has an odd byte count (" + std::to_string(bytes) +
                    "); expected raw uint16 tokens (nanoGPT) or an llm.c header with magic " +
                    std::to_string(kLlmcMagic));
  return TokenDataset(std::move(storage), reinterpret_cast<const uint16_t*>(base), static_cast<int64_t>(bytes / 2),
                      path.string());
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

std::pair<TokenDataset, TokenDataset> TokenDataset::split(double val_fraction) const {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw ConfigError("split: val_fraction must be in [0, 1), found " + std::to_string(val_fraction));
  const auto n_val = static_cast<int64_t>(std::llround(static_cast<double>(size_) * val_fraction));
  const int64_t n_train = size_ - n_val;
  return {TokenDataset(storage_, data_, n_train, source_ + " [train]"),
          TokenDataset(storage_, data_ + n_train, n_val, source_ + " [val]")};
}

uint16_t TokenDataset::max_token() const {
  uint16_t m = 0;
  for (int64_t i = 0; i < size_; ++i) m = std::max(m, data_[i]);
  return m;
}

void TokenDataset::validate(int64_t vocab_size) const {
  for (int64_t i = 0; i < size_; ++i)
    if (data_[i] >= vocab_size)
      throw DataError("token data " + source_ + ": token id " + std::to_string(data_[i]) + " at position " +
                      std::to_string(i) + " is outside the model's vocabulary (expected ids < " +
                      std::to_string(vocab_size) + ")");
}

void TokenDataset::require_tokens(int64_t n, const std::string& what) const {
  if (size_ < n)
    throw DataError("token data " + source_ + " has " + std::to_string(size_) + " tokens; " + what + " needs at least " +
                    std::to_string(n));
}

}  // namespace zt
