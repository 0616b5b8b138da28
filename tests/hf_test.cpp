// Hugging Face GPT-2 weights in and out (src/checkpoint/hf.cpp, docs/checkpoint.md): exports that
// transformers loads with the same logits, model.init_from whose first loss is transformers' on
// the same batch at every stage, the bytes each rank reads at stage 3, config.json mismatches,
// frozen parameters kept by checkpoints and exports, and `export --init`. The transformers side
// runs with the pinned wheels of scripts/python_deps.sh; without them those tests skip, saying why.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/gpt.h"

namespace fs = std::filesystem;
using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

namespace {

zt::testing::ProcessResult python(const std::vector<std::string>& args, std::chrono::seconds timeout = std::chrono::seconds(180)) {
  return zt::testing::run_transformers_script("hf_check.py", args, timeout);
}

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}


// The tiny GPT on the token file: 2 ranks × 2 sequences of 16 tokens, no dropout.
std::string train_config(const std::string& dir, int stage, const std::string& init_from = "", int64_t steps = 1) {
  const std::string tokens = fs::exists(dir + "/tokens.bin") ? dir + "/tokens.bin" : zt::testing::write_byte_token_file(dir);
  return write_file(dir + "/config.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "zero_optimization": {"stage": )" + std::to_string(stage) + R"(},
    "model": {"preset": "tiny", "dropout": 0.0)" + (init_from.empty() ? "" : R"(, "init_from": ")" + init_from + "\"") + R"(},
    "data": {"source": "bin", "path": ")" + tokens + R"(", "val_path": ")" + tokens + R"(", "sequence_length": 16},
    "train": {"steps": )" + std::to_string(steps) + R"(, "seed": 3, "threads": 1, "log_dir": ")" + dir + R"("}})");
}

nlohmann::json train(const std::string& dir, const std::string& config, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {cli_path(), "train", config, "--nproc", "2", "--summary", dir + "/summary.json"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_process(args, {}, std::chrono::seconds(180));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return {};
  return read_json(dir + "/summary.json");
}

}  // namespace

// (a) A trained checkpoint exported with --format hf loads in transformers' GPT2LMHeadModel with
// zerotrain's logits (fp32, within 1e-5), in one file and sharded with an index.
// An export publishes all of its files or none: one that fails part-way leaves the earlier export
// in the directory as it was (and no staging directory); one that succeeds replaces the earlier
// model files and keeps the user's own files. Needs no transformers.
TEST(HfExport, AFailedExportLeavesTheEarlierOneInPlace) {
  const std::string dir = make_temp_dir("hf-atomic");
  const std::string out = dir + "/export";
  torch::manual_seed(3);
  const zt::GPTConfig config = zt::gpt_preset("tiny");
  zt::GPT model(config);
  auto tensors_failing_at = [&](std::shared_ptr<int> calls, int failing_call) {
    std::vector<zt::HfTensor> tensors;
    for (const auto& named : model->named_parameters(true)) {
      const torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value, calls, failing_call] {
                           return ++*calls == failing_call ? torch::zeros({1}) : value.detach().to(torch::kFloat);
                         }});
    }
    return tensors;
  };
  auto files_of = [](const std::string& path) {
    std::map<std::string, std::string> files;
    for (const auto& entry : fs::directory_iterator(path)) {
      std::string& content = files[entry.path().filename().string()];
      if (entry.is_directory()) continue;  // named, not read
      std::ifstream in(entry.path(), std::ios::binary);
      content.assign(std::istreambuf_iterator<char>(in), {});
    }
    return files;
  };
  zt::write_hf_model(tensors_failing_at(std::make_shared<int>(0), -1), config, out, torch::kFloat,
                     zt::hf_default_max_shard_bytes());
  std::ofstream(out + "/README.md") << "the user's own file";
  const auto before = files_of(out);
  ASSERT_TRUE(before.count("model.safetensors") && before.count("config.json"));
  // Small shards, the sixth tensor with a wrong shape: several shards are written before it fails.
  EXPECT_THROW(zt::write_hf_model(tensors_failing_at(std::make_shared<int>(0), 6), config, out, torch::kBFloat16, 20000),
               zt::DataError);
  EXPECT_EQ(files_of(out), before);
  EXPECT_EQ(files_of(dir).size(), 1u) << "a staging directory was left beside the export";
  // Success: the sharded layout replaces the single file; README.md stays.
  zt::write_hf_model(tensors_failing_at(std::make_shared<int>(0), -1), config, out, torch::kBFloat16, 20000);
  const auto after = files_of(out);
  EXPECT_FALSE(after.count("model.safetensors"));
  EXPECT_TRUE(after.count("model.safetensors.index.json"));
  EXPECT_TRUE(after.count("model-00001-of-" + std::string(5 - std::to_string(after.size() - 3).size(), '0') +
                          std::to_string(after.size() - 3) + ".safetensors"));
  EXPECT_EQ(after.at("README.md"), "the user's own file");
  EXPECT_EQ(files_of(dir).size(), 1u);
}

TEST(HfExport, TransformersLoadsItWithTheSameLogits) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-export");
  train(dir, train_config(dir, 2, "", 2), {"--save-dir", dir + "/ckpt"});
  // zerotrain's logits: the checkpoint loaded into a fresh model and engine on one rank.
  torch::manual_seed(99);
  zt::GPT model(zt::gpt_preset("tiny"));
  {
    auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}})", {}, 1);
    zt::Engine engine(model.ptr(), config, zt::make_communicator(zt::RendezvousInfo{}, {}));
    engine.load_checkpoint(dir + "/ckpt");
    model->eval();
    torch::NoGradGuard no_grad;
    torch::Tensor tokens = torch::randint(0, 256, {2, 24}, torch::kLong);
    torch::Tensor logits = model->forward(tokens);
    zt::SafetensorsWriter writer(dir + "/reference.safetensors",
                                 {{"tokens", torch::kLong, tokens.sizes().vec()}, {"logits", torch::kFloat, logits.sizes().vec()}});
    writer.write(tokens);
    writer.write(logits.contiguous());
    writer.finish();
  }
  std::vector<std::string> dirs;
  for (const std::string& shard : {"", "50KB"}) {
    const std::string out = dir + "/hf" + shard;
    std::vector<std::string> args = {cli_path(), "export", dir + "/ckpt", "--format", "hf", "--out", out};
    if (!shard.empty()) args.insert(args.end(), {"--max-shard-size", shard});
    auto r = run_process(args, {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto hf_config = read_json(out + "/config.json");
    EXPECT_EQ(hf_config["model_type"], "gpt2");
    EXPECT_EQ(hf_config["n_layer"], 2);
    EXPECT_EQ(hf_config["torch_dtype"], "float32");
    if (shard.empty()) {
      EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
      EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json"));
    } else {
      // 50 kB shards of a 0.5 MB model: an index and several files.
      ASSERT_TRUE(fs::exists(out + "/model.safetensors.index.json"));
      const auto index = read_json(out + "/model.safetensors.index.json");
      std::set<std::string> files;
      for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
      EXPECT_GT(files.size(), 3u);
      EXPECT_EQ(index["weight_map"].size(), 2u + 12u * 2u + 2u);
      EXPECT_FALSE(index["weight_map"].contains("lm_head.weight")) << "the head is tied";
      EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
    }
    dirs.push_back(out);
  }
  auto p = python({"logits", dir + "/reference.safetensors", dirs[0], dirs[1]});
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find(dirs[1] + ": max_abs_diff"), std::string::npos) << p.output;
}

// The BERT, post-LN with and without the NSP head, written as transformers' BertForPreTraining
// (BertForMaskedLM without the head), loads with zerotrain's MLM logits at every position and
// its NSP logits (fp32, within 1e-5), padding and two token types included; a pre-LN BERT and a
// foreign tensor are refused before anything is written.
TEST(HfBertExport, TransformersLoadsItWithTheSameLogits) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-bert");
  std::vector<std::string> dirs;
  for (bool nsp : {true, false}) {
    zt::BertConfig config = zt::bert_preset("bert-tiny");
    config.next_sentence = nsp;
    torch::manual_seed(nsp ? 5 : 6);
    zt::Bert model(config);
    // Non-trivial values where BERT initialises constants (LayerNorm, biases).
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.05);
    }
    model->eval();
    torch::NoGradGuard no_grad;
    const int64_t B = 3, T = 20;
    torch::Tensor input_ids = torch::randint(0, config.vocab_size, {B, T}, torch::kLong);
    torch::Tensor token_type_ids = (torch::arange(T).ge(9)).to(torch::kLong).expand({B, T}).contiguous();
    torch::Tensor attention_mask = torch::ones({B, T}, torch::kLong);
    attention_mask[1].narrow(0, 15, 5).zero_();  // padding at the end of one sequence
    const torch::Tensor hidden = model->forward(input_ids, token_type_ids, attention_mask);
    const torch::Tensor mlm = model->mlm_logits(hidden.reshape({-1, config.hidden})).reshape({B, T, -1});
    std::vector<zt::TensorRecord> records = {{"input_ids", torch::kLong, {B, T}},
                                             {"token_type_ids", torch::kLong, {B, T}},
                                             {"attention_mask", torch::kLong, {B, T}},
                                             {"mlm_logits", torch::kFloat, mlm.sizes().vec()}};
    torch::Tensor nsp_logits;
    if (nsp) {
      nsp_logits = model->nsp_logits(hidden);
      records.push_back({"nsp_logits", torch::kFloat, nsp_logits.sizes().vec()});
    }
    const std::string out = dir + (nsp ? "/pretraining" : "/masked-lm");
    {
      zt::SafetensorsWriter writer(out + ".reference.safetensors", records);
      writer.write(input_ids);
      writer.write(token_type_ids);
      writer.write(attention_mask);
      writer.write(mlm.contiguous());
      if (nsp) writer.write(nsp_logits.contiguous());
      writer.finish();
    }
    std::vector<zt::HfTensor> tensors;
    for (const auto& named : model->named_parameters(true)) {
      const torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach().to(torch::kFloat); }});
    }
    zt::write_hf_bert_model(tensors, config, out, torch::kFloat, nsp ? zt::hf_default_max_shard_bytes() : 20000);
    const auto hf_config = read_json(out + "/config.json");
    EXPECT_EQ(hf_config["model_type"], "bert");
    EXPECT_EQ(hf_config["architectures"][0], nsp ? "BertForPreTraining" : "BertForMaskedLM");
    EXPECT_EQ(hf_config["hidden_act"], "gelu");
    if (!nsp) {  // 20 kB shards: an index without the decoder (tied)
      const auto index = read_json(out + "/model.safetensors.index.json");
      EXPECT_FALSE(index["weight_map"].contains("cls.predictions.decoder.weight"));
      EXPECT_TRUE(index["weight_map"].contains("bert.encoder.layer.1.attention.self.query.weight"));
    }
    auto p = python({"bert-logits", out + ".reference.safetensors", out});
    EXPECT_EQ(p.exit_code, 0) << p.output;
    EXPECT_NE(p.output.find(out + ": mlm max_abs_diff"), std::string::npos) << p.output;
    if (nsp) EXPECT_NE(p.output.find(out + ": nsp max_abs_diff"), std::string::npos) << p.output;
  }

  zt::BertConfig pre_ln = zt::bert_preset("bert-tiny");
  pre_ln.pre_layer_norm = true;
  zt::Bert pre_ln_model(pre_ln);
  std::vector<zt::HfTensor> tensors;
  for (const auto& named : pre_ln_model->named_parameters(true)) {
    const torch::Tensor value = named.value();
    tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach(); }});
  }
  EXPECT_THROW(zt::write_hf_bert_model(tensors, pre_ln, dir + "/pre-ln", torch::kFloat, zt::hf_default_max_shard_bytes()),
               zt::ConfigError);
  EXPECT_FALSE(fs::exists(dir + "/pre-ln"));
  std::vector<zt::HfTensor> foreign = {{"lm_head.weight", {2, 2}, [] { return torch::zeros({2, 2}); }}};
  EXPECT_THROW(zt::write_hf_bert_model(foreign, zt::bert_preset("bert-tiny"), dir + "/foreign", torch::kFloat,
                                       zt::hf_default_max_shard_bytes()),
               zt::DataError);
  EXPECT_FALSE(fs::exists(dir + "/foreign"));
}

// `zerotrain export --format hf` of a BERT checkpoint (trained 2 steps on 2 ranks at stage 3)
// writes transformers' BertForPreTraining, whose logits equal those of the checkpoint loaded into
// our model; `export --init` of a BERT configuration writes one too.
TEST(HfBertExport, CheckpointsOfTrainingExportThroughTheCli) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-bert-cli");
  const std::string config = write_file(dir + "/config.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Lamb", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 3},
    "model": {"type": "bert", "preset": "bert-tiny", "next_sentence": true},
    "data": {"source": "embedded", "sequence_length": 32},
    "train": {"steps": 2, "seed": 3, "threads": 1, "log_dir": ")" + dir + R"("}})");
  auto r = run_process({cli_path(), "train", config, "--nproc", "2", "--save-dir", dir + "/ckpt"}, {},
                       std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  torch::manual_seed(99);
  zt::BertConfig bert = zt::bert_preset("bert-tiny");
  bert.next_sentence = true;
  zt::Bert model(bert);
  {
    auto engine_config =
        zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}})", {}, 1);
    zt::Engine engine(model.ptr(), engine_config, zt::make_communicator(zt::RendezvousInfo{}, {}));
    engine.load_checkpoint(dir + "/ckpt");
    model->eval();
    torch::NoGradGuard no_grad;
    const torch::Tensor input_ids = torch::randint(0, 256, {2, 24}, torch::kLong);
    const torch::Tensor token_type_ids = torch::zeros({2, 24}, torch::kLong);
    const torch::Tensor attention_mask = torch::ones({2, 24}, torch::kLong);
    const torch::Tensor hidden = model->forward(input_ids, token_type_ids, attention_mask);
    const torch::Tensor mlm = model->mlm_logits(hidden.reshape({-1, bert.hidden})).reshape({2, 24, -1});
    const torch::Tensor nsp = model->nsp_logits(hidden);
    zt::SafetensorsWriter writer(dir + "/reference.safetensors", {{"input_ids", torch::kLong, {2, 24}},
                                                                  {"token_type_ids", torch::kLong, {2, 24}},
                                                                  {"attention_mask", torch::kLong, {2, 24}},
                                                                  {"mlm_logits", torch::kFloat, mlm.sizes().vec()},
                                                                  {"nsp_logits", torch::kFloat, nsp.sizes().vec()}});
    for (const torch::Tensor& t : {input_ids, token_type_ids, attention_mask, mlm.contiguous(), nsp.contiguous()})
      writer.write(t);
    writer.finish();
  }
  r = run_process({cli_path(), "export", dir + "/ckpt", "--format", "hf", "--out", dir + "/hf"}, {},
                  std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Hugging Face BERT directory"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(dir + "/hf/config.json")["architectures"][0], "BertForPreTraining");
  auto p = python({"bert-logits", dir + "/reference.safetensors", dir + "/hf"});
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find(dir + "/hf: nsp max_abs_diff"), std::string::npos) << p.output;

  r = run_process({cli_path(), "export", "--init", config, "--format", "hf", "--out", dir + "/init"}, {},
                  std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(dir + "/init/config.json")["model_type"], "bert");
  r = run_process({cli_path(), "estimate", config}, {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the memory estimate models the GPT"), std::string::npos) << r.output;
}

// (b) + (c) A transformers-saved GPT-2 as model.init_from: zerotrain's first loss on 2 ranks at
// stages 0-3 equals transformers' loss on the same batch; fp16/bf16 files are converted; a sharded
// directory (index) is read; at stage 3 each rank reads about half of the tensor bytes (its shards),
// at stage 0 each reads them all.
TEST(HfInitFrom, FirstLossEqualsTransformersAtEveryStage) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("hf-init");
  zt::testing::write_byte_token_file(dir);
  auto p = python({"make-models", dir});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  struct Case {
    std::string source;
    int stage;
  };
  // Every stage, and each kind of file once.
  const std::vector<Case> cases = {{"fp32", 0}, {"bf16", 1}, {"fp16", 2}, {"sharded", 3}};
  std::vector<nlohmann::json> summaries;
  for (const Case& c : cases) {
    const std::string run = dir + "/run-" + c.source + "-" + std::to_string(c.stage);
    fs::create_directories(run);
    fs::copy_file(dir + "/tokens.bin", run + "/tokens.bin");
    summaries.push_back(train(run, train_config(run, c.stage, dir + "/" + c.source)));
    ASSERT_FALSE(summaries.back().is_null()) << c.source << " stage " << c.stage;
  }
  // transformers' losses, all in one process.
  p = python({"loss", dir + "/tokens.bin", "3", "16", "2", "2", dir + "/fp32", dir + "/sharded", dir + "/bf16", dir + "/fp16"});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.source + " stage " + std::to_string(c.stage));
    const std::string key = "loss " + dir + "/" + c.source + " ";
    const size_t at = p.output.find(key);
    ASSERT_NE(at, std::string::npos) << p.output;
    const double expected = std::stod(p.output.substr(at + key.size()));
    const auto& summary = summaries[i];
    const double found = summary["losses"][0].get<double>();
    EXPECT_NEAR(found, expected, 1e-5 * expected) << "zerotrain " << found << ", transformers " << expected;
    // What each rank read from the files, against the tensors' bytes.
    const auto& init = summary["init_from"];
    const double total = init["tensor_bytes"].get<double>();
    ASSERT_EQ(init["bytes_read_per_rank"].size(), 2u);
    double sum = 0;
    for (const auto& b : init["bytes_read_per_rank"]) {
      const double bytes = b.get<double>();
      sum += bytes;
      if (c.stage == 0) EXPECT_EQ(bytes, total) << "stage 0 keeps every master on every rank";
      else EXPECT_LE(bytes, 0.55 * total) << "a rank read more than its shards: " << init.dump();
    }
    if (c.stage > 0) {
      EXPECT_GE(sum, total) << init.dump();
      EXPECT_LE(sum, 1.05 * total) << init.dump();
    }
  }
}

// (d) A config.json of another shape is a configuration error naming the key and both values,
// before any rank starts; so is a directory that is not a model.
TEST(HfInitFrom, AMismatchedConfigIsAClearError) {
  const std::string dir = make_temp_dir("hf-mismatch");
  // A directory written by our own export, then its config.json edited.
  auto r = run_process({cli_path(), "export", "--init", train_config(dir, 0), "--format", "hf", "--out", dir + "/hf"}, {},
                       std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto config = read_json(dir + "/hf/config.json");
  config["n_embd"] = 128;
  write_file(dir + "/hf/config.json", config.dump());
  r = run_process({cli_path(), "train", train_config(dir, 3, dir + "/hf"), "--nproc", "2"}, {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("n_embd = 128"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.n_embd = 64"), std::string::npos) << r.output;
  r = run_process({cli_path(), "train", train_config(dir, 0, dir + "/nowhere"), "--nproc", "1"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.init_from"), std::string::npos) << r.output;
}

// `export --init`: the weights a configuration starts from. Training from them (as init_from)
// gives the first loss of training from the seed, bitwise; the safetensors form equals a GPT
// built with the configuration's seed.
TEST(HfExport, InitWritesTheWeightsTrainingStartsFrom) {
  const std::string dir = make_temp_dir("hf-init-export");
  const std::string plain = train_config(dir, 3);
  auto r = run_process({cli_path(), "export", "--init", plain, "--set", "train.seed=3", "--format", "hf", "--out", dir + "/init"},
                       {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_process({cli_path(), "export", "--init", plain, "--out", dir + "/init.safetensors"}, {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  torch::manual_seed(3);
  zt::GPT reference(zt::gpt_preset("tiny"));
  zt::SafetensorsReader file(dir + "/init.safetensors");
  for (const auto& p : reference->named_parameters())
    EXPECT_TRUE(torch::equal(file.read(p.key()), p.value())) << p.key();
  const auto from_seed = train(dir, plain);
  const std::string other = dir + "/other";
  fs::create_directories(other);
  fs::copy_file(dir + "/tokens.bin", other + "/tokens.bin");
  const auto from_export = train(other, train_config(other, 3, dir + "/init"));
  ASSERT_FALSE(from_seed.is_null());
  ASSERT_FALSE(from_export.is_null());
  EXPECT_EQ(from_seed["losses"][0].get<double>(), from_export["losses"][0].get<double>());
}

// Frozen parameters whose values did not come from the constructor are kept by checkpoints and
// exports: a model with a frozen part is rebuilt from either.
TEST(HfCheckpoint, FrozenParametersSurviveCheckpointsAndExports) {
  const std::string dir = make_temp_dir("hf-frozen");
  auto comm = zt::make_communicator(zt::RendezvousInfo{}, {});
  auto config = zt::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                     "model": {"preset": "tiny"}})",
                                 {}, 1);
  torch::Tensor frozen_values = torch::arange(64 * 64, torch::kFloat32).view({64, 64}) / 4096.0f;
  auto build = [&](int seed) {
    torch::manual_seed(seed);
    zt::GPT model(zt::gpt_preset("tiny"));
    model->wpe->weight.set_requires_grad(false);
    return model;
  };
  torch::Tensor trained_wte;
  {
    zt::GPT model = build(1);
    {
      torch::NoGradGuard no_grad;
      model->wpe->weight.copy_(frozen_values);  // not the constructor's values
    }
    zt::Engine engine(model.ptr(), config, comm);
    EXPECT_EQ(engine.trainable_parameters(), zt::gpt_parameter_count(zt::gpt_preset("tiny")) - 64 * 64);
    torch::Tensor tokens = torch::randint(0, 256, {2, 17}, torch::kLong);
    engine.backward(model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16)));
    engine.step();
    engine.save_checkpoint(dir + "/ckpt", "one");
    trained_wte = model->wte->weight.detach().clone();
    EXPECT_TRUE(torch::equal(model->wpe->weight, frozen_values)) << "a frozen parameter changed in training";
  }
  {
    zt::GPT model = build(2);
    zt::Engine engine(model.ptr(), config, comm);
    engine.load_checkpoint(dir + "/ckpt");
    EXPECT_TRUE(torch::equal(model->wpe->weight, frozen_values)) << "the checkpoint lost the frozen values";
    EXPECT_TRUE(torch::equal(model->wte->weight, trained_wte));
  }
  // Both exports hold the frozen tensor.
  zt::export_checkpoint(dir + "/ckpt", "", dir + "/model.safetensors", torch::kFloat);
  EXPECT_TRUE(torch::equal(zt::SafetensorsReader(dir + "/model.safetensors").read("wpe.weight"), frozen_values));
  auto r = run_process({cli_path(), "export", dir + "/ckpt", "--format", "hf", "--out", dir + "/hf"}, {},
                       std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    zt::GPT model = build(3);
    zt::Engine engine(model.ptr(), config, comm);
    zt::HfModelReader reader(dir + "/hf", zt::gpt_preset("tiny"));
    engine.load_weights(reader);
    EXPECT_TRUE(torch::equal(model->wpe->weight, frozen_values)) << "rebuilt from the Hugging Face export";
    EXPECT_TRUE(torch::equal(model->wte->weight, trained_wte));
    EXPECT_TRUE(torch::equal(model->blocks[0]->attn->c_attn->weight,
                             zt::SafetensorsReader(dir + "/model.safetensors").read("blocks.0.attn.c_attn.weight")));
  }
}
