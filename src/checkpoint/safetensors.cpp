#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "checkpoint/file_system.h"
#include "checkpoint/json_bounds.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr const char* kTensorCrcPrefix = "zerotrain.crc32:";
constexpr const char* kHeaderCrcKey = "zerotrain.crc32";  // of the header with this value zeroed
constexpr const char* kZeroCrc = "00000000";
// The format's own bound on the header (safetensors rejects larger ones).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Bounds on what a header may describe, checked while parsing so that a hostile header cannot make
// the parser build an outsized document: far beyond any model's tensor count, and the depth of the
// format's own structure (root object, entry object, shape or offsets array).
constexpr int64_t kMaxTensors = 1'000'000;
constexpr int kMaxDepth = 3;

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
const DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

std::string hex32(uint32_t v) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

uint32_t crc_of(const void* data, int64_t n, uint32_t crc = 0) {
  const auto* bytes = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes 32-bit lengths
    const uInt chunk = uInt(std::min<int64_t>(n, 1 << 30));
    crc = uint32_t(::crc32(crc, bytes, chunk));
    bytes += chunk;
    n -= chunk;
  }
  return crc;
}

std::string errno_text() { return std::strerror(errno); }

void read_all(int fd, void* data, int64_t n, int64_t offset, const std::filesystem::path& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t done = ::pread(fd, p, size_t(std::min<int64_t>(n, 1 << 30)), offset);
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0)
      throw DataError("reading '" + path.string() + "': " + (done < 0 ? errno_text() : std::string("unexpected end of file")));
    p += done;
    n -= done;
    offset += done;
  }
}

// numel × element size of a shape, or -1 if a dimension is negative or the product overflows.
int64_t checked_nbytes(const std::vector<int64_t>& shape, int64_t element_size) {
  int64_t n = element_size;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  return n;
}

// The header text: dtype/shape/offsets per tensor and the metadata with the given checksums,
// padded with spaces so that the data section starts 8-byte aligned.
std::string render_header(const std::vector<SafetensorsEntry>& entries, const std::map<std::string, std::string>& metadata,
                          const std::string& header_crc) {
  ordered_json header = ordered_json::object();
  ordered_json meta = ordered_json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  for (const auto& e : entries) meta[kTensorCrcPrefix + e.name] = hex32(e.crc32);
  meta[kHeaderCrcKey] = header_crc;
  header["__metadata__"] = meta;
  int64_t data_offset = 0;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", safetensors_dtype(e.dtype)}, {"shape", e.shape},
                      {"data_offsets", {data_offset, data_offset + e.nbytes}}};
    data_offset += e.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - (text.size() + 8) % 8) % 8, ' ');
  return text;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

std::string safetensors_dtype(at::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.type == dtype) return d.name;
  throw Error(std::string("safetensors: no dtype name for ") + c10::toString(dtype));
}

std::string invalid_tensor_name(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name == "__metadata__") return "is reserved";
  if (name.size() > 4096) return "is longer than 4096 bytes";
  for (unsigned char c : name)
    if (c < 0x20 || c == 0x7f) return "contains a control character";
  if (name.find('/') != std::string::npos || name.find('\\') != std::string::npos) return "contains a path separator";
  if (name.find("..") != std::string::npos) return "contains '..'";
  return "";
}

std::string crc32_hex(std::string_view bytes) { return hex32(crc_of(bytes.data(), int64_t(bytes.size()))); }

// ---------------------------------------------------------------- writer

struct SafetensorsWriter::State {
  std::filesystem::path path;
  std::unique_ptr<WritableFile> file;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  size_t next = 0;
  int64_t appended = 0;  // bytes of record `next` written by append()
  int64_t header_bytes = 0, file_bytes = 0;
  bool finished = false;
};

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::vector<TensorRecord> records,
                                     std::map<std::string, std::string> metadata)
    : SafetensorsWriter(FileSystem::real(), std::move(path), std::move(records), std::move(metadata)) {}

SafetensorsWriter::SafetensorsWriter(FileSystem& files, std::filesystem::path path, std::vector<TensorRecord> records,
                                     std::map<std::string, std::string> metadata)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.path = std::move(path);
  s.metadata = std::move(metadata);
  for (const auto& [key, value] : s.metadata)
    if (key.rfind(kHeaderCrcKey, 0) == 0)
      throw Error("safetensors: metadata key '" + key + "' is reserved for checksums ('" + s.path.string() + "')");
  std::set<std::string> names;
  for (auto& r : records) {
    if (const std::string why = invalid_tensor_name(r.name); !why.empty() || !names.insert(r.name).second)
      throw Error("safetensors: tensor name '" + r.name + "' " + (why.empty() ? "is repeated" : why) + " ('" +
                  s.path.string() + "')");
    SafetensorsEntry e;
    e.name = std::move(r.name);
    e.dtype = r.dtype;
    e.shape = std::move(r.shape);
    e.nbytes = checked_nbytes(e.shape, int64_t(c10::elementSize(e.dtype)));
    if (e.nbytes < 0) throw Error("safetensors: tensor '" + e.name + "' has a negative or overflowing shape");
    safetensors_dtype(e.dtype);  // throws for types the format cannot name
    s.entries.push_back(std::move(e));
  }
  const std::string header = render_header(s.entries, s.metadata, kZeroCrc);
  s.header_bytes = int64_t(header.size());
  int64_t offset = 8 + s.header_bytes;
  for (auto& e : s.entries) {
    e.offset = offset;
    offset += e.nbytes;
  }
  s.file_bytes = offset;
  s.file = files.create(s.path);
  // The header with zero checksums goes first, so that an interrupted write is never valid.
  const uint64_t length = header.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = uint8_t(length >> (8 * i));
  s.file->write_at(prefix, 8, 0);
  s.file->write_at(header.data(), int64_t(header.size()), 8);
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const at::Tensor& tensor) {
  State& s = *state_;
  if (s.finished || s.next >= s.entries.size())
    throw Error("safetensors: more tensors written than planned for '" + s.path.string() + "'");
  SafetensorsEntry& e = s.entries[s.next];
  if (s.appended > 0)
    throw Error("safetensors: tensor '" + e.name + "' written whole after " + std::to_string(s.appended) +
                " bytes were appended ('" + s.path.string() + "')");
  if (tensor.scalar_type() != e.dtype || tensor.sizes().vec() != e.shape)
    throw Error("safetensors: tensor '" + e.name + "' planned as " + safetensors_dtype(e.dtype) + " " +
                c10::str(at::IntArrayRef(e.shape)) + ", written as " + c10::toString(tensor.scalar_type()) + " " +
                c10::str(tensor.sizes()) + " ('" + s.path.string() + "')");
  const at::Tensor data = tensor.cpu().contiguous();
  e.crc32 = crc_of(data.data_ptr(), e.nbytes);
  s.file->write_at(data.data_ptr(), e.nbytes, e.offset);
  ++s.next;
}

void SafetensorsWriter::append(const void* data, int64_t bytes) {
  State& s = *state_;
  if (s.finished || s.next >= s.entries.size())
    throw Error("safetensors: more data appended than planned for '" + s.path.string() + "'");
  SafetensorsEntry& e = s.entries[s.next];
  if (bytes < 0 || bytes > e.nbytes - s.appended)
    throw Error("safetensors: " + std::to_string(bytes) + " bytes appended to tensor '" + e.name + "', which has " +
                std::to_string(e.nbytes - s.appended) + " bytes left ('" + s.path.string() + "')");
  if (s.appended == 0) e.crc32 = 0;
  e.crc32 = crc_of(data, bytes, e.crc32);
  s.file->write_at(data, bytes, e.offset + s.appended);
  s.appended += bytes;
  if (s.appended == e.nbytes) {
    ++s.next;
    s.appended = 0;
  }
}

void SafetensorsWriter::finish() {
  State& s = *state_;
  if (s.finished) return;
  if (s.next != s.entries.size() || s.appended > 0)
    throw Error("safetensors: " + std::to_string(s.next) + " of " + std::to_string(s.entries.size()) +
                " tensors written to '" + s.path.string() + "' before finish()");
  std::string header = render_header(s.entries, s.metadata, kZeroCrc);
  header = render_header(s.entries, s.metadata, hex32(crc_of(header.data(), int64_t(header.size()))));
  if (int64_t(header.size()) != s.header_bytes)  // fixed-width checksums keep the size
    throw Error("safetensors: header of '" + s.path.string() + "' changed size when its checksums were filled in");
  s.file->write_at(header.data(), int64_t(header.size()), 8);
  s.file->sync();
  s.file->close();
  s.finished = true;
}

int64_t SafetensorsWriter::bytes() const { return state_->file_bytes; }

// ---------------------------------------------------------------- reader

struct SafetensorsReader::State {
  std::filesystem::path path;
  Fd fd;
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, size_t> index;
};

namespace {

// The header's text of an open safetensors file of `file_bytes` bytes.
std::string read_header_text(int fd, const std::filesystem::path& path, const std::string& where, int64_t file_bytes) {
  if (file_bytes < 8)
    throw DataError(where + ": truncated: " + std::to_string(file_bytes) + " bytes, not even the header length");
  unsigned char prefix[8];
  read_all(fd, prefix, 8, 0, path);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (length > kMaxHeaderBytes || int64_t(length) > file_bytes - 8)
    throw DataError(where + ": header length " + std::to_string(length) + " does not fit in the file's " +
                    std::to_string(file_bytes) + " bytes (truncated or not a safetensors file)");
  std::string text(length, '\0');
  read_all(fd, text.data(), int64_t(length), 8, path);
  return text;
}

// The header as JSON (its size and depth checked before any document is built) and its
// __metadata__ strings.
std::pair<ordered_json, std::map<std::string, std::string>> parse_header(const std::string& text, const std::string& where) {
  auto bad = [&](const std::string& problem) { return DataError(where + ": " + problem); };
  // Tensors and "__metadata__".
  if (const std::string problem = json_bounds_problem(text, kMaxDepth, kMaxTensors + 1); !problem.empty())
    throw bad("header " + problem + " (at most " + std::to_string(kMaxTensors) + " tensors, " +
              std::to_string(kMaxDepth) + " levels)");
  ordered_json header;
  try {
    header = ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  std::map<std::string, std::string> meta;
  if (auto m = header.find("__metadata__"); m != header.end()) {
    if (!m->is_object()) throw bad("__metadata__ is not an object");
    for (const auto& [key, value] : m->items()) {
      if (!value.is_string()) throw bad("__metadata__ value of '" + key + "' is not a string");
      meta[key] = value.get<std::string>();
    }
  }
  return {std::move(header), std::move(meta)};
}

// The header checksum covers the header as written with that checksum zeroed.
void check_header_checksum(const std::string& text, const std::map<std::string, std::string>& meta,
                           const std::string& where) {
  auto stored_header_crc = meta.find(kHeaderCrcKey);
  if (stored_header_crc == meta.end()) throw DataError(where + ": no header checksum (" + std::string(kHeaderCrcKey) + ")");
  const std::string stored = "\"" + std::string(kHeaderCrcKey) + "\":\"" + stored_header_crc->second + "\"";
  std::string zeroed = text;
  const size_t at = zeroed.find(stored);
  if (at == std::string::npos || stored_header_crc->second.size() != 8) throw DataError(where + ": malformed header checksum");
  zeroed.replace(at, stored.size(), "\"" + std::string(kHeaderCrcKey) + "\":\"" + kZeroCrc + "\"");
  const std::string computed = hex32(crc_of(zeroed.data(), int64_t(zeroed.size())));
  if (computed != stored_header_crc->second)
    throw DataError(where + ": header fails its checksum (stored " + stored_header_crc->second + ", computed " +
                    computed + "; corrupted, or written incompletely)");
}

// One tensor's header entry, validated: its dtype, shape, checksum, and a byte range that starts
// at `expected_offset` of the data section and fits in the file (our files list tensors in data
// order, so the ranges tile the data section: no overlaps, nothing past the end).
SafetensorsEntry entry_of(const std::string& name, const ordered_json& value, const std::map<std::string, std::string>& meta,
                          int64_t file_bytes, int64_t data_start, int64_t expected_offset, const std::string& where) {
  const std::string tensor = where + ": tensor '" + name + "'";
  if (!value.is_object() || value.size() != 3 || !value.contains("dtype") || !value.contains("shape") ||
      !value.contains("data_offsets"))
    throw DataError(tensor + ": expected exactly dtype, shape and data_offsets");
  if (const std::string why = invalid_tensor_name(name); !why.empty())
    throw DataError(where + ": tensor name " + ordered_json(name).dump() + " " + why);
  SafetensorsEntry e;
  e.name = name;
  const auto& dtype = value["dtype"];
  bool known = false;
  for (const auto& d : kDtypes)
    if (dtype.is_string() && dtype.get<std::string>() == d.name) {
      e.dtype = d.type;
      known = true;
    }
  if (!known) throw DataError(tensor + ": unknown dtype " + dtype.dump());
  if (!value["shape"].is_array()) throw DataError(tensor + ": shape is not an array");
  for (const auto& d : value["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0 || (d.is_number_unsigned() && d.get<uint64_t>() > INT64_MAX))
      throw DataError(tensor + ": shape " + value["shape"].dump() + " has a negative or non-integer dimension");
    e.shape.push_back(d.get<int64_t>());
  }
  e.nbytes = checked_nbytes(e.shape, int64_t(c10::elementSize(e.dtype)));
  // Every byte of a tensor is in the file: a size beyond the file is refused before any
  // arithmetic on it, and before read() would allocate it.
  if (e.nbytes < 0 || e.nbytes > file_bytes - data_start - expected_offset)
    throw DataError(tensor + ": shape " + value["shape"].dump() + " needs " +
                    (e.nbytes < 0 ? std::string("more bytes than a 64-bit size holds") : std::to_string(e.nbytes) + " bytes") +
                    ", more than the " + std::to_string(file_bytes - data_start - expected_offset) +
                    " bytes left in the file (truncated or damaged)");
  const auto& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_integer() || !offsets[1].is_number_integer())
    throw DataError(tensor + ": data_offsets " + offsets.dump());
  const bool representable = (!offsets[0].is_number_unsigned() || offsets[0].get<uint64_t>() <= INT64_MAX) &&
                             (!offsets[1].is_number_unsigned() || offsets[1].get<uint64_t>() <= INT64_MAX);
  const int64_t begin = representable ? offsets[0].get<int64_t>() : -1;
  const int64_t end = representable ? offsets[1].get<int64_t>() : -1;
  // `end` is compared, not subtracted.
  if (begin != expected_offset || end != expected_offset + e.nbytes)
    throw DataError(tensor + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") expected [" +
                    std::to_string(expected_offset) + ", " + std::to_string(expected_offset + e.nbytes) + ")");
  e.offset = data_start + begin;
  auto crc = meta.find(kTensorCrcPrefix + name);
  if (crc == meta.end() || crc->second.size() != 8 || crc->second.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw DataError(tensor + ": no checksum");
  e.crc32 = uint32_t(std::stoul(crc->second, nullptr, 16));
  return e;
}

}  // namespace

SafetensorsReader::SafetensorsReader(std::filesystem::path path) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.path = std::move(path);
  const std::string where = "'" + s.path.string() + "'";
  s.fd.reset(::open(s.path.c_str(), O_RDONLY | O_CLOEXEC));
  if (s.fd.get() < 0) throw DataError("cannot open " + where + ": " + errno_text());
  struct stat st {};
  if (::fstat(s.fd.get(), &st) != 0) throw DataError("cannot stat " + where + ": " + errno_text());
  const int64_t file_bytes = st.st_size;
  const std::string text = read_header_text(s.fd.get(), s.path, where, file_bytes);
  const auto [header, meta] = parse_header(text, where);
  check_header_checksum(text, meta, where);
  const int64_t data_start = 8 + int64_t(text.size());
  int64_t expected_offset = 0;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    SafetensorsEntry e = entry_of(name, value, meta, file_bytes, data_start, expected_offset, where);
    expected_offset += e.nbytes;
    s.index[name] = s.entries.size();
    s.entries.push_back(std::move(e));
  }
  if (data_start + expected_offset != file_bytes)
    throw DataError(where + ": expected " + std::to_string(data_start + expected_offset) + " bytes from the header, found " +
                    std::to_string(file_bytes) + (file_bytes < data_start + expected_offset ? " (truncated)" : ""));
  for (auto& [key, value] : meta)
    if (key.rfind(kHeaderCrcKey, 0) != 0) s.metadata[key] = value;
}

SafetensorsReader::~SafetensorsReader() = default;

const std::filesystem::path& SafetensorsReader::path() const { return state_->path; }
const std::map<std::string, std::string>& SafetensorsReader::metadata() const { return state_->metadata; }
const std::vector<SafetensorsEntry>& SafetensorsReader::entries() const { return state_->entries; }
bool SafetensorsReader::contains(const std::string& name) const { return state_->index.count(name) > 0; }

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  auto it = state_->index.find(name);
  if (it == state_->index.end())
    throw DataError("'" + state_->path.string() + "': no tensor named '" + name + "'");
  return state_->entries[it->second];
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read_all(state_->fd.get(), out.data_ptr(), e.nbytes, e.offset, state_->path);
  const uint32_t crc = crc_of(out.data_ptr(), e.nbytes);
  if (crc != e.crc32)
    throw DataError("'" + state_->path.string() + "': tensor '" + name + "' fails its checksum (stored " + hex32(e.crc32) +
                    ", computed " + hex32(crc) + ")");
  return out;
}

void SafetensorsReader::read_pieces(const std::string& name, void* buffer, int64_t buffer_bytes,
                                    const std::function<void(int64_t, const void*, int64_t)>& consume) const {
  const SafetensorsEntry& e = entry(name);
  const int64_t element = int64_t(c10::elementSize(e.dtype));
  const int64_t step = buffer_bytes / element * element;
  if (step <= 0 && e.nbytes > 0)
    throw Error("safetensors: a buffer of " + std::to_string(buffer_bytes) + " bytes cannot hold one element of '" +
                name + "'");
  uint32_t crc = 0;
  for (int64_t done = 0; done < e.nbytes;) {
    const int64_t n = std::min(step, e.nbytes - done);
    read_all(state_->fd.get(), buffer, n, e.offset + done, state_->path);
    crc = crc_of(buffer, n, crc);
    consume(done, buffer, n);
    done += n;
  }
  if (crc != e.crc32)
    throw DataError("'" + state_->path.string() + "': tensor '" + name + "' fails its checksum (stored " + hex32(e.crc32) +
                    ", computed " + hex32(crc) + ")");
}

}  // namespace zt
