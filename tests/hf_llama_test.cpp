// Llama-family models on the command line with Hugging Face weights in and out
// (src/checkpoint/hf_llama.cpp, docs/llama.md): `zerotrain train` with model.init_from of a
// transformers-saved LlamaForCausalLM or Qwen2ForCausalLM gives transformers' first loss at every
// ZeRO stage (a sharded directory too), `export --format hf` round-trips the weights bitwise and,
// after training, transformers loads the export with the trained model's logits; bad directories
// are one-line errors before launch. The transformers side runs with the pinned wheels of
// scripts/python_deps.sh (tests/support/llama_hf_check.py); without them those tests skip, saying why.
//
// Tolerance: fp32 everywhere, so the first loss differs from transformers' only by the order of
// floating-point operations in two builds of the same kernels (about 1e-7 relative); 1e-5
// relative, as the GPT-2 tests, leaves room for that and still catches any wrong weight, bias,
// norm or rotary table (each moves the loss by far more).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/llama.h"

namespace fs = std::filesystem;
using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

namespace {

zt::testing::ProcessResult python(const std::vector<std::string>& args) {
  return zt::testing::run_transformers_script("llama_hf_check.py", args, std::chrono::seconds(180));
}

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }


// 2 ranks × 2 sequences of 16 tokens of `tokens`, seed 3. `model`: the "model" block's JSON.
// The held-out file is the training one, so that the training windows cover the whole file (as
// llama_hf_check.py's do); without `whole_file` the default split applies (and no note about the
// unused held-out file is printed).
std::string train_config(const std::string& dir, const std::string& tokens, int stage, const std::string& model,
                         int64_t steps = 1, const std::string& extra = "", bool whole_file = true) {
  return write_file(dir + "/train.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "zero_optimization": {"stage": )" + std::to_string(stage) + R"(},
    "model": )" + model + R"(,
    "data": {"source": "bin", "path": ")" + tokens + (whole_file ? R"(", "val_path": ")" + tokens : std::string()) +
                                    R"(", "sequence_length": 16},
    "train": {"steps": )" + std::to_string(steps) + R"(, "seed": 3, "threads": 1, "log_dir": ")" + dir + "\"}" + extra + "}");
}

std::string init_from(const std::string& dir) { return R"({"type": "llama", "init_from": ")" + dir + R"("})"; }

nlohmann::json train(const std::string& dir, const std::string& config, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {cli_path(), "train", config, "--nproc", "2", "--summary", dir + "/summary.json"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_process(args, {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return {};
  return read_json(dir + "/summary.json");
}

std::string run_dir(const std::string& root, const std::string& name) {
  const std::string dir = root + "/" + name;
  fs::create_directories(dir);
  return dir;
}

// The value printed after `key` in `output`.
double value_after(const std::string& output, const std::string& key) {
  const size_t at = output.find(key);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no '" << key << "' in " << output;
    return NAN;
  }
  return std::stod(output.substr(at + key.size()));
}

// A CLI error: exit code 2 and one line naming what is wrong.
void expect_one_line_error(const zt::testing::ProcessResult& r, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::string text = r.output;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 0) << r.output;
  for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
}

}  // namespace

// model.init_from of transformers' own directories: the first loss at stages 0-3 on 2 ranks is
// transformers' on the same batch; with full recomputation too; a sharded directory (index) is
// read; at stage 3 each rank reads about half of the tensor bytes, at stage 0 all of them.
TEST(HfLlamaInitFrom, FirstLossEqualsTransformersAtEveryStage) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-llama-init");
  const std::string tokens = zt::testing::write_byte_token_file(dir);
  // The models and transformers' losses on them, in one process (importing transformers is slow).
  const auto p = python({"make", dir, "--", "loss", tokens, "3", "16", "2", "2", dir + "/llama", dir + "/llama-sharded",
                         dir + "/qwen2"});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  struct Case {
    std::string model;
    int stage;
    std::string extra;
  };
  const std::vector<Case> cases = {{"llama", 0, ""},
                                   {"llama", 1, ""},
                                   {"qwen2", 2, ""},
                                   {"llama-sharded", 3, R"(, "activation_checkpointing": {"policy": "full"})"}};
  std::vector<nlohmann::json> summaries;
  for (const Case& c : cases) {
    const std::string run = run_dir(dir, c.model + "-" + std::to_string(c.stage));
    summaries.push_back(train(run, train_config(run, tokens, c.stage, init_from(dir + "/" + c.model), 1, c.extra)));
    ASSERT_FALSE(summaries.back().is_null()) << c.model << " stage " << c.stage;
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.model + " stage " + std::to_string(c.stage));
    const double expected = value_after(p.output, "loss " + dir + "/" + c.model + " ");
    const double found = summaries[i]["losses"][0].get<double>();
    EXPECT_NEAR(found, expected, 1e-5 * expected) << "zerotrain " << found << ", transformers " << expected;
    EXPECT_EQ(summaries[i]["model"]["type"], "llama");
    const auto& init = summaries[i]["init_from"];
    const double total = init["tensor_bytes"].get<double>();
    ASSERT_EQ(init["bytes_read_per_rank"].size(), 2u) << init.dump();
    for (const auto& b : init["bytes_read_per_rank"]) {
      if (c.stage == 0) {
        EXPECT_EQ(b.get<double>(), total) << "stage 0 keeps every master on every rank";
      } else if (c.stage == 3) {
        EXPECT_LE(b.get<double>(), 0.6 * total) << "a rank read more than its shards: " << init.dump();
      }
    }
  }
}

// export --format hf: after 0 steps (export --init of a configuration with model.init_from) the
// tensors are bitwise the directory's, with its tokenizer files beside them; after a few steps at
// stage 3 (Llama) and stage 2 (Qwen2), transformers loads the export with the logits of the
// trained model, which a fresh C++ model computes from the checkpoint.
TEST(HfLlamaExport, RoundTripsBitwiseAndTransformersLoadsTheTrainedModel) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-llama-export");
  const std::string tokens = zt::testing::write_byte_token_file(dir);
  auto p = python({"make", dir});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const std::map<std::string, std::string> tokenizer = {{"tokenizer.json", R"({"version": "1.0", "model": {}})"},
                                                        {"tokenizer_config.json", R"({"bos_token": "<s>"})"},
                                                        {"special_tokens_map.json", R"({"eos_token": "</s>"})"}};
  for (const auto& [name, text] : tokenizer) write_file(dir + "/llama/" + name, text);

  std::vector<std::string> checks;
  for (const std::string model : {"llama", "qwen2"}) {
    SCOPED_TRACE(model);
    const int stage = model == "llama" ? 3 : 2;
    const std::string run = run_dir(dir, "run-" + model);
    const std::string config = train_config(run, tokens, stage, init_from(dir + "/" + model), 3);
    // 0 steps: the weights a run starts from.
    auto r = run_process({cli_path(), "export", "--init", config, "--format", "hf", "--out", dir + "/init-" + model}, {},
                         std::chrono::seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    checks.insert(checks.end(), {"same", dir + "/" + model, dir + "/init-" + model, "--"});
    // A few steps, then the checkpoint's export.
    ASSERT_FALSE(train(run, config, {"--save-dir", run + "/ckpt"}).is_null());
    r = run_process({cli_path(), "export", run + "/ckpt", "--format", "hf", "--out", dir + "/trained-" + model}, {},
                    std::chrono::seconds(60));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("Hugging Face Llama-family directory"), std::string::npos) << r.output;
    const auto written = read_json(dir + "/trained-" + model + "/config.json");
    const auto original = read_json(dir + "/" + model + "/config.json");
    EXPECT_EQ(written["architectures"], original["architectures"]);
    EXPECT_EQ(written["rope_parameters"], original["rope_parameters"]);
    EXPECT_EQ(written["tie_word_embeddings"], original["tie_word_embeddings"]);
    EXPECT_EQ(written["eos_token_id"], original["eos_token_id"]);
    for (const auto& [name, text] : tokenizer) {
      if (model != "llama") {
        EXPECT_FALSE(fs::exists(dir + "/trained-" + model + "/" + name)) << name;
        continue;
      }
      EXPECT_EQ(read_file(dir + "/trained-" + model + "/" + name), text) << name;
      EXPECT_EQ(read_file(dir + "/init-" + model + "/" + name), text) << name;
    }
    // The trained model's logits: the checkpoint loaded into a fresh model on one rank.
    const zt::LlamaConfig shape = zt::read_llama_hf_config(dir + "/" + model, "test");
    torch::manual_seed(99);
    zt::Llama trained(shape);
    auto engine_config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}})", {}, 1);
    zt::Engine engine(trained.ptr(), engine_config, zt::make_communicator(zt::RendezvousInfo{}, {}));
    engine.load_checkpoint(run + "/ckpt");
    trained->eval();
    torch::NoGradGuard no_grad;
    const torch::Tensor ids = torch::randint(0, 256, {2, 24}, torch::kLong);
    const torch::Tensor logits = trained->forward(ids).contiguous();
    const std::string reference = dir + "/reference-" + model + ".safetensors";
    zt::SafetensorsWriter writer(reference, {{"tokens", torch::kLong, ids.sizes().vec()},
                                             {"logits", torch::kFloat, logits.sizes().vec()}});
    writer.write(ids);
    writer.write(logits);
    writer.finish();
    checks.insert(checks.end(), {"logits", reference, dir + "/trained-" + model, "--"});
  }
  checks.pop_back();
  p = python(checks);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("same " + dir + "/qwen2 " + dir + "/init-qwen2"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find(dir + "/trained-llama: LlamaForCausalLM max_abs_diff"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find(dir + "/trained-qwen2: Qwen2ForCausalLM max_abs_diff"), std::string::npos) << p.output;
}

// A Llama directory of the preset's random weights, written by our own export at dir/hf (no
// transformers needed); returns the token file the runs of the test train on.
std::string export_preset_llama(const std::string& dir) {
  const std::string tokens = zt::testing::write_byte_token_file(dir);
  // Kept apart: train_config rewrites its file for each run of the test.
  const std::string preset =
      write_file(dir + "/preset.json", read_file(train_config(dir, tokens, 0, R"({"type": "llama"})", 1, "", false)));
  const auto r = run_process({cli_path(), "export", "--init", preset, "--format", "hf", "--out", dir + "/hf"}, {},
                             std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return tokens;
}

// A checkpoint of a run from model.init_from carries the directory's config.json: moved away
// after training, the directory is not needed to export (its other keys are kept; only its
// tokenizer files are missing, said in a note). A checkpoint without it (as saved before) names
// the directory that is gone. Needs no transformers: the directory is our own export.
TEST(HfLlamaExport, CheckpointCarriesTheDirectorysConfigJson) {
  const std::string dir = make_temp_dir("hf-llama-carried");
  const std::string tokens = export_preset_llama(dir);
  ASSERT_TRUE(std::filesystem::exists(dir + "/hf/config.json"));
  auto source = read_json(dir + "/hf/config.json");
  source["bos_token_id"] = 7;
  source["eos_token_id"] = 8;
  write_file(dir + "/hf/config.json", source.dump());
  write_file(dir + "/hf/tokenizer_config.json", R"({"bos_token": "<s>"})");
  const std::string run = run_dir(dir, "run");
  auto r = run_process({cli_path(), "train", train_config(run, tokens, 2, init_from(dir + "/hf"), 2, "", false), "--nproc",
                   "1", "--save-dir", run + "/ckpt"},
                  {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::rename(dir + "/hf", dir + "/moved");

  r = run_process({cli_path(), "export", run + "/ckpt", "--format", "hf", "--out", dir + "/out"}, {},
                  std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("'" + dir + "/hf' is gone"), std::string::npos) << r.output;
  const auto written = read_json(dir + "/out/config.json");
  EXPECT_EQ(written["bos_token_id"], 7);
  EXPECT_EQ(written["eos_token_id"], 8);
  EXPECT_EQ(written["hidden_size"], source["hidden_size"]);
  EXPECT_EQ(written["num_key_value_heads"], source["num_key_value_heads"]);
  EXPECT_FALSE(fs::exists(dir + "/out/tokenizer_config.json"));

  const zt::CheckpointModel checkpoint(run + "/ckpt", "");
  std::string source_dir;
  EXPECT_EQ(zt::llama_config_from_resolved(checkpoint.configuration(), "ckpt", source_dir,
                                           zt::carried_hf_config(checkpoint.scalars()))
                .num_key_value_heads,
            source["num_key_value_heads"].get<int64_t>());
  EXPECT_EQ(source_dir, dir + "/hf");
  try {
    zt::llama_config_from_resolved(checkpoint.configuration(), "ckpt", source_dir);  // carrying nothing
    ADD_FAILURE() << "no error for a directory that is gone";
  } catch (const zt::DataError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("model.init_from '" + dir + "/hf'"), std::string::npos) << message;
    EXPECT_NE(message.find("is gone"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// Bad directories and keys are one line and exit code 2 before any rank starts: another
// architecture (named, with the supported ones), a tensor of another shape (named, with both
// shapes), a missing tensor, a missing directory, a shape key beside the directory; the memory
// estimate reads the directory's shape and names a missing one. Needs no transformers: the
// directory is our own export.
TEST(HfLlamaInitFrom, BadDirectoriesAreOneLineErrorsBeforeLaunch) {
  const std::string dir = make_temp_dir("hf-llama-bad");
  const std::string tokens = export_preset_llama(dir);
  ASSERT_TRUE(std::filesystem::exists(dir + "/hf/config.json"));
  const auto good = read_json(dir + "/hf/config.json");
  EXPECT_EQ(good["architectures"][0], "LlamaForCausalLM");
  auto train_error = [&](const std::string& model) {
    return run_process({cli_path(), "train", train_config(dir, tokens, 3, model, 1, "", false), "--nproc", "2"}, {},
                       std::chrono::seconds(60));
  };
  // The directory as exported trains (the reference for what follows).
  auto ok = train_error(init_from(dir + "/hf"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;

  auto edited = good;
  edited["architectures"] = {"MistralForCausalLM"};
  write_file(dir + "/hf/config.json", edited.dump());
  expect_one_line_error(train_error(init_from(dir + "/hf")),
                        {"model.init_from '" + dir + "/hf'", "MistralForCausalLM", "LlamaForCausalLM or Qwen2ForCausalLM"});

  edited = good;
  edited["intermediate_size"] = 96;
  write_file(dir + "/hf/config.json", edited.dump());
  expect_one_line_error(train_error(init_from(dir + "/hf")),
                        {"tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128,64], expected [96,64]"});
  write_file(dir + "/hf/config.json", good.dump());

  // A file without the final norm's weight (the names of a Llama are transformers').
  fs::create_directories(dir + "/missing");
  fs::copy_file(dir + "/hf/config.json", dir + "/missing/config.json");
  torch::manual_seed(1);
  zt::Llama model(zt::llama_preset("llama-tiny"));
  std::vector<zt::HfTensor> tensors;
  for (const auto& named : model->named_parameters())
    if (named.key() != "model.norm.weight")
      tensors.push_back({named.key(), named.value().sizes().vec(), [v = named.value()] { return v.detach(); }});
  zt::write_safetensors_model(tensors, dir + "/missing/model.safetensors", torch::kFloat, {{"format", "pt"}});
  expect_one_line_error(train_error(init_from(dir + "/missing")), {"no tensor 'model.norm.weight'"});

  expect_one_line_error(train_error(init_from(dir + "/nowhere")),
                        {"model.init_from '" + dir + "/nowhere': expected a Hugging Face model directory"});
  expect_one_line_error(train_error(R"({"type": "llama", "init_from": ")" + dir + R"(/hf", "n_layer": 4})"),
                        {"model.n_layer: expected no shape beside model.init_from"});
  // The memory estimate reads the directory's shape, and names a missing directory in one line.
  auto r = run_process({cli_path(), "estimate", train_config(dir, tokens, 3, init_from(dir + "/hf"), 1, "", false)}, {},
                  std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("llama from model.init_from '" + dir + "/hf' (2 layers, 4 heads over 2 kv heads"),
            std::string::npos)
      << r.output;
  expect_one_line_error(
      run_process({cli_path(), "estimate", train_config(dir, tokens, 3, init_from(dir + "/nowhere"), 1, "", false)}, {},
                  std::chrono::seconds(60)),
      {"model.init_from '" + dir + "/nowhere'"});
}

// A preset Llama with overrides trains from the command line to the same losses at stage 0, at
// stage 3 with full recomputation, and at stage 3 with parameters and optimizer state offloaded
// to NVMe (3 steps; the tokens are random, so the losses stay near ln 256), and prints its shape.
TEST(HfLlamaTrain, PresetLossesAgreeAcrossStagesAndOffload) {
  const std::string dir = make_temp_dir("hf-llama-preset");
  const std::string tokens = zt::testing::write_byte_token_file(dir);
  const std::string model = R"({"type": "llama", "n_kv_head": 1, "intermediate_size": 96})";
  const std::string plain = run_dir(dir, "stage0");
  const auto reference = train(plain, train_config(plain, tokens, 0, model, 3));
  const std::string sharded = run_dir(dir, "stage3");
  const auto checkpointed =
      train(sharded, train_config(sharded, tokens, 3, model, 3, R"(, "activation_checkpointing": {"policy": "full"})"));
  const std::string offload = run_dir(dir, "offload");
  fs::create_directories(offload + "/swap");
  const std::string nvme = R"({"device": "nvme", "nvme_path": ")" + offload + R"(/swap"})";
  const std::string config = train_config(offload, tokens, 3, model, 3);
  auto parsed = nlohmann::json::parse(read_file(config));
  parsed["zero_optimization"]["offload_optimizer"] = nlohmann::json::parse(nvme);
  parsed["zero_optimization"]["offload_param"] = nlohmann::json::parse(nvme);
  const auto offloaded = train(offload, write_file(config, parsed.dump()));
  ASSERT_FALSE(reference.is_null());
  ASSERT_FALSE(checkpointed.is_null());
  ASSERT_FALSE(offloaded.is_null());
  EXPECT_GT(offloaded["offload"]["nvme_optimizer_bytes"].get<int64_t>(), 0) << offloaded["offload"].dump();
  EXPECT_GT(offloaded["offload"]["bytes_written"].get<int64_t>(), 0) << offloaded["offload"].dump();
  ASSERT_EQ(reference["losses"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double a = reference["losses"][i].get<double>();
    EXPECT_TRUE(std::isfinite(a));
    EXPECT_NEAR(checkpointed["losses"][i].get<double>(), a, 1e-5 * std::abs(a)) << "step " << i + 1;
    EXPECT_NEAR(offloaded["losses"][i].get<double>(), a, 1e-5 * std::abs(a)) << "step " << i + 1;
  }
  auto r = run_process({cli_path(), "train", train_config(plain, tokens, 0, model, 1), "--nproc", "1"}, {},
                       std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: llama from preset 'llama-tiny' (LlamaForCausalLM; 2 layers, 4 heads over 1 kv heads of "
                          "16, width 64, MLP 96"),
            std::string::npos)
      << r.output;
}
