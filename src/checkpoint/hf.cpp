// The Hugging Face layout shared by the model families: shard sizes, small JSON files, the model
// type of a checkpoint, and the writing of transformers' save_pretrained layout (sharded
// safetensors files, their index and config.json) and of a single safetensors file.
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

namespace hf_detail {

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string shape_text(const std::vector<int64_t>& shape) { return json(shape).dump(); }

std::string read_small_file(const fs::path& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw DataError("model.init_from: no " + what + " '" + path.string() + "'");
  if (st.st_size > kMaxJsonBytes)
    throw DataError("'" + path.string() + "': larger than " + std::to_string(kMaxJsonBytes) + " bytes");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read '" + path.string() + "'");
  return std::string{std::istreambuf_iterator<char>(in), {}};
}

json parse_json_file(const fs::path& path, const std::string& what, int max_depth) {
  const std::string text = read_small_file(path, what);
  if (const std::string problem = json_bounds_problem(text, max_depth, kMaxTensors + 8); !problem.empty())
    throw DataError("'" + path.string() + "' " + problem);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw DataError("'" + path.string() + "' is not valid JSON (" + e.what() + ")");
  }
}

std::string dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bfloat16" : "float32"; }

void write_json_atomically(const fs::path& path, const std::string& text) {
  const fs::path partial = path.string() + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error("writing '" + partial.string() + "' failed");
  }
  fs::rename(partial, path);
}

}  // namespace hf_detail

int64_t hf_default_max_shard_bytes() { return int64_t(50) * 1000 * 1000 * 1000; }  // "50GB" (transformers 5)

int64_t parse_shard_size(const std::string& text) {
  auto bad = [&]() -> ConfigError {
    return ConfigError("--max-shard-size: expected bytes or a size such as 50GB, 500MB or 100KB (units of 1000, as "
                       "transformers), found '" + text + "'");
  };
  if (text.empty()) throw bad();
  if (text.find_first_not_of("0123456789") == std::string::npos) {
    if (text.size() > 15) throw bad();
    const int64_t v = std::stoll(text);
    if (v <= 0) throw bad();
    return v;
  }
  if (text.size() < 3) throw bad();
  std::string unit = text.substr(text.size() - 2);
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, double> units = {{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  auto it = units.find(unit);
  if (it == units.end()) throw bad();
  const std::string number = text.substr(0, text.size() - 2);
  if (number.empty() || number.find_first_not_of("0123456789.") != std::string::npos) throw bad();
  double value = 0;
  try {
    value = std::stod(number);
  } catch (const std::exception&) {
    throw bad();
  }
  const double bytes = value * it->second;
  if (!(bytes >= 1) || bytes > 1e18) throw bad();
  return int64_t(bytes);
}

std::string model_type_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  auto it = resolved.find("model.type");
  if (it == resolved.end()) return "gpt";  // saved before the key existed: the GPT
  try {
    const std::string type = json::parse(it->second).get<std::string>();
    if (type != "gpt" && type != "bert" && type != "llama")
      throw DataError(where + ": the saved configuration's model.type is \"" + type + "\"; expected gpt, bert or llama");
    return type;
  } catch (const json::exception&) {
    throw DataError(where + ": the saved configuration's 'model.type' is not a JSON string: " + it->second);
  }
}

// ---------------------------------------------------------------- writing

namespace hf_detail {

// The tensors in the model's order, each checked against the expected name and shape; `model`
// names the model in messages ("GPT", "BERT") and `configured` its configured shape.
std::vector<const HfTensor*> order_tensors(const std::vector<HfTensor>& tensors,
                                           const std::vector<CheckpointParameter>& expected, const std::string& model,
                                           const std::string& configured) {
  std::map<std::string, const HfTensor*> by_name;
  for (const HfTensor& t : tensors)
    if (!by_name.emplace(t.name, &t).second) throw DataError("export --format hf: tensor '" + t.name + "' is given twice");
  std::vector<const HfTensor*> out;
  for (const CheckpointParameter& p : expected) {
    auto it = by_name.find(p.name);
    if (it == by_name.end())
      throw DataError("export --format hf: the model has no tensor '" + p.name + "' (expected by its shape: " +
                      configured + ")");
    if (it->second->shape != p.shape)
      throw DataError("export --format hf: tensor '" + p.name + "' has shape " + shape_text(it->second->shape) +
                      ", expected " + shape_text(p.shape) + " for the configured " + model);
    out.push_back(it->second);
    by_name.erase(it);
  }
  if (!by_name.empty())
    throw DataError("export --format hf: tensor '" + by_name.begin()->first + "' is not part of a " + model + " of " +
                    configured);
  return out;
}

}  // namespace hf_detail

namespace {

int64_t write_hf_files(const std::vector<const HfTensor*>& ordered,
                       const std::function<std::string(const std::string&)>& hf_name,
                       const std::function<bool(const std::string&)>& transposed, const std::string& config_text,
                       const fs::path& dir, at::ScalarType dtype, int64_t max_shard_bytes);

// Moves a complete export from `staging` into `target` (made if missing): an earlier export's
// model files there are removed first, as they would mix with this one; other files (a
// tokenizer, a README) stay. Then `staging` is removed.
void publish_hf_files(const fs::path& staging, const fs::path& target) {
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    fs::rename(staging, target);  // one step: nothing was there
    return;
  }
  for (const auto& entry : fs::directory_iterator(target)) {
    const std::string name = entry.path().filename().string();
    if (name == kSingleFile || name == kIndexFile || name == kConfigFile ||
        (name.rfind("model-", 0) == 0 && ends_with(name, ".safetensors")))
      fs::remove(entry.path());
  }
  for (const auto& entry : fs::directory_iterator(staging)) fs::rename(entry.path(), target / entry.path().filename());
  fs::remove(staging, ec);
}

}  // namespace

namespace hf_detail {

// The layout of transformers' save_pretrained for `ordered` tensors (checked, in the model's
// order): `hf_name` gives transformers' name of ours, `transposed` whether it is stored so.
int64_t write_hf_layout(const std::vector<const HfTensor*>& ordered,
                        const std::function<std::string(const std::string&)>& hf_name,
                        const std::function<bool(const std::string&)>& transposed, const std::string& config_text,
                        const fs::path& dir, at::ScalarType dtype, int64_t max_shard_bytes) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw ConfigError("--out: expected a directory for --format hf, found the file '" + dir.string() + "'");
  // Everything is written into a staging directory beside `dir` and moved into place only when
  // complete: a failed export leaves an earlier one in `dir` as it was.
  const fs::path target = dir.filename().empty() ? dir.parent_path() : dir;
  const fs::path staging = (target.has_parent_path() ? target.parent_path() : fs::path(".")) /
                           ("." + target.filename().string() + ".partial-" + std::to_string(::getpid()));
  fs::remove_all(staging, ec);
  fs::create_directories(staging);
  try {
    const int64_t written = write_hf_files(ordered, hf_name, transposed, config_text, staging, dtype, max_shard_bytes);
    publish_hf_files(staging, target);
    return written;
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

}  // namespace hf_detail

namespace {

// The files of one export into `dir` (a fresh directory); returns the bytes written.
int64_t write_hf_files(const std::vector<const HfTensor*>& ordered,
                       const std::function<std::string(const std::string&)>& hf_name,
                       const std::function<bool(const std::string&)>& transposed, const std::string& config_text,
                       const fs::path& dir, at::ScalarType dtype, int64_t max_shard_bytes) {
  std::error_code ec;
  // save_pretrained's split: in order, a new shard when the next tensor would pass the limit, a
  // tensor above the limit alone.
  const int64_t element = int64_t(c10::elementSize(dtype));
  std::vector<std::vector<const HfTensor*>> shards;
  int64_t current = 0, total = 0, parameters = 0;
  std::vector<const HfTensor*> open;
  for (const HfTensor* t : ordered) {
    int64_t numel = 1;
    for (int64_t d : t->shape) numel *= d;
    const int64_t bytes = numel * element;
    total += bytes;
    parameters += numel;
    if (bytes > max_shard_bytes) {
      shards.push_back({t});
      continue;
    }
    if (current + bytes > max_shard_bytes && !open.empty()) {
      shards.push_back(std::move(open));
      open.clear();
      current = 0;
    }
    open.push_back(t);
    current += bytes;
  }
  if (!open.empty()) shards.push_back(std::move(open));
  const int n = int(shards.size());
  auto file_name = [&](int k) {
    if (n == 1) return std::string(kSingleFile);
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k + 1, n);
    return std::string(name);
  };
  int64_t written = 0;
  json weight_map = json::object();
  for (int k = 0; k < n; ++k) {
    std::vector<TensorRecord> records;
    for (const HfTensor* t : shards[size_t(k)]) {
      std::vector<int64_t> shape = t->shape;
      if (transposed(t->name)) std::swap(shape[0], shape[1]);
      records.push_back({hf_name(t->name), dtype, shape});
      weight_map[hf_name(t->name)] = file_name(k);
    }
    const fs::path path = dir / file_name(k), partial = path.string() + ".partial";
    try {
      SafetensorsWriter writer(partial, records, {{"format", "pt"}});
      for (const HfTensor* t : shards[size_t(k)]) {
        at::Tensor value = t->value();
        if (value.sizes().vec() != t->shape)
          throw DataError("export: tensor '" + t->name + "' came with shape " + shape_text(value.sizes().vec()) +
                          ", expected " + shape_text(t->shape));
        if (transposed(t->name)) value = value.t();
        writer.write(value.to(dtype).contiguous());
      }
      writer.finish();
      written += writer.bytes();
      fs::rename(partial, path);
    } catch (...) {
      fs::remove(partial, ec);
      throw;
    }
  }
  if (n > 1) {
    ordered_json index;
    index["metadata"] = {{"total_parameters", parameters}, {"total_size", total}};
    index["weight_map"] = weight_map;  // sorted by name, as save_pretrained writes it
    const std::string text = index.dump(2) + "\n";
    write_json_atomically(dir / kIndexFile, text);
    written += int64_t(text.size());
  }
  write_json_atomically(dir / kConfigFile, config_text);
  return written + int64_t(config_text.size());
}

}  // namespace

namespace hf_detail {

void check_export_options(at::ScalarType dtype, int64_t max_shard_bytes) {
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    throw ConfigError(std::string("export: expected dtype fp32 or bf16, found ") + c10::toString(dtype));
  if (max_shard_bytes <= 0) throw ConfigError("--max-shard-size: expected a positive size");
}

}  // namespace hf_detail

int64_t write_safetensors_model(const std::vector<HfTensor>& tensors, const fs::path& out, at::ScalarType dtype,
                                const std::map<std::string, std::string>& metadata) {
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    throw ConfigError(std::string("export: expected dtype fp32 or bf16, found ") + c10::toString(dtype));
  std::vector<TensorRecord> records;
  for (const HfTensor& t : tensors) records.push_back({t.name, dtype, t.shape});
  const fs::path partial = out.string() + ".partial";
  std::error_code ec;
  try {
    SafetensorsWriter writer(partial, records, metadata);
    for (const HfTensor& t : tensors) writer.write(t.value().to(dtype).contiguous());
    writer.finish();
    const int64_t bytes = writer.bytes();
    fs::rename(partial, out);
    return bytes;
  } catch (...) {
    fs::remove(partial, ec);
    throw;
  }
}

}  // namespace zt
