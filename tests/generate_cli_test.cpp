// `zerotrain generate` facing bad or awkward input: a tokenizer the checkpoint names that has moved,
// a model vocabulary padded past its tokenizer's or smaller than it, a temperature that is 0 in
// fp32, a --summary path that cannot be written, new bytes that are not UTF-8, a tensor missing
// from a model directory, a checkpoint's saved shape beyond the bounds. The models are the tiny
// Llama's random weights, written by our own `export --init` (no transformers needed).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/hf.h"
#include "data/hf_bpe.h"
#include "support/process.h"
#include "zerotrain/error.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::ProcessResult;
using zt::testing::run_process;

std::string write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The tiny Llama with `vocab` ids and random weights as a Hugging Face directory at `out`.
void export_llama(const std::string& dir, const std::string& out, int64_t vocab) {
  const std::string config = write_file(dir + "/export.json", R"({"train_micro_batch_size_per_gpu": 1,
      "model": {"type": "llama", "preset": "llama-tiny"}, "train": {"seed": 5}})");
  const auto r = run_process({cli_path(), "export", "--init", config, "--set", "model.vocab_size=" + std::to_string(vocab),
                              "--format", "hf", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

// A byte-level BPE tokenizer.json (GPT-2's kind): ids 0-255 the bytes, then special tokens at
// `special_ids`; its vocabulary is one more than the largest id.
void write_tokenizer(const fs::path& dir, const std::vector<int64_t>& special_ids) {
  const auto& map = zt::hf::ByteUnicodeMap::instance();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[std::string(map.utf8_of(uint8_t(b)))] = b;
  json added = json::array();
  for (size_t i = 0; i < special_ids.size(); ++i) {
    const std::string name = "<|special" + std::to_string(i) + "|>";
    vocab[name] = special_ids[i];
    added.push_back({{"id", special_ids[i]}, {"content", name}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  const json tokenizer = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", json::array()}}}};
  write_file(dir / "tokenizer.json", tokenizer.dump());
}

// One line on stderr (and nothing else on either stream), exit code 2, holding every part.
void expect_one_line_error(const ProcessResult& r, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::string text = r.output;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 0) << r.output;
  for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
}

ProcessResult generate(const std::string& source, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {cli_path(), "generate", source, "--prompt", "Once upon a"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_process(args, {}, std::chrono::seconds(60));
}

std::vector<int64_t> new_ids(const std::string& summary) {
  return json::parse(read_file(summary))["new_ids"].get<std::vector<int64_t>>();
}

bool valid_utf8(const std::string& text) {
  try {
    (void)json(text).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

// A checkpoint names the tokenizer it generates with: its run's data.tokenizer, else the directory
// it started from. Moved away, that is a one-line error (it was bytes, exit 0, garbage text).
TEST(GenerateCli, ANamedTokenizerThatIsGoneIsAnError) {
  const std::string dir = make_temp_dir("generate-tokenizer-gone");
  export_llama(dir, dir + "/hf", 512);
  write_tokenizer(dir + "/tok", {256, 257});
  write_file(dir + "/text.txt", std::string(2000, 'a') + "the cat sat on the mat\n");
  auto train = [&](const std::string& name, const std::string& model, const std::string& data) {
    const std::string config = write_file(dir + "/" + name + ".json", R"({
      "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
      "model": )" + model + R"(, "data": )" + data + R"(,
      "train": {"steps": 1, "seed": 3, "threads": 1, "log_dir": ")" + dir + "/" + name + R"("}})");
    const auto r = run_process({cli_path(), "train", config, "--nproc", "1", "--save-dir", dir + "/" + name + "/ckpt"},
                               {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  };
  // data.tokenizer: the run's text went through it.
  train("text-run", R"({"type": "llama", "preset": "llama-tiny", "vocab_size": 512})",
        R"({"source": "text", "path": ")" + dir + R"(/text.txt", "tokenizer": ")" + dir + R"(/tok", "sequence_length": 16})");
  EXPECT_EQ(generate(dir + "/text-run/ckpt", {"--max-new-tokens", "2"}).exit_code, 0);
  fs::rename(dir + "/tok", dir + "/tok-moved");
  expect_one_line_error(generate(dir + "/text-run/ckpt", {"--max-new-tokens", "2"}),
                        {"data.tokenizer", dir + "/tok", "--tokenizer"});
  // Given again, it is used.
  EXPECT_EQ(generate(dir + "/text-run/ckpt", {"--max-new-tokens", "2", "--tokenizer", dir + "/tok-moved"}).exit_code, 0);

  // model.init_from: the tokenizer beside the weights the run started from.
  fs::copy_file(dir + "/tok-moved/tokenizer.json", dir + "/hf/tokenizer.json");
  train("init-run", R"({"type": "llama", "init_from": ")" + dir + R"(/hf"})", R"({"source": "embedded", "sequence_length": 16})");
  EXPECT_EQ(generate(dir + "/init-run/ckpt", {"--max-new-tokens", "2"}).exit_code, 0);
  fs::rename(dir + "/hf", dir + "/hf-moved");
  expect_one_line_error(generate(dir + "/init-run/ckpt", {"--max-new-tokens", "2"}),
                        {"model.init_from '" + dir + "/hf'", "--tokenizer"});
}

// A vocabulary padded past the tokenizer's: ids the tokenizer cannot decode are never chosen (they
// were: with bytes as U+FFFD, with a tokenizer.json an error mid-stream). A tokenizer larger than
// the model's vocabulary is refused before generating.
TEST(GenerateCli, OnlyIdsTheTokenizerDecodesAreChosen) {
  const std::string dir = make_temp_dir("generate-padded");
  export_llama(dir, dir + "/hf", 512);
  const std::vector<std::string> sampled = {"--temperature", "1", "--seed", "1", "--max-new-tokens", "48",
                                            "--summary", dir + "/s.json"};
  auto r = generate(dir + "/hf", sampled);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ids 256 and above are never chosen"), std::string::npos) << r.output;
  auto ids = new_ids(dir + "/s.json");
  ASSERT_EQ(ids.size(), 48u);
  EXPECT_LT(*std::max_element(ids.begin(), ids.end()), 256);

  write_tokenizer(dir + "/hf", {256, 257, 258});
  r = generate(dir + "/hf", sampled);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ids = new_ids(dir + "/s.json");
  EXPECT_LT(*std::max_element(ids.begin(), ids.end()), 259);

  write_tokenizer(dir + "/hf", {256, 600});
  expect_one_line_error(generate(dir + "/hf", sampled), {"601 ids", "the model's vocabulary 512", "--tokenizer"});
}

// A positive temperature below the smallest normal fp32 is 0 or imprecise where the logits are
// divided by it: refused before the model is read (it failed with exit 1 after loading). The
// smallest accepted one samples the most probable token every time.
TEST(GenerateCli, ATemperatureThatVanishesInFp32IsRefused) {
  const std::string dir = make_temp_dir("generate-temperature");
  export_llama(dir, dir + "/hf", 256);
  for (const std::string t : {"1e-39", "1e-46"})
    expect_one_line_error(generate(dir + "/hf", {"--temperature", t}), {"temperature", "1.17549e-38"});
  auto r = generate(dir + "/hf", {"--max-new-tokens", "12", "--summary", dir + "/greedy.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = generate(dir + "/hf", {"--max-new-tokens", "12", "--temperature", "1.2e-38", "--summary", dir + "/cold.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(new_ids(dir + "/cold.json"), new_ids(dir + "/greedy.json"));
}

// --summary is checked before the model is read, missing directories are made, and the file is
// replaced whole: new bytes that are not UTF-8 (a byte model stopping inside a character) are kept
// in text_bytes instead of failing the JSON writer after the file was opened.
TEST(GenerateCli, TheSummaryIsCheckedFirstAndWrittenWholeAndLossless) {
  const std::string dir = make_temp_dir("generate-summary");
  export_llama(dir, dir + "/hf", 256);
  expect_one_line_error(generate(dir + "/hf", {"--summary", "/proc/zerotrain-summary.json"}), {"--summary", "/proc"});
  expect_one_line_error(generate(dir + "/hf", {"--summary", dir}), {"--summary", "directory"});
  write_file(dir + "/file", "x");
  expect_one_line_error(generate(dir + "/hf", {"--summary", dir + "/file/s.json"}), {"--summary"});
  auto r = generate(dir + "/hf", {"--max-new-tokens", "2", "--summary", dir + "/new/sub/s.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(new_ids(dir + "/new/sub/s.json").size(), 2u);

  const std::string summary = write_file(dir + "/bytes.json", R"({"earlier": true})");
  r = generate(dir + "/hf", {"--temperature", "1", "--seed", "3", "--max-new-tokens", "48", "--summary", summary});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json got = json::parse(read_file(summary));
  const auto ids = got["new_ids"].get<std::vector<int64_t>>();
  const std::string bytes(ids.begin(), ids.end());
  ASSERT_FALSE(valid_utf8(bytes)) << "the sampled bytes happen to be UTF-8: choose another --seed";
  ASSERT_TRUE(got.contains("text_bytes")) << got.dump();
  EXPECT_EQ(got["text_bytes"].get<std::vector<int64_t>>(), ids);
  EXPECT_TRUE(valid_utf8(got["text"].get<std::string>()));
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
}

// A tensor missing from a model directory given to generate names that directory, its file and
// the tensor (it named model.init_from, a key the user never set).
TEST(GenerateCli, AMissingTensorNamesTheDirectoryAndTheFile) {
  const std::string dir = make_temp_dir("generate-missing-tensor");
  export_llama(dir, dir + "/hf", 256);
  json config = json::parse(read_file(dir + "/hf/config.json"));
  config["num_hidden_layers"] = 3;
  write_file(dir + "/hf/config.json", config.dump());
  const auto r = generate(dir + "/hf", {});
  expect_one_line_error(r, {"generate SOURCE '" + dir + "/hf'", "no tensor 'model.layers.2.", "model.safetensors"});
  EXPECT_EQ(r.output.find("model.init_from"), std::string::npos) << r.output;
}

// The shape a checkpoint saved (its resolved model.* keys) is untrusted: a GPT's or a Llama's
// beyond the bounds of the configuration's keys is refused before generate or export builds a model
// of it.
TEST(GenerateCheckpoint, ASavedShapeBeyondTheBoundsIsRefused) {
  std::map<std::string, std::string> gpt = {{"model.preset", "\"tiny\""}, {"model.n_layer", "1099511627776"}};
  try {
    zt::gpt_config_from_resolved(gpt, "'ckpt'");
    ADD_FAILURE() << "2^40 layers accepted";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layer: expected at most 65536, found 1099511627776"), std::string::npos)
        << e.what();
  }
  gpt["model.n_layer"] = "65536";
  gpt["model.vocab_size"] = "4611686018427387905";
  EXPECT_THROW(zt::gpt_config_from_resolved(gpt, "'ckpt'"), zt::DataError);
  gpt["model.vocab_size"] = "300";
  EXPECT_EQ(zt::gpt_config_from_resolved(gpt, "'ckpt'").n_layer, 65536);

  std::map<std::string, std::string> llama = {
      {"model.init_from", "\"\""}, {"model.config_from", "\"\""}, {"model.preset", "\"llama-tiny\""},
      {"model.n_layer", "1099511627776"}, {"model.n_head", "0"}, {"model.n_kv_head", "0"}, {"model.n_embd", "0"},
      {"model.intermediate_size", "0"}, {"model.vocab_size", "0"}, {"model.context_length", "0"}};
  std::string source_dir;
  try {
    zt::llama_config_from_resolved(llama, "'ckpt'", source_dir);
    ADD_FAILURE() << "2^40 layers accepted";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layer (num_hidden_layers): expected at most 65536"), std::string::npos) << e.what();
  }
}

}  // namespace
