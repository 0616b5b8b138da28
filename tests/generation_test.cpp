// Generation with a key/value cache (zerotrain/models/generation.h) and `zerotrain generate`: the
// cached steps choose the tokens the models' own forward() gives over the whole sequence, greedy
// generation equals transformers' generate() token for token, sampling is seeded, and bad
// requests are refused.
#include "zerotrain/models/generation.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"

namespace {

namespace fs = std::filesystem;
using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

// Greedy continuation through forward() over the whole sequence at every step (no cache).
template <typename Model>
std::vector<int64_t> greedy_without_cache(Model& model, std::vector<int64_t> ids, int64_t n) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    auto logits = model->forward(torch::tensor(ids, torch::kLong).unsqueeze(0));
    out.push_back(logits[0][-1].argmax().template item<int64_t>());
    ids.push_back(out.back());
  }
  return out;
}

zt::LlamaConfig gqa_llama(bool tied) {
  zt::LlamaConfig c = zt::llama_preset("llama-tiny");
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.tie_word_embeddings = tied;
  c.qkv_bias = !tied;
  return c;
}

TEST(Generation, CachedGreedyStepsChooseWhatTheWholeForwardChooses) {
  torch::manual_seed(3);
  const std::vector<int64_t> prompt = {5, 17, 200, 3, 99};
  zt::GPTConfig gpt_config = zt::gpt_preset("tiny");
  gpt_config.dropout = 0.0;
  zt::GPT gpt(gpt_config);
  zt::GenerationOptions options;
  options.max_new_tokens = 20;
  EXPECT_EQ(zt::generate(*gpt, prompt, options), greedy_without_cache(gpt, prompt, 20));
  for (bool tied : {false, true}) {
    zt::Llama llama(gqa_llama(tied));
    EXPECT_EQ(zt::generate(*llama, prompt, options), greedy_without_cache(llama, prompt, 20)) << "tied " << tied;
  }
}

TEST(Generation, StopsAtAStopTokenAndAtTheEndOfTheContext) {
  torch::manual_seed(4);
  zt::Llama llama(gqa_llama(false));
  const std::vector<int64_t> prompt = {1, 2, 3};
  zt::GenerationOptions options;
  options.max_new_tokens = 10;
  const auto free_run = zt::generate(*llama, prompt, options);
  ASSERT_EQ(free_run.size(), 10u);
  options.stop_ids = {free_run[4]};
  const auto stopped = zt::generate(*llama, prompt, options);
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[4]);
  EXPECT_EQ(stopped, std::vector<int64_t>(free_run.begin(), first + 1));
  // The context ends generation: max_position_embeddings positions in all.
  options.stop_ids.clear();
  options.max_new_tokens = 1000;
  const int64_t context = llama->config().max_position_embeddings;
  EXPECT_EQ(int64_t(zt::generate(*llama, prompt, options).size()), context - int64_t(prompt.size()));
  EXPECT_TRUE(llama->is_training()) << "the model's mode is restored";
}

TEST(Generation, SamplingIsSeededAndAVanishingTopPIsGreedy) {
  torch::manual_seed(5);
  zt::Llama llama(gqa_llama(true));
  const std::vector<int64_t> prompt = {10, 20, 30};
  zt::GenerationOptions options;
  options.max_new_tokens = 24;
  const auto greedy = zt::generate(*llama, prompt, options);
  options.temperature = 1.5;
  options.seed = 7;
  const auto a = zt::generate(*llama, prompt, options);
  EXPECT_EQ(zt::generate(*llama, prompt, options), a) << "same seed, same tokens";
  EXPECT_NE(a, greedy) << "sampling at temperature 1.5 over 256 ids drew the greedy tokens 24 times";
  options.seed = 8;
  EXPECT_NE(zt::generate(*llama, prompt, options), a) << "another seed drew the same 24 tokens";
  options.top_p = 1e-6;  // only the most probable token is left
  EXPECT_EQ(zt::generate(*llama, prompt, options), greedy);
}

TEST(Generation, BadRequestsAreConfigErrors) {
  zt::Llama llama(zt::llama_preset("llama-tiny"));
  zt::GenerationOptions options;
  EXPECT_THROW(zt::generate(*llama, {}, options), zt::ConfigError);
  EXPECT_THROW(zt::generate(*llama, {1, 256}, options), zt::ConfigError);
  EXPECT_THROW(zt::generate(*llama, std::vector<int64_t>(size_t(llama->config().max_position_embeddings), 1), options),
               zt::ConfigError);
  options.temperature = -1;
  EXPECT_THROW(zt::generate(*llama, {1}, options), zt::ConfigError);
  options.temperature = 1;
  options.top_p = 0;
  EXPECT_THROW(zt::generate(*llama, {1}, options), zt::ConfigError);
  options.top_p = 1;
  options.vocab_limit = 257;
  EXPECT_THROW(zt::generate(*llama, {1}, options), zt::ConfigError);
}

// A positive temperature below the smallest normal fp32 is refused before any token (the logits are
// divided by it in fp32, where it is 0 or a subnormal: inf and NaN, then a failure in sampling); the
// smallest one accepted samples the most probable token, as greedy does.
TEST(Generation, ATemperatureThatVanishesInFp32IsRefused) {
  torch::manual_seed(6);
  zt::Llama llama(gqa_llama(false));
  zt::GenerationOptions options;
  options.max_new_tokens = 8;
  const auto greedy = zt::generate(*llama, {1, 2, 3}, options);
  for (double t : {1e-39, 1e-46, 1e-300, std::numeric_limits<double>::infinity()}) {
    options.temperature = t;
    EXPECT_THROW(zt::generate(*llama, {1, 2, 3}, options), zt::ConfigError) << t;
    EXPECT_THROW(zt::check_generation_options(options), zt::ConfigError) << t;
  }
  options.temperature = zt::kMinTemperature;
  EXPECT_EQ(zt::generate(*llama, {1, 2, 3}, options), greedy);
}

// vocab_limit: ids at or above it are never chosen, greedy or sampled; below it the choice is the
// one over the whole vocabulary restricted to those ids.
TEST(Generation, AVocabularyLimitKeepsEveryChoiceBelowIt) {
  torch::manual_seed(7);
  zt::Llama llama(gqa_llama(true));
  const std::vector<int64_t> prompt = {4, 8, 15};
  zt::GenerationOptions options;
  options.max_new_tokens = 1;
  options.vocab_limit = 100;
  torch::NoGradGuard no_grad;
  llama->eval();
  const auto logits = llama->forward(torch::tensor(prompt, torch::kLong).unsqueeze(0))[0][-1];
  EXPECT_EQ(zt::generate(*llama, prompt, options).front(), logits.narrow(0, 0, 100).argmax().item<int64_t>());
  options.max_new_tokens = 64;
  options.temperature = 2.0;
  for (int64_t id : zt::generate(*llama, prompt, options)) EXPECT_LT(id, 100);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The ids after `key` on its line of `output`.
std::vector<int64_t> ids_after(const std::string& output, const std::string& key) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(key + " ", 0) != 0 && line != key) continue;
    std::istringstream words(line.substr(key.size()));
    std::vector<int64_t> ids;
    for (int64_t id; words >> id;) ids.push_back(id);
    return ids;
  }
  ADD_FAILURE() << "no line '" << key << " ...' in " << output;
  return {};
}

// transformers' own directories (a Llama with grouped-query attention and Llama 3 rope scaling,
// a Qwen2 with q/k/v biases) with a byte-level tokenizer: `zerotrain generate` chooses the tokens
// transformers' greedy generate() chooses, from the same prompt ids.
TEST(GenerateCli, GreedyEqualsTransformersGenerate) {
  REQUIRE_TRANSFORMERS();
  const std::string dir = make_temp_dir("generate-hf");
  auto made = zt::testing::run_transformers_script(
      "llama_hf_check.py", {"make", dir, "--", "tokenizer", dir + "/llama", dir + "/qwen2"});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const std::string prompt = "The quick brown fox";
  for (const std::string model : {"llama", "qwen2"}) {
    const std::string summary = dir + "/" + model + ".json";
    auto ours = run_process({cli_path(), "generate", dir + "/" + model, "--prompt", prompt, "--max-new-tokens", "12",
                             "--summary", summary});
    ASSERT_EQ(ours.exit_code, 0) << ours.output;
    const auto got = read_json(summary);
    auto theirs = zt::testing::run_transformers_script("llama_hf_check.py",
                                                       {"generate", dir + "/" + model, "12", prompt});
    ASSERT_EQ(theirs.exit_code, 0) << theirs.output;
    EXPECT_EQ(got["prompt_ids"].get<std::vector<int64_t>>(), ids_after(theirs.output, "prompt")) << model;
    EXPECT_EQ(got["new_ids"].get<std::vector<int64_t>>(), ids_after(theirs.output, "new")) << model;
    EXPECT_FALSE(got["new_ids"].empty()) << model;
  }
}

// A checkpoint of a run and its Hugging Face export continue a prompt alike; the text is bytes
// when the run trained on bytes.
TEST(GenerateCli, ACheckpointAndItsExportGenerateAlike) {
  const std::string dir = make_temp_dir("generate-ckpt");
  {
    std::ofstream(dir + "/train.json") << R"({
      "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "model": {"type": "llama", "preset": "llama-tiny"},
      "data": {"source": "embedded", "sequence_length": 32},
      "train": {"steps": 3, "seed": 3, "threads": 1, "log_dir": ")" + dir + R"("}})";
  }
  auto trained = run_process({cli_path(), "train", dir + "/train.json", "--nproc", "1", "--save-dir", dir + "/ckpt"});
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  auto exported = run_process({cli_path(), "export", dir + "/ckpt", "--format", "hf", "--out", dir + "/hf"});
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  nlohmann::json from_checkpoint, from_export;
  for (auto [source, out] : {std::pair{dir + "/ckpt", &from_checkpoint}, std::pair{dir + "/hf", &from_export}}) {
    auto r = run_process({cli_path(), "generate", source, "--prompt", "Once upon a", "--max-new-tokens", "8",
                          "--summary", dir + "/s.json"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    *out = read_json(dir + "/s.json");
  }
  const std::string prompt_bytes = "Once upon a";
  EXPECT_EQ(from_checkpoint["prompt_ids"].get<std::vector<int64_t>>(),
            std::vector<int64_t>(prompt_bytes.begin(), prompt_bytes.end()));
  EXPECT_EQ(from_checkpoint["new_ids"].size(), 8u);
  EXPECT_EQ(from_checkpoint["new_ids"], from_export["new_ids"]);
}

TEST(GenerateCli, BadSourcesExitTwoWithOneLine) {
  const std::string dir = make_temp_dir("generate-bad");
  auto one_line = [](const zt::testing::ProcessResult& r, const std::string& part) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    std::string text = r.output;
    while (!text.empty() && text.back() == '\n') text.pop_back();
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 0) << r.output;
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
  };
  one_line(run_process({cli_path(), "generate", dir + "/missing", "--prompt", "x"}), "found no directory");
  fs::create_directories(dir + "/gpt2");
  std::ofstream(dir + "/gpt2/config.json") << R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})";
  one_line(run_process({cli_path(), "generate", dir + "/gpt2", "--prompt", "x"}), "GPT2LMHeadModel");
}

}  // namespace
