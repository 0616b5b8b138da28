// A Hugging Face config.json of a Llama-family model as the decoder's shape and back
// (src/config/llama_hf_config.cpp), and model.type "llama" in the configuration (llama_config_of,
// the keys refused beside it). transformers' own files are read in tests/hf_llama_test.cpp.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>

#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/config/llama_config.h"

namespace {

using json = nlohmann::json;

// What transformers 5.24 writes for a LlamaForCausalLM (save_pretrained), trimmed of nothing.
const char* kLlamaV5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1,
  "dtype": "float32", "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
  "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 64, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
  "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 16, "rope_theta": 500000.0, "rope_type": "llama3"},
  "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true, "vocab_size": 96})";

// Llama 3.2's file as uploaded (transformers 4): rope_theta beside rope_scaling.
const char* kLlamaV4 = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "model_type": "llama"})";

const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64,
  "intermediate_size": 96, "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 64,
  "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "sliding_window": null, "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 96})";

std::string error_of(const std::string& text) {
  try {
    zt::llama_config_from_hf_json(text, "model.init_from 'd'");
  } catch (const zt::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error for " << text;
  return "";
}

std::string edited(const std::string& text, const std::string& key, const json& value) {
  json j = json::parse(text);
  if (value.is_null()) j.erase(key);
  else j[key] = value;
  return j.dump();
}

std::string config_error(const std::string& text) {
  try {
    const zt::TrainConfig c = zt::parse_config(text, {}, 1);
    zt::llama_config_of(c);
  } catch (const zt::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error for " << text;
  return "";
}

}  // namespace

TEST(LlamaHfConfig, ReadsTransformers5And4Files) {
  const zt::LlamaConfig a = zt::llama_config_from_hf_json(kLlamaV5, "x");
  EXPECT_EQ(a.vocab_size, 96);
  EXPECT_EQ(a.hidden_size, 64);
  EXPECT_EQ(a.intermediate_size, 96);
  EXPECT_EQ(a.num_hidden_layers, 2);
  EXPECT_EQ(a.num_attention_heads, 4);
  EXPECT_EQ(a.num_key_value_heads, 2);
  EXPECT_EQ(a.head_dim, 16);
  EXPECT_EQ(a.max_position_embeddings, 64);
  EXPECT_EQ(a.rms_norm_eps, 1e-5);
  EXPECT_EQ(a.rope_theta, 500000.0);
  EXPECT_EQ(a.rope_scaling.type, "llama3");
  EXPECT_EQ(a.rope_scaling.factor, 8.0);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, 16);
  EXPECT_FALSE(a.tie_word_embeddings);
  EXPECT_FALSE(a.qkv_bias || a.attention_bias || a.mlp_bias);
  EXPECT_EQ(zt::llama_hf_architecture(a), "LlamaForCausalLM");

  // Llama 3.2 1B's uploaded file is the llama-1b preset.
  const zt::LlamaConfig b = zt::llama_config_from_hf_json(kLlamaV4, "x");
  const zt::LlamaConfig preset = zt::llama_preset("llama-1b");
  EXPECT_EQ(zt::llama_parameter_count(b), zt::llama_parameter_count(preset));
  EXPECT_EQ(b.rope_theta, preset.rope_theta);
  EXPECT_EQ(b.rope_scaling.type, "llama3");
  EXPECT_EQ(b.rope_scaling.factor, 32.0);
  EXPECT_EQ(b.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(b.tie_word_embeddings);
  // transformers 4's older spelling of the kind ("type"), and linear scaling.
  const zt::LlamaConfig linear =
      zt::llama_config_from_hf_json(edited(kLlamaV4, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}), "x");
  EXPECT_EQ(linear.rope_scaling.type, "linear");
  EXPECT_EQ(linear.rope_scaling.factor, 2.0);
  // Absent optional keys: transformers' defaults (kv heads = heads, head_dim = width / heads).
  json bare = json::parse(kLlamaV5);
  for (const char* key : {"num_key_value_heads", "head_dim", "rope_parameters", "rms_norm_eps", "tie_word_embeddings"})
    bare.erase(key);
  const zt::LlamaConfig d = zt::llama_config_from_hf_json(bare.dump(), "x");
  EXPECT_EQ(d.num_key_value_heads, 4);
  EXPECT_EQ(d.resolved_head_dim(), 16);
  EXPECT_EQ(d.rope_scaling.type, "default");
  EXPECT_EQ(d.rope_theta, 10000.0);
  EXPECT_EQ(d.rms_norm_eps, 1e-6);
  EXPECT_FALSE(d.tie_word_embeddings);
}

TEST(LlamaHfConfig, ReadsQwen2WithItsQkvBiases) {
  const zt::LlamaConfig q = zt::llama_config_from_hf_json(kQwen2, "x");
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_FALSE(q.attention_bias);
  EXPECT_FALSE(q.mlp_bias);
  EXPECT_TRUE(q.tie_word_embeddings);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.resolved_head_dim(), 16);
  EXPECT_EQ(zt::llama_hf_architecture(q), "Qwen2ForCausalLM");
  // model_type alone, without "architectures", names the class too.
  EXPECT_TRUE(zt::llama_config_from_hf_json(edited(kQwen2, "architectures", nullptr), "x").qkv_bias);
}

TEST(LlamaHfConfig, RefusesWhatTheDecoderDoesNotCompute) {
  const std::string other = error_of(edited(kLlamaV5, "architectures", {"MistralForCausalLM"}));
  EXPECT_NE(other.find("model.init_from 'd'"), std::string::npos) << other;
  EXPECT_NE(other.find("MistralForCausalLM"), std::string::npos) << other;
  EXPECT_NE(other.find("LlamaForCausalLM or Qwen2ForCausalLM"), std::string::npos) << other;
  EXPECT_NE(error_of(edited(edited(kLlamaV5, "architectures", nullptr), "model_type", "gpt2")).find("\"gpt2\""),
            std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "hidden_act", "gelu")).find("hidden_act: expected \"silu\", found \"gelu\""),
            std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "attention_dropout", 0.1)).find("attention_dropout"), std::string::npos);
  EXPECT_NE(error_of(edited(kQwen2, "use_sliding_window", true)).find("use_sliding_window"), std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}}))
                .find("rope_scaling.rope_type"),
            std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "hidden_size", "64")).find("hidden_size: expected an integer, found \"64\""),
            std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "vocab_size", nullptr)).find("vocab_size: expected an integer (the key is required)"),
            std::string::npos);
  EXPECT_NE(error_of(edited(kLlamaV5, "num_key_value_heads", 3)).find("num_key_value_heads"), std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(error_of("{").find("not valid JSON"), std::string::npos);
}

TEST(LlamaHfConfig, WritesWhatItReadsKeepingTheOtherKeys) {
  for (const char* text : {kLlamaV5, kLlamaV4, kQwen2}) {
    const zt::LlamaConfig c = zt::llama_config_from_hf_json(text, "x");
    const std::string written = zt::llama_config_to_hf_json(c, "float32", text);
    const zt::LlamaConfig back = zt::llama_config_from_hf_json(written, "x");
    EXPECT_EQ(back.vocab_size, c.vocab_size);
    EXPECT_EQ(back.resolved_head_dim(), c.resolved_head_dim());
    EXPECT_EQ(back.num_key_value_heads, c.num_key_value_heads);
    EXPECT_EQ(back.rope_theta, c.rope_theta);
    EXPECT_EQ(back.rope_scaling.type, c.rope_scaling.type);
    EXPECT_EQ(back.rope_scaling.factor, c.rope_scaling.factor);
    EXPECT_EQ(back.rope_scaling.original_max_position_embeddings, c.rope_scaling.original_max_position_embeddings);
    EXPECT_EQ(back.rms_norm_eps, c.rms_norm_eps);
    EXPECT_EQ(back.qkv_bias, c.qkv_bias);
    EXPECT_EQ(back.tie_word_embeddings, c.tie_word_embeddings);
    const json j = json::parse(written);
    EXPECT_EQ(j["dtype"], "float32");
    EXPECT_FALSE(j.contains("rope_scaling")) << "transformers 5's rope_parameters replaces it";
    const json original = json::parse(text);
    if (original.contains("bos_token_id")) {
      EXPECT_EQ(j["bos_token_id"], original["bos_token_id"]);
    }
  }
  // Without a source file: the keys transformers needs, for a preset.
  const json tiny = json::parse(zt::llama_config_to_hf_json(zt::llama_preset("llama-tiny"), "bfloat16", ""));
  EXPECT_EQ(tiny["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(tiny["model_type"], "llama");
  EXPECT_EQ(tiny["head_dim"], 16);
  EXPECT_EQ(tiny["dtype"], "bfloat16");
}

TEST(LlamaConfigOf, PresetWithOverridesOrADirectory) {
  const zt::TrainConfig plain = zt::parse_config(R"({"model": {"type": "llama"}})", {}, 1);
  EXPECT_EQ(plain.model.preset, "llama-tiny");
  EXPECT_EQ(zt::llama_parameter_count(zt::llama_config_of(plain)), zt::llama_parameter_count(zt::llama_preset("llama-tiny")));
  const zt::LlamaConfig o = zt::llama_config_of(zt::parse_config(
      R"({"model": {"type": "llama", "n_layer": 3, "n_head": 8, "n_kv_head": 1, "n_embd": 128, "intermediate_size": 200,
                    "vocab_size": 300, "context_length": 32}})",
      {}, 1));
  EXPECT_EQ(o.num_hidden_layers, 3);
  EXPECT_EQ(o.num_attention_heads, 8);
  EXPECT_EQ(o.num_key_value_heads, 1);
  EXPECT_EQ(o.hidden_size, 128);
  EXPECT_EQ(o.resolved_head_dim(), 16);
  EXPECT_EQ(o.intermediate_size, 200);
  EXPECT_EQ(o.vocab_size, 300);
  EXPECT_EQ(o.max_position_embeddings, 32);
  // llama-1b's explicit head_dim follows a changed width.
  EXPECT_EQ(zt::llama_config_of(zt::parse_config(R"({"model": {"type": "llama", "preset": "llama-1b", "n_embd": 1024}})",
                                                 {}, 1))
                .resolved_head_dim(),
            32);

  // A directory's config.json is the shape.
  const std::string dir = zt::testing::make_temp_dir("llama-config-of");
  std::ofstream(dir + "/config.json") << kQwen2;
  const zt::TrainConfig from_dir =
      zt::parse_config(R"({"model": {"type": "llama", "config_from": ")" + dir + R"("}})", {}, 1);
  EXPECT_TRUE(zt::llama_config_of(from_dir).qkv_bias);
  const std::string missing = config_error(R"({"model": {"type": "llama", "init_from": ")" + dir + R"(/nowhere"}})");
  EXPECT_NE(missing.find("model.init_from '" + dir + "/nowhere': expected a Hugging Face model directory"),
            std::string::npos)
      << missing;
  std::filesystem::create_directories(dir + "/empty");
  EXPECT_NE(config_error(R"({"model": {"type": "llama", "config_from": ")" + dir + R"(/empty"}})").find("config.json"),
            std::string::npos);
}

TEST(LlamaConfigOf, TheExampleConfigurationLoadsWithoutNotes) {
  const zt::TrainConfig c = zt::load_config(std::string(ZT_SOURCE_DIR) + "/configs/llama_tiny.json", {}, 2);
  EXPECT_TRUE(c.notes.empty());
  EXPECT_EQ(c.model.type, "llama");
  EXPECT_EQ(zt::llama_config_of(c).num_hidden_layers, 2);
}

TEST(LlamaConfigOf, KeysThatWouldBeIgnoredAreRefused) {
  const std::string unknown = config_error(R"({"model": {"type": "llama", "preset": "tiny"}})");
  EXPECT_NE(unknown.find("model.preset: expected a Llama preset"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("llama-tiny, llama-1b"), std::string::npos) << unknown;
  const std::string heads = config_error(R"({"model": {"type": "llama", "n_head": 3}})");
  EXPECT_NE(heads.find("model.n_embd (hidden_size): expected a multiple of num_attention_heads (3)"), std::string::npos)
      << heads;
  EXPECT_NE(config_error(R"({"model": {"type": "llama", "n_kv_head": 3}})").find("model.n_kv_head"), std::string::npos);
  const std::pair<const char*, const char*> refused[] = {
      {R"({"model": {"type": "llama", "dropout": 0.1}})", "model.dropout: applies to model.type \"gpt\" and \"bert\""},
      {R"({"model": {"type": "llama", "loss_chunk_tokens": 8}})", "model.loss_chunk_tokens: applies to"},
      {R"({"model": {"type": "llama", "pre_layer_norm": true}})", "model.pre_layer_norm: applies to"},
      {R"({"model": {"n_kv_head": 2}})", "model.n_kv_head: applies to model.type \"llama\" only, found model.type \"gpt\""},
      {R"({"model": {"type": "bert", "config_from": "d"}})", "model.config_from: applies to model.type \"llama\" only"},
      {R"({"model": {"type": "llama", "init_from": "d", "n_layer": 4}})",
       "model.n_layer: expected no shape beside model.init_from"},
      {R"({"model": {"type": "llama", "config_from": "d", "preset": "llama-1b"}})",
       "model.preset: expected no shape beside model.config_from"},
      {R"({"model": {"type": "llama", "config_from": "d", "init_from": "e"}})",
       "expected at most one of model.init_from and model.config_from"},
      {R"({"model": {"type": "llama"}, "activation_checkpointing": {"policy": "selective"}})",
       "activation_checkpointing.policy: expected \"none\" or \"full\" with model.type \"llama\", found \"selective\""},
      {R"({"model": {"type": "llama"}, "activation_checkpointing": {"profile": true}})",
       "activation_checkpointing.profile: not implemented for model.type \"llama\""},
      {R"({"model": {"type": "llama"}, "data": {"sequence_length": 129}})",
       "data.sequence_length: expected at most the Llama's max_position_embeddings 128"},
  };
  for (const auto& [text, message] : refused) {
    SCOPED_TRACE(text);
    const std::string e = config_error(text);
    EXPECT_NE(e.find(message), std::string::npos) << e;
  }
}

// Every size read from a config.json is bounded as the model.* key that sets it is, before the
// parameter count or the estimate multiplies it: 2^40 layers would make the estimate and the
// launcher grow without bound, a vocabulary of 2^62 + 1 overflows the count to nonsense.
TEST(LlamaHfConfig, ShapesAreBoundedAsTheModelKeysAre) {
  const int64_t huge = (int64_t(1) << 62) + 1;
  const std::tuple<const char*, int64_t, int64_t> fields[] = {
      {"vocab_size", int64_t(1) << 24, huge},
      {"hidden_size", int64_t(1) << 20, (int64_t(1) << 20) + 4},
      {"intermediate_size", int64_t(1) << 22, int64_t(1) << 40},
      {"num_hidden_layers", int64_t(1) << 16, int64_t(1) << 40},
      {"num_attention_heads", int64_t(1) << 16, (int64_t(1) << 16) + 2},
      {"num_key_value_heads", int64_t(1) << 16, huge},
      {"max_position_embeddings", int64_t(1) << 24, huge},
  };
  for (const auto& [key, bound, found] : fields) {
    SCOPED_TRACE(key);
    const std::string e = error_of(edited(kLlamaV5, key, found));
    EXPECT_NE(e.find("model.init_from 'd': config.json"), std::string::npos) << e;
    EXPECT_NE(e.find(std::string(key) + ": expected at most " + std::to_string(bound)), std::string::npos) << e;
    EXPECT_NE(e.find("found " + std::to_string(found)), std::string::npos) << e;
  }
  // The attention's width, heads x head_dim, is bounded as model.n_embd is.
  const std::string head_dim = error_of(edited(kLlamaV5, "head_dim", (int64_t(1) << 18) + 2));
  EXPECT_NE(head_dim.find("head_dim: expected at most 262144"), std::string::npos) << head_dim;
  // The bounds themselves are accepted.
  json at_bounds = json::parse(kLlamaV5);
  at_bounds["vocab_size"] = int64_t(1) << 24;
  at_bounds["num_hidden_layers"] = int64_t(1) << 16;
  at_bounds["intermediate_size"] = int64_t(1) << 22;
  at_bounds["max_position_embeddings"] = int64_t(1) << 24;
  at_bounds["head_dim"] = int64_t(1) << 18;
  const zt::LlamaConfig c = zt::llama_config_from_hf_json(at_bounds.dump(), "d");
  EXPECT_EQ(c.num_hidden_layers, int64_t(1) << 16);
  EXPECT_GT(zt::llama_parameter_count(c), 0);
  // They are the configuration's bounds of the model.* keys.
  const std::pair<const char*, int64_t> keys[] = {
      {"n_layer", zt::kMaxLlamaLayers},   {"n_head", zt::kMaxLlamaHeads},
      {"n_kv_head", zt::kMaxLlamaHeads},  {"n_embd", zt::kMaxLlamaWidth},
      {"vocab_size", zt::kMaxLlamaVocab}, {"intermediate_size", zt::kMaxLlamaIntermediate},
      {"context_length", zt::kMaxLlamaPositions}};
  for (const auto& [key, bound] : keys) {
    SCOPED_TRACE(key);
    auto range_error = [&](int64_t v) -> std::string {
      try {
        zt::parse_config(json{{"model", {{"type", "llama"}, {key, v}}}}.dump(), {}, 1);
      } catch (const zt::ConfigError& e) {
        // The key's own range says "model.KEY: expected ..."; the shape's other checks name it otherwise.
        const std::string what = e.what();
        if (what.rfind("model." + std::string(key) + ": ", 0) == 0) return what;
      }
      return "";
    };
    EXPECT_NE(range_error(bound + 1), "");
    EXPECT_EQ(range_error(bound), "");
  }
}

// `zerotrain estimate` of a configuration whose config.json holds an overflowing vocabulary stops
// in one line naming the file and the key, instead of estimating 0 parameters.
TEST(LlamaHfConfig, EstimateRefusesAnOverflowingConfigJson) {
  const std::string dir = zt::testing::make_temp_dir("llama-config-bounds");
  std::ofstream(dir + "/config.json") << edited(kLlamaV5, "vocab_size", (int64_t(1) << 62) + 1);
  std::ofstream(dir + "/train.json") << R"({"train_micro_batch_size_per_gpu": 1,
      "model": {"type": "llama", "config_from": ")" + dir + R"("}, "data": {"sequence_length": 16}})";
  const auto r = zt::testing::run_process({zt::testing::cli_path(), "estimate", dir + "/train.json"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::string text = r.output;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  EXPECT_EQ(text.find('\n'), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vocab_size: expected at most 16777216"), std::string::npos) << r.output;
}
