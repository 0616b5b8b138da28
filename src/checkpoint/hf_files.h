// Internal to src/checkpoint: what the Hugging Face import and export (hf.h) share across its
// parts: the layout's file names and bounds, small JSON files, tensor lists checked against a
// model's, and the writing of transformers' save_pretrained layout (hf.cpp). The model families'
// names and configurations are in hf_gpt2.cpp, hf_bert.cpp and hf_llama.cpp, the reading of a
// directory in hf_reader.cpp.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"

namespace zt::hf_detail {

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

bool ends_with(const std::string& s, std::string_view tail);

// Every tensor of our GPT (Llama) of this shape, in registration order.
std::vector<CheckpointParameter> gpt_tensors(const GPTConfig& c);
std::vector<CheckpointParameter> llama_tensors(const LlamaConfig& c);

std::string shape_text(const std::vector<int64_t>& shape);
// A regular file of at most kMaxJsonBytes; DataError naming `what` when it is missing.
std::string read_small_file(const fs::path& path, const std::string& what);
json parse_json_file(const fs::path& path, const std::string& what, int max_depth);
std::string dtype_name(at::ScalarType dtype);
void write_json_atomically(const fs::path& path, const std::string& text);

// The tensors in the model's order, each checked against the expected name and shape; `model`
// names the model in messages ("GPT", "BERT") and `configured` its configured shape.
std::vector<const HfTensor*> order_tensors(const std::vector<HfTensor>& tensors,
                                           const std::vector<CheckpointParameter>& expected, const std::string& model,
                                           const std::string& configured);

// The layout of transformers' save_pretrained for `ordered` tensors (checked, in the model's
// order): `hf_name` gives transformers' name of ours, `transposed` whether it is stored so.
int64_t write_hf_layout(const std::vector<const HfTensor*>& ordered,
                        const std::function<std::string(const std::string&)>& hf_name,
                        const std::function<bool(const std::string&)>& transposed, const std::string& config_text,
                        const fs::path& dir, at::ScalarType dtype, int64_t max_shard_bytes);

// The dtype and shard size of an export into the Hugging Face layout; ConfigError otherwise.
void check_export_options(at::ScalarType dtype, int64_t max_shard_bytes);

}  // namespace zt::hf_detail
