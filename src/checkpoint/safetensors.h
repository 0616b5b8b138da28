// The file container of checkpoints and exports: the safetensors layout (an 8-byte little-endian
// header length, a JSON header with each tensor's dtype, shape and byte range, then the raw
// bytes), which other tools open as is, plus checksums that make every corruption an error:
// a CRC-32 per tensor and one of the header, stored in the header's "__metadata__" (string
// values, as the format requires). docs/checkpoint.md has the layout and the rationale.
//
// Contract
// - SafetensorsWriter streams: the header is planned from the records before any data (the format
//   puts every offset first), tensors are then written one by one in record order, and finish()
//   fills in the checksums (fixed-width, so the header keeps its size), flushes and fsyncs. Memory
//   stays at the tensor being written, or with append() at the piece being written. A writer destroyed before finish() leaves an incomplete file
//   that every reader rejects (its checksums are zeros).
// - SafetensorsReader validates on open: the length prefix (at most the file's size and 100 MB),
//   the JSON (at most 1,000,000 tensors, nesting at most 3 levels deep), every entry (valid name,
//   known dtype, non-negative shape whose element and byte counts do not overflow, byte range of
//   exactly numel × element size), that the ranges tile the data section (no overlap, no gap,
//   nothing past the end), that the file has exactly that many bytes, and the header checksum.
//   read() checks the tensor's checksum; read_pieces() checks it after the last piece. Every failure is a zt::DataError naming the file and the
//   problem, whatever the file holds: no crash, no allocation beyond a small multiple of the
//   header before the checks, and no tensor allocated before its byte range is known to be in
//   the file.
// - Neither class is thread-safe; distinct objects may be used from distinct threads.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace zt {

struct TensorRecord {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

// The safetensors dtype name ("F32", "BF16", ...) of a scalar type; throws zt::Error if none.
std::string safetensors_dtype(at::ScalarType dtype);

// zlib's CRC-32 of `bytes` as 8 lowercase hex digits (what the files store).
std::string crc32_hex(std::string_view bytes);

class FileSystem;

// A tensor name both classes accept: not empty, not "__metadata__", at most 4096 bytes, no
// control character (NUL included), no '/' or '\\' and no "..", so that a name can never
// become a path outside a directory. Empty string if valid, else why not.
std::string invalid_tensor_name(const std::string& name);

class SafetensorsWriter {
 public:
  // Creates (or truncates) `path`. Names must be unique and valid (invalid_tensor_name);
  // metadata keys must not start with "zerotrain.crc32" (reserved for the checksums).
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorRecord> records,
                    std::map<std::string, std::string> metadata = {});
  // The same, with every file operation through `files` (which must outlive the writer).
  SafetensorsWriter(FileSystem& files, std::filesystem::path path, std::vector<TensorRecord> records,
                    std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends the data of the next record; `tensor` must have its dtype and shape (any device
  // layout: it is made contiguous on the CPU first).
  void write(const at::Tensor& tensor);
  // Appends the next `bytes` of the data of the current record (its raw bytes in order; the
  // checksum runs on): a record is written when all its bytes are, by one write() or any number
  // of append() calls, not both.
  void append(const void* data, int64_t bytes);
  // Writes the checksums and makes the file durable (fsync). Every record must have been written.
  void finish();

  int64_t bytes() const;  // the whole file's size

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // from the start of the file
  int64_t nbytes = 0;
  uint32_t crc32 = 0;
};

class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::filesystem::path path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::filesystem::path& path() const;
  const std::map<std::string, std::string>& metadata() const;  // without the checksums
  const std::vector<SafetensorsEntry>& entries() const;        // in file order
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // zt::DataError if absent
  // The whole tensor, checksum verified.
  at::Tensor read(const std::string& name) const;
  // The tensor's bytes in order, in reads of at most `buffer_bytes` (rounded down to whole
  // elements) into `buffer`: consume(byte offset in the tensor, data, bytes) for each. The checksum
  // is verified after the last piece: what consume received is trusted only if this returns
  // (zt::DataError otherwise). Memory: the caller's buffer.
  void read_pieces(const std::string& name, void* buffer, int64_t buffer_bytes,
                   const std::function<void(int64_t offset, const void* data, int64_t bytes)>& consume) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace zt
