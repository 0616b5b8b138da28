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
#include "zerotrain/config.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
// Bounds on what we parse from a directory someone else wrote (as for our own files).
constexpr int64_t kMaxJsonBytes = int64_t(64) << 20;
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr int64_t kMaxTensors = 1'000'000;
// Elements converted at a time when reading: bounds the read buffer whatever is asked for.
constexpr int64_t kPieceElements = int64_t(4) << 20;

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Every tensor of our GPT of this shape, in registration order.
std::vector<CheckpointParameter> gpt_tensors(const GPTConfig& c) {
  const int64_t C = c.n_embd;
  std::vector<CheckpointParameter> out = {{"wte.weight", {c.vocab_size, C}}, {"wpe.weight", {c.context_length, C}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln_1.weight", {C}}, {"ln_1.bias", {C}}, {"attn.c_attn.weight", {3 * C, C}}, {"attn.c_attn.bias", {3 * C}},
             {"attn.c_proj.weight", {C, C}}, {"attn.c_proj.bias", {C}}, {"ln_2.weight", {C}}, {"ln_2.bias", {C}},
             {"mlp.c_fc.weight", {4 * C, C}}, {"mlp.c_fc.bias", {4 * C}}, {"mlp.c_proj.weight", {C, 4 * C}},
             {"mlp.c_proj.bias", {C}}})
      out.push_back({b + name, shape});
  }
  out.push_back({"ln_f.weight", {C}});
  out.push_back({"ln_f.bias", {C}});
  return out;
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

}  // namespace

std::string hf_gpt2_name(const std::string& name) {
  if (name.rfind("blocks.", 0) == 0) return "transformer.h." + name.substr(7);
  if (name == "wte.weight" || name == "wpe.weight" || name == "ln_f.weight" || name == "ln_f.bias")
    return "transformer." + name;
  return "";
}

bool hf_gpt2_transposed(const std::string& name) {
  return name.rfind("blocks.", 0) == 0 &&
         (ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
          ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight"));
}

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

GPTConfig gpt_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  auto value = [&](const std::string& key) -> json {
    auto it = resolved.find(key);
    if (it == resolved.end())
      throw DataError(where + ": the saved configuration has no '" + key +
                      "', so the model's shape (n_head) is not known; a Hugging Face export needs it");
    try {
      return json::parse(it->second);
    } catch (const json::exception&) {
      throw DataError(where + ": the saved configuration's '" + key + "' is not JSON: " + it->second);
    }
  };
  try {
    GPTConfig gpt = gpt_preset(value("model.preset").get<std::string>());
    auto override_int = [&](const std::string& key, int64_t& field) {
      if (resolved.count(key) == 0) return;
      const int64_t v = value(key).get<int64_t>();
      if (v > 0) field = v;
    };
    override_int("model.n_layer", gpt.n_layer);
    override_int("model.n_head", gpt.n_head);
    override_int("model.n_embd", gpt.n_embd);
    override_int("model.vocab_size", gpt.vocab_size);
    override_int("model.context_length", gpt.context_length);
    if (resolved.count("model.dropout") && value("model.dropout").get<double>() >= 0)
      gpt.dropout = value("model.dropout").get<double>();
    gpt.validate();
    return gpt;
  } catch (const json::exception& e) {
    throw DataError(where + ": the saved configuration's model keys are malformed (" + e.what() + ")");
  } catch (const ConfigError& e) {
    throw DataError(where + ": the saved configuration's model is not a GPT this build knows (" + e.what() + ")");
  }
}

std::string model_type_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  auto it = resolved.find("model.type");
  if (it == resolved.end()) return "gpt";  // saved before the key existed: the GPT
  try {
    const std::string type = json::parse(it->second).get<std::string>();
    if (type != "gpt" && type != "bert")
      throw DataError(where + ": the saved configuration's model.type is \"" + type + "\"; expected gpt or bert");
    return type;
  } catch (const json::exception&) {
    throw DataError(where + ": the saved configuration's 'model.type' is not a JSON string: " + it->second);
  }
}

BertConfig bert_config_from_resolved(const std::map<std::string, std::string>& resolved, const std::string& where) {
  // The configuration again, from the saved keys of its model block: bert_config_of applies the
  // preset and the overrides exactly as the run that saved it did.
  std::vector<std::string> overrides = {"model.type=bert"};
  for (const char* key : {"model.preset", "model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size",
                          "model.context_length", "model.dropout", "model.pre_layer_norm", "model.next_sentence"})
    if (auto it = resolved.find(key); it != resolved.end() && it->second != "null") {
      // The sizes' "from the preset" (0, and -1 for dropout) is no value to set.
      const json v = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
      if (v.is_number() && (v.get<double>() < 0 || (v.is_number_integer() && v.get<int64_t>() == 0))) continue;
      overrides.push_back(std::string(key) + "=" + it->second);
    }
  try {
    return bert_config_of(parse_config("{}", overrides, 1));
  } catch (const ConfigError& e) {
    throw DataError(where + ": the saved configuration's model is not a BERT this build knows (" + e.what() + ")");
  }
}

// ---------------------------------------------------------------- writing

namespace {

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

std::vector<const HfTensor*> ordered_gpt_tensors(const std::vector<HfTensor>& tensors, const GPTConfig& config) {
  for (const HfTensor& t : tensors)
    if (hf_gpt2_name(t.name).empty())
      throw DataError("export --format hf: tensor '" + t.name + "' is not one of the GPT's (a Hugging Face GPT-2 "
                      "export needs the reference GPT model)");
  return order_tensors(tensors, gpt_tensors(config), "GPT",
                       std::to_string(config.n_layer) + " layers, width " + std::to_string(config.n_embd));
}

std::string hf_config_json(const GPTConfig& c, at::ScalarType dtype) {
  ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.context_length;
  j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_inner"] = nullptr;  // 4 × n_embd, as ours
  j["activation_function"] = "gelu_new";  // GELU, tanh approximation
  j["layer_norm_epsilon"] = 1e-5;         // LibTorch's LayerNorm default, which the GPT uses
  j["resid_pdrop"] = c.dropout;
  j["embd_pdrop"] = c.dropout;
  j["attn_pdrop"] = c.dropout;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["tie_word_embeddings"] = true;
  j["use_cache"] = true;
  // GPT-2's end-of-text token is its last one; for another vocabulary the last id stands in.
  j["bos_token_id"] = c.vocab_size - 1;
  j["eos_token_id"] = c.vocab_size - 1;
  j["dtype"] = dtype_name(dtype);
  j["torch_dtype"] = dtype_name(dtype);
  return j.dump(2) + "\n";
}

}  // namespace

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

void check_export_options(at::ScalarType dtype, int64_t max_shard_bytes) {
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    throw ConfigError(std::string("export: expected dtype fp32 or bf16, found ") + c10::toString(dtype));
  if (max_shard_bytes <= 0) throw ConfigError("--max-shard-size: expected a positive size");
}

}  // namespace

int64_t write_hf_model(const std::vector<HfTensor>& tensors, const GPTConfig& config, const fs::path& dir,
                       at::ScalarType dtype, int64_t max_shard_bytes) {
  check_export_options(dtype, max_shard_bytes);
  return write_hf_layout(ordered_gpt_tensors(tensors, config), hf_gpt2_name, hf_gpt2_transposed,
                         hf_config_json(config, dtype), dir, dtype, max_shard_bytes);
}



// ---------------------------------------------------------------- BERT

std::string hf_bert_name(const std::string& name) {
  // Prefix rules, checked in order; the layer index is carried over.
  static const std::vector<std::pair<std::string, std::string>> kFixed = {
      {"embeddings.word_embeddings.", "bert.embeddings.word_embeddings."},
      {"embeddings.position_embeddings.", "bert.embeddings.position_embeddings."},
      {"embeddings.token_type_embeddings.", "bert.embeddings.token_type_embeddings."},
      {"embeddings.layer_norm.", "bert.embeddings.LayerNorm."},
      {"mlm.dense.", "cls.predictions.transform.dense."},
      {"mlm.layer_norm.", "cls.predictions.transform.LayerNorm."},
      {"nsp.pooler.", "bert.pooler.dense."},
      {"nsp.classifier.", "cls.seq_relationship."}};
  static const std::vector<std::pair<std::string, std::string>> kLayer = {
      {"attention.query.", "attention.self.query."},   {"attention.key.", "attention.self.key."},
      {"attention.value.", "attention.self.value."},   {"attention.output.", "attention.output.dense."},
      {"attention_norm.", "attention.output.LayerNorm."}, {"intermediate.", "intermediate.dense."},
      {"output.", "output.dense."},                     {"output_norm.", "output.LayerNorm."}};
  if (name == "mlm.bias") return "cls.predictions.bias";
  for (const auto& [ours, theirs] : kFixed)
    if (name.rfind(ours, 0) == 0) return theirs + name.substr(ours.size());
  if (name.rfind("layers.", 0) == 0) {
    const size_t dot = name.find('.', 7);
    if (dot == std::string::npos) return "";
    const std::string index = name.substr(7, dot - 7), rest = name.substr(dot + 1);
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return "";
    for (const auto& [ours, theirs] : kLayer)
      if (rest.rfind(ours, 0) == 0) return "bert.encoder.layer." + index + "." + theirs + rest.substr(ours.size());
  }
  return "";  // final_norm (pre-LN) has no place in transformers' BERT
}

namespace {

// BertImpl's registration order (models/bert.h), with shapes.
std::vector<CheckpointParameter> bert_tensors(const BertConfig& c) {
  const int64_t H = c.hidden, I = c.intermediate;
  std::vector<CheckpointParameter> t = {{"embeddings.word_embeddings.weight", {c.vocab_size, H}},
                                        {"embeddings.position_embeddings.weight", {c.max_positions, H}},
                                        {"embeddings.token_type_embeddings.weight", {c.type_vocab_size, H}},
                                        {"embeddings.layer_norm.weight", {H}},
                                        {"embeddings.layer_norm.bias", {H}}};
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    for (const char* m : {"attention.query", "attention.key", "attention.value", "attention.output"}) {
      t.push_back({p + m + ".weight", {H, H}});
      t.push_back({p + m + ".bias", {H}});
    }
    t.push_back({p + "attention_norm.weight", {H}});
    t.push_back({p + "attention_norm.bias", {H}});
    t.push_back({p + "intermediate.weight", {I, H}});
    t.push_back({p + "intermediate.bias", {I}});
    t.push_back({p + "output.weight", {H, I}});
    t.push_back({p + "output.bias", {H}});
    t.push_back({p + "output_norm.weight", {H}});
    t.push_back({p + "output_norm.bias", {H}});
  }
  t.push_back({"mlm.bias", {c.vocab_size}});
  t.push_back({"mlm.dense.weight", {H, H}});
  t.push_back({"mlm.dense.bias", {H}});
  t.push_back({"mlm.layer_norm.weight", {H}});
  t.push_back({"mlm.layer_norm.bias", {H}});
  if (c.next_sentence) {
    t.push_back({"nsp.pooler.weight", {H, H}});
    t.push_back({"nsp.pooler.bias", {H}});
    t.push_back({"nsp.classifier.weight", {2, H}});
    t.push_back({"nsp.classifier.bias", {2}});
  }
  return t;
}

std::string hf_bert_config_json(const BertConfig& c, at::ScalarType dtype) {
  ordered_json j;
  // With the NSP head the pre-training model; without it the masked-LM one (no pooler).
  j["architectures"] = {c.next_sentence ? "BertForPreTraining" : "BertForMaskedLM"};
  j["model_type"] = "bert";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden;
  j["num_hidden_layers"] = c.n_layer;
  j["num_attention_heads"] = c.n_head;
  j["intermediate_size"] = c.intermediate;
  j["hidden_act"] = "gelu";  // exact (erf), as ours
  j["hidden_dropout_prob"] = c.dropout;
  j["attention_probs_dropout_prob"] = c.dropout;
  j["max_position_embeddings"] = c.max_positions;
  j["type_vocab_size"] = c.type_vocab_size;
  j["initializer_range"] = 0.02;
  j["layer_norm_eps"] = c.layer_norm_eps;
  j["position_embedding_type"] = "absolute";
  j["tie_word_embeddings"] = true;
  j["use_cache"] = true;
  j["dtype"] = dtype_name(dtype);
  j["torch_dtype"] = dtype_name(dtype);
  return j.dump(2) + "\n";
}

}  // namespace

int64_t write_hf_bert_model(const std::vector<HfTensor>& tensors, const BertConfig& config, const fs::path& dir,
                            at::ScalarType dtype, int64_t max_shard_bytes) {
  check_export_options(dtype, max_shard_bytes);
  if (config.pre_layer_norm)
    throw ConfigError("export --format hf: model.pre_layer_norm true has no Hugging Face BERT layout (transformers' "
                      "BERT is post-LayerNorm); expected false, or export --format safetensors");
  for (const HfTensor& t : tensors)
    if (hf_bert_name(t.name).empty())
      throw DataError("export --format hf: tensor '" + t.name + "' is not one of the BERT's (a Hugging Face BERT "
                      "export needs the reference BERT model)");
  const std::vector<const HfTensor*> ordered =
      order_tensors(tensors, bert_tensors(config), "BERT",
                    std::to_string(config.n_layer) + " layers, width " + std::to_string(config.hidden) +
                        (config.next_sentence ? ", with the NSP head" : ", without the NSP head"));
  return write_hf_layout(
      ordered, hf_bert_name, [](const std::string&) { return false; }, hf_bert_config_json(config, dtype), dir, dtype,
      max_shard_bytes);
}

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

// ---------------------------------------------------------------- reading

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
  std::vector<std::unique_ptr<ForeignFile>> files;
  std::map<std::string, std::pair<size_t, std::string>> located;  // HF name -> (file, name in it)
  int64_t bytes_read = 0;
  at::Tensor raw;  // read buffer

  // The file and entry of one of our tensors, its shape checked.
  std::pair<const ForeignFile*, const ForeignEntry*> find(const std::string& name, const std::vector<int64_t>& shape) {
    const std::string hf = hf_gpt2_name(name);
    if (hf.empty())
      throw DataError("model.init_from '" + dir.string() + "': '" + name + "' is not a GPT-2 tensor (a Hugging Face "
                      "GPT-2 directory fills the reference GPT only)");
    // Files saved from GPT2Model (and the original GPT-2 uploads) name tensors without "transformer.".
    auto it = located.find(hf);
    if (it == located.end()) it = located.find(hf.substr(std::string("transformer.").size()));
    if (it == located.end())
      throw DataError("model.init_from '" + dir.string() + "': no tensor '" + hf + "' (our '" + name + "') in its files");
    const ForeignFile* file = files[it->second.first].get();
    const ForeignEntry& e = file->entries.at(it->second.second);
    std::vector<int64_t> expected = shape;
    if (hf_gpt2_transposed(name) && expected.size() == 2) std::swap(expected[0], expected[1]);
    if (e.shape != expected)
      throw DataError("'" + file->path.string() + "': tensor '" + it->second.second + "' has shape " + shape_text(e.shape) +
                      ", expected " + shape_text(expected) + (hf_gpt2_transposed(name) ? " (Conv1D: [in, out])" : ""));
    if (e.dtype == at::ScalarType::Undefined)
      throw DataError("'" + file->path.string() + "': tensor '" + it->second.second +
                      "' is not F32, F16, BF16 or F64");
    return {file, &e};
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

HfModelReader::HfModelReader(const fs::path& dir, const GPTConfig& config) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.dir = dir;
  const std::string where = "model.init_from '" + dir.string() + "'";
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
  // Every tensor of the model is there with its shape, before any rank reads anything.
  for (const CheckpointParameter& p : gpt_tensors(config)) s.find(p.name, p.shape);
}

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
    throw Error("model.init_from: elements [" + std::to_string(begin) + ", " + std::to_string(begin + count) + ") of '" +
                name + "' asked for, which has " + std::to_string(numel));
  const int64_t element = int64_t(c10::elementSize(entry->dtype));
  auto convert = [&](const void* raw, int64_t n, float* to) {
    at::from_blob(to, {n}, at::kFloat).copy_(at::from_blob(const_cast<void*>(raw), {n}, entry->dtype));
  };
  if (!hf_gpt2_transposed(name)) {
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
