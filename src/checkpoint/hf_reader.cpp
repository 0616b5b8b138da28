// model.init_from of a Hugging Face directory: a GPT-2 one's config.json checked against the GPT's
// (a Llama's is the model's shape already: llama_config_of), its safetensors files (one, or
// shards with their index) validated and read tensor by tensor.
#include "checkpoint/hf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include "checkpoint/checkpoint.h"
#include "checkpoint/json_bounds.h"
#include "checkpoint/safetensors.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "checkpoint/hf_files.h"

namespace zt {

// The shared constants and helpers of hf_files.h.
using namespace hf_detail;

namespace {

struct ForeignEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // absolute, in the file
  int64_t nbytes = 0;
};

// A safetensors file written by another tool: validated like ours (length prefix, bounded
// header, every tensor's dtype, shape and byte range inside the data section) but without our
// checksums, in any order.
struct ForeignFile {
  fs::path path;
  int fd = -1;
  std::map<std::string, ForeignEntry> entries;

  explicit ForeignFile(fs::path p) : path(std::move(p)) {
    const std::string where = "'" + path.string() + "'";
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError("cannot open " + where + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw DataError("cannot stat " + where);
    const int64_t file_bytes = st.st_size;
    unsigned char prefix[8];
    if (file_bytes < 8 || ::pread(fd, prefix, 8, 0) != 8) throw DataError(where + ": not a safetensors file (too short)");
    uint64_t length = 0;
    for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
    if (length > kMaxHeaderBytes || int64_t(length) > file_bytes - 8)
      throw DataError(where + ": header length " + std::to_string(length) + " does not fit the file (not a safetensors file)");
    std::string text(length, '\0');
    if (::pread(fd, text.data(), length, 8) != ssize_t(length)) throw DataError(where + ": cannot read its header");
    if (const std::string problem = json_bounds_problem(text, 3, kMaxTensors + 1); !problem.empty())
      throw DataError(where + ": header " + problem);
    json header;
    try {
      header = json::parse(text);
    } catch (const json::exception& e) {
      throw DataError(where + ": header is not valid JSON (" + e.what() + ")");
    }
    if (!header.is_object()) throw DataError(where + ": header is not a JSON object");
    const int64_t data_start = 8 + int64_t(length), data_bytes = file_bytes - data_start;
    const std::map<std::string, std::pair<at::ScalarType, int64_t>> dtypes = {
        {"F32", {at::kFloat, 4}}, {"F16", {at::kHalf, 2}}, {"BF16", {at::kBFloat16, 2}}, {"F64", {at::kDouble, 8}}};
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string tensor = where + ": tensor '" + name + "'";
      if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets") ||
          !value["dtype"].is_string() || !value["shape"].is_array() || !value["data_offsets"].is_array() ||
          value["data_offsets"].size() != 2)
        throw DataError(tensor + ": expected dtype, shape and data_offsets");
      ForeignEntry e;
      auto d = dtypes.find(value["dtype"].get<std::string>());
      int64_t element = 0;
      if (d != dtypes.end()) {
        e.dtype = d->second.first;
        element = d->second.second;
      }
      int64_t n = 1;
      for (const auto& dim : value["shape"]) {
        const int64_t v = dim.is_number_integer() && !(dim.is_number_unsigned() && dim.get<uint64_t>() > INT64_MAX)
                              ? dim.get<int64_t>()
                              : -1;
        if (v < 0 || __builtin_mul_overflow(n, v, &n))
          throw DataError(tensor + ": shape " + value["shape"].dump() + " has a negative, non-integer or overflowing dimension");
        e.shape.push_back(v);
      }
      const auto& offsets = value["data_offsets"];
      auto offset_of = [&](const json& o) {
        return o.is_number_integer() && !(o.is_number_unsigned() && o.get<uint64_t>() > INT64_MAX) ? o.get<int64_t>() : -1;
      };
      const int64_t begin = offset_of(offsets[0]), end = offset_of(offsets[1]);
      if (begin < 0 || end < begin || end > data_bytes)
        throw DataError(tensor + ": data_offsets " + offsets.dump() + " outside the file's " + std::to_string(data_bytes) +
                        " data bytes (truncated or damaged)");
      e.offset = data_start + begin;
      e.nbytes = end - begin;
      // Tensors of other dtypes (integer buffers, ...) are not ours to read; they are checked when asked for.
      if (element > 0 && (__builtin_mul_overflow(n, element, &n) || n != e.nbytes))
        throw DataError(tensor + ": " + std::to_string(e.nbytes) + " bytes for shape " + value["shape"].dump() + " of " +
                        value["dtype"].get<std::string>());
      if (element == 0) e.dtype = at::ScalarType::Undefined;
      entries[name] = std::move(e);
    }
  }
  ~ForeignFile() {
    if (fd >= 0) ::close(fd);
  }
  ForeignFile(const ForeignFile&) = delete;
  ForeignFile& operator=(const ForeignFile&) = delete;

  void read_at(void* out, int64_t bytes, int64_t offset) const {
    char* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t done = ::pread(fd, p, size_t(std::min<int64_t>(bytes, 1 << 30)), offset);
      if (done < 0 && errno == EINTR) continue;
      if (done <= 0)
        throw DataError("reading '" + path.string() + "': " + (done < 0 ? std::strerror(errno) : "unexpected end of file"));
      p += done;
      bytes -= done;
      offset += done;
    }
  }
};

}  // namespace

struct HfModelReader::State {
  fs::path dir;
  std::string family;  // "GPT-2", "Llama": names the directory in errors
  std::string model;   // the model such a directory fills
  std::string where;   // "model.init_from 'DIR'": what gave the directory, and the directory
  std::function<std::string(const std::string&)> hf_name;  // "" for a tensor of no such model
  std::function<bool(const std::string&)> transposed;
  std::vector<std::unique_ptr<ForeignFile>> files;
  std::map<std::string, std::pair<size_t, std::string>> located;  // HF name -> (file, name in it)
  int64_t bytes_read = 0;
  at::Tensor raw;  // read buffer

  // The file and entry of one of our tensors, its shape checked.
  std::pair<const ForeignFile*, const ForeignEntry*> find(const std::string& name, const std::vector<int64_t>& shape) {
    const std::string hf = hf_name(name);
    if (hf.empty())
      throw DataError(where + ": '" + name + "' is not a " + family + " tensor (a Hugging Face " + family +
                      " directory fills " + model + " only)");
    // Files saved from GPT2Model (and the original GPT-2 uploads) name tensors without "transformer.".
    auto it = located.find(hf);
    if (it == located.end() && hf.rfind("transformer.", 0) == 0)
      it = located.find(hf.substr(std::string("transformer.").size()));
    if (it == located.end())
      throw DataError(where + ": no tensor '" + hf + "'" +
                      (hf == name ? std::string() : " (our '" + name + "')") + " in its files (" + files_text() + ")");
    const ForeignFile* file = files[it->second.first].get();
    const ForeignEntry& e = file->entries.at(it->second.second);
    std::vector<int64_t> expected = shape;
    if (transposed(name) && expected.size() == 2) std::swap(expected[0], expected[1]);
    if (e.shape != expected)
      throw DataError("'" + file->path.string() + "': tensor '" + it->second.second + "' has shape " + shape_text(e.shape) +
                      ", expected " + shape_text(expected) + (transposed(name) ? " (Conv1D: [in, out])" : ""));
    if (e.dtype == at::ScalarType::Undefined)
      throw DataError("'" + file->path.string() + "': tensor '" + it->second.second +
                      "' is not F32, F16, BF16 or F64");
    return {file, &e};
  }

  // The weight files searched, for errors: "model.safetensors", or the shards the index names.
  std::string files_text() const {
    if (files.size() == 1) return files.front()->path.filename().string();
    return std::to_string(files.size()) + " shards of " + kIndexFile;
  }

  // `bytes` of the file at `offset` into the read buffer (grown as needed, at most a piece).
  void* buffer(int64_t bytes) {
    if (!raw.defined() || raw.numel() < bytes) {
      raw = at::Tensor();
      raw = at::empty({bytes}, at::kByte);
    }
    return raw.data_ptr();
  }
};

namespace {

// The weight files of `dir` (one, or the index's) opened and validated into `s`.
void open_weight_files(HfModelReader::State& s, const std::string& where);

}  // namespace

HfModelReader::HfModelReader(const fs::path& dir, const GPTConfig& config) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.dir = dir;
  s.family = "GPT-2";
  s.model = "the reference GPT";
  s.hf_name = hf_gpt2_name;
  s.transposed = hf_gpt2_transposed;
  s.where = "model.init_from '" + dir.string() + "'";
  const std::string& where = s.where;
  if (!fs::is_directory(dir)) throw ConfigError(where + ": not a directory (expected a Hugging Face GPT-2 model directory)");
  const json cfg = parse_json_file(dir / kConfigFile, "config.json", 8);
  if (!cfg.is_object()) throw DataError("'" + (dir / kConfigFile).string() + "' is not a JSON object");
  auto mismatch = [&](const std::string& key, const std::string& there, const std::string& here) -> ConfigError {
    return ConfigError(where + ": config.json has " + key + " = " + there + ", the configured model " + here);
  };
  // transformers' GPT2Config defaults stand for keys the file leaves out.
  const std::string model_type = cfg.value("model_type", std::string("gpt2"));
  if (model_type != "gpt2") throw mismatch("model_type", "\"" + model_type + "\"", "is a GPT-2 (\"gpt2\")");
  auto integer = [&](const char* key, int64_t fallback) -> int64_t {
    if (!cfg.contains(key) || cfg[key].is_null()) return fallback;
    if (!cfg[key].is_number_integer()) throw DataError(where + ": config.json's " + key + " is not an integer: " + cfg[key].dump());
    return cfg[key].get<int64_t>();
  };
  const std::pair<const char*, std::pair<int64_t, int64_t>> shape_keys[] = {
      {"n_layer", {integer("n_layer", 12), config.n_layer}},       {"n_head", {integer("n_head", 12), config.n_head}},
      {"n_embd", {integer("n_embd", 768), config.n_embd}},         {"vocab_size", {integer("vocab_size", 50257), config.vocab_size}},
      {"n_positions", {integer("n_positions", 1024), config.context_length}}};
  const char* ours[] = {"model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size", "model.context_length"};
  for (size_t i = 0; i < std::size(shape_keys); ++i)
    if (shape_keys[i].second.first != shape_keys[i].second.second)
      throw mismatch(shape_keys[i].first, std::to_string(shape_keys[i].second.first),
                     "has " + std::string(ours[i]) + " = " + std::to_string(shape_keys[i].second.second) +
                         " (set model.preset or the model.* overrides to the directory's shape)");
  if (const int64_t inner = integer("n_inner", 4 * config.n_embd); inner != 4 * config.n_embd)
    throw mismatch("n_inner", std::to_string(inner), "has an MLP of 4 × n_embd = " + std::to_string(4 * config.n_embd));
  const std::string activation = cfg.value("activation_function", std::string("gelu_new"));
  if (activation != "gelu_new" && activation != "gelu_pytorch_tanh")
    throw mismatch("activation_function", "\"" + activation + "\"", "uses GELU's tanh approximation (gelu_new)");
  if (cfg.contains("layer_norm_epsilon") && cfg["layer_norm_epsilon"].is_number() &&
      std::abs(cfg["layer_norm_epsilon"].get<double>() - 1e-5) > 1e-12)
    throw mismatch("layer_norm_epsilon", cfg["layer_norm_epsilon"].dump(), "uses 1e-05 (LibTorch's LayerNorm)");
  auto flag = [&](const char* key, bool fallback) {
    return cfg.contains(key) && cfg[key].is_boolean() ? cfg[key].get<bool>() : fallback;
  };
  if (!flag("tie_word_embeddings", true)) throw mismatch("tie_word_embeddings", "false", "ties its head to wte");
  if (!flag("scale_attn_weights", true)) throw mismatch("scale_attn_weights", "false", "scales attention by 1/sqrt(head size)");
  if (flag("scale_attn_by_inverse_layer_idx", false))
    throw mismatch("scale_attn_by_inverse_layer_idx", "true", "does not scale attention by layer");
  open_weight_files(s, where);
  // Every tensor of the model is there with its shape, before any rank reads anything.
  for (const CheckpointParameter& p : gpt_tensors(config)) s.find(p.name, p.shape);
}

HfModelReader::HfModelReader(const fs::path& dir, const LlamaConfig& config, const std::string& key)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.dir = dir;
  s.family = "Llama";
  s.model = "the Llama-family decoder";
  s.hf_name = [](const std::string& name) { return name; };
  s.transposed = [](const std::string&) { return false; };
  s.where = key + " '" + dir.string() + "'";
  if (!fs::is_directory(dir)) throw ConfigError(s.where + ": not a directory (expected a Hugging Face model directory)");
  open_weight_files(s, s.where);
  for (const CheckpointParameter& p : llama_tensors(config)) s.find(p.name, p.shape);
}

namespace {

void open_weight_files(HfModelReader::State& s, const std::string& where) {
  const fs::path& dir = s.dir;
  // The weight files: one, or the index's.
  std::set<std::string> names;
  if (fs::exists(dir / kSingleFile)) {
    names.insert(kSingleFile);
  } else if (fs::exists(dir / kIndexFile)) {
    const json index = parse_json_file(dir / kIndexFile, kIndexFile, 4);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw DataError("'" + (dir / kIndexFile).string() + "': no weight_map object");
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      const std::string name = file.is_string() ? file.get<std::string>() : "";
      // A plain file name in this directory, never a path elsewhere.
      if (!invalid_tensor_name(name).empty() || name.rfind('.', 0) == 0)
        throw DataError("'" + (dir / kIndexFile).string() + "': tensor '" + tensor + "' maps to " + file.dump() +
                        ", not a file name in the directory");
      names.insert(name);
    }
  } else {
    throw DataError(where + ": neither " + kSingleFile + " nor " + kIndexFile +
                    " (weights in pytorch_model.bin are not read: save them with save_pretrained, which writes safetensors)");
  }
  for (const std::string& name : names) {
    s.files.push_back(std::make_unique<ForeignFile>(dir / name));
    for (const auto& [tensor, entry] : s.files.back()->entries)
      if (!s.located.emplace(tensor, std::make_pair(s.files.size() - 1, tensor)).second)
        throw DataError(where + ": tensor '" + tensor + "' is in two of its files");
  }
}

}  // namespace

HfModelReader::~HfModelReader() = default;

int64_t HfModelReader::bytes_read() const { return state_->bytes_read; }

int64_t HfModelReader::data_bytes() const {
  int64_t total = 0;
  for (const auto& f : state_->files)
    for (const auto& [name, e] : f->entries) total += e.nbytes;
  return total;
}

void HfModelReader::read(const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t count,
                         float* out) {
  State& s = *state_;
  // Not a structured binding: the lambdas below capture it (clang rejects captured bindings).
  const auto located = s.find(name, shape);
  const auto& file = located.first;
  const auto& entry = located.second;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (begin < 0 || count < 0 || begin + count > numel)
    throw Error(s.where + ": elements [" + std::to_string(begin) + ", " + std::to_string(begin + count) + ") of '" +
                name + "' asked for, which has " + std::to_string(numel));
  const int64_t element = int64_t(c10::elementSize(entry->dtype));
  auto convert = [&](const void* raw, int64_t n, float* to) {
    at::from_blob(to, {n}, at::kFloat).copy_(at::from_blob(const_cast<void*>(raw), {n}, entry->dtype));
  };
  if (!s.transposed(name)) {
    for (int64_t done = 0; done < count;) {
      const int64_t n = std::min(kPieceElements, count - done);
      void* raw = s.buffer(n * element);
      file->read_at(raw, n * element, entry->offset + (begin + done) * element);
      s.bytes_read += n * element;
      convert(raw, n, out + done);
      done += n;
    }
    return;
  }
  // Ours [rows, cols] is theirs [cols, rows]: our rows r0..r1 are, in every one of their `cols`
  // rows, the contiguous run of columns r0..r1. Whole rows of ours are read, a piece at a time.
  const int64_t rows = shape[0], cols = shape[1];
  const int64_t end = begin + count;
  at::Tensor block;
  for (int64_t pos = begin; pos < end;) {
    const int64_t r0 = pos / cols;
    const int64_t last_row = (end - 1) / cols;
    const int64_t r1 = std::min({rows, last_row + 1, r0 + std::max<int64_t>(1, kPieceElements / cols)});
    const int64_t m = r1 - r0;
    char* raw = static_cast<char*>(s.buffer(cols * m * element));
    for (int64_t i = 0; i < cols; ++i) {
      file->read_at(raw + i * m * element, m * element, entry->offset + (i * rows + r0) * element);
      s.bytes_read += m * element;
    }
    // [cols, m] theirs -> [m, cols] ours, fp32.
    block = at::from_blob(raw, {cols, m}, entry->dtype).to(at::kFloat).t().contiguous().view({-1});
    const int64_t hi = std::min(end, r1 * cols);
    std::memcpy(out + (pos - begin), block.data_ptr<float>() + (pos - r0 * cols), size_t(hi - pos) * sizeof(float));
    pos = hi;
  }
}

}  // namespace zt
