// Hugging Face tokenizers (include/zerotrain/data/tokenizer.h, src/data/hf_*.cpp, docs/tokenizers.md):
// ids and decoded text equal to the Python `tokenizers` library's on thousands of mixed texts, for
// tokenizers it trains here (byte-level BPE as GPT-2's, with and without a prefix space; Llama 3's
// split regex and template; Llama 2's SentencePiece layout with and without byte fallback, and
// with a Metaspace pre-tokenizer). The pieces and the refusals: hf_tokenizer_pieces_test.cpp.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;
using zt::HfTokenizer;
using zt::TokenId;

namespace {

using zt::testing::hf_pythonpath;

// Why Python's tokenizers cannot be used here, or "" when it imports.
const std::string& tokenizers_missing() {
  static const std::string problem = [] {
    auto probe = zt::testing::run_process({"/usr/bin/env", "python3", "-c", "import tokenizers, transformers"},
                                          {{"PYTHONPATH", hf_pythonpath()}, {"PYTHONNOUSERSITE", "1"}},
                                          std::chrono::seconds(120));
    if (probe.exit_code == 0) return std::string();
    return "Python's tokenizers (with transformers " + std::string(ZT_HF_VERSION) + ") is not importable with PYTHONPATH=" +
           hf_pythonpath() + " (install it with scripts/python_deps.sh): " + probe.output.substr(0, 300);
  }();
  return problem;
}

#define REQUIRE_TOKENIZERS()                                                     \
  do {                                                                           \
    if (!tokenizers_missing().empty()) GTEST_SKIP() << tokenizers_missing();     \
  } while (0)

// The directory where the oracle trained `kind` and wrote its cases (trained once per process,
// only the kinds a test asks for).
std::string oracle_dir(const std::string& kind) {
  static std::mutex mutex;
  static std::map<std::string, std::string> dirs;
  std::lock_guard lock(mutex);
  if (auto it = dirs.find(kind); it != dirs.end()) return it->second;
  const std::string dir = zt::testing::make_temp_dir("hf_tokenizer");
  auto run = zt::testing::run_process(
      {"/usr/bin/env", "python3", std::string(ZT_SOURCE_DIR) + "/tests/support/hf_tokenizer_oracle.py", "cases", dir,
       "3000", kind},
      {{"PYTHONPATH", hf_pythonpath()}, {"PYTHONNOUSERSITE", "1"}, {"HF_HUB_OFFLINE", "1"}, {"RAYON_NUM_THREADS", "2"}},
      std::chrono::seconds(240));
  EXPECT_EQ(run.exit_code, 0) << "tests/support/hf_tokenizer_oracle.py failed for " << kind << ": " << run.output;
  return dirs[kind] = dir;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::string shown(const std::vector<TokenId>& ids) { return json(ids).dump(); }

// Every case of OUT/<kind>_cases.json through `tokenizer`: ids with and without the template,
// decoded text with and without special tokens. Reports the first few differences.
void expect_cases_match(const HfTokenizer& tokenizer, const json& cases) {
  const json& texts = cases["texts"];
  ASSERT_GE(texts.size(), 1000u);
  size_t mismatches = 0;
  auto report = [&](size_t i, const std::string& what, const std::string& expected, const std::string& found) {
    if (++mismatches <= 5)
      ADD_FAILURE() << what << " differs for text " << i << " " << json(texts[i]).dump() << "\n  tokenizers: " << expected
                    << "\n  zerotrain:  " << found;
  };
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const auto expected = cases["ids"][i].get<std::vector<TokenId>>();
    const auto ids = tokenizer.encode(text);
    if (ids != expected) report(i, "encode", shown(expected), shown(ids));
    const auto expected_special = cases["ids_with_special"][i].get<std::vector<TokenId>>();
    const auto ids_special = tokenizer.encode_with_special_tokens(text);
    if (ids_special != expected_special) report(i, "encode with special tokens", shown(expected_special), shown(ids_special));
    const std::string decoded = tokenizer.decode(expected);
    if (decoded != cases["decoded"][i]) report(i, "decode", cases["decoded"][i].dump(), json(decoded).dump());
    const std::string skipped = tokenizer.decode(expected, true);
    if (skipped != cases["decoded_skipping_special"][i])
      report(i, "decode skipping special tokens", cases["decoded_skipping_special"][i].dump(), json(skipped).dump());
  }
  EXPECT_EQ(mismatches, 0u) << "of " << texts.size() << " texts";
}

void expect_kind_matches(const std::string& kind) {
  const std::string dir = oracle_dir(kind);
  const HfTokenizer tokenizer = HfTokenizer::from_file(dir + "/" + kind + ".json");
  expect_cases_match(tokenizer, read_json(dir + "/" + kind + "_cases.json"));
}

}  // namespace

TEST(HfTokenizerOracle, ByteLevelBpeAsGpt2MatchesTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("bytelevel");
}

TEST(HfTokenizerOracle, ByteLevelBpeWithPrefixSpaceMatchesTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("bytelevel_prefix");
}

TEST(HfTokenizerOracle, Llama3SplitRegexAndTemplateMatchTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("llama3");
}

TEST(HfTokenizerOracle, SentencePieceBpeWithByteFallbackMatchesTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("sentencepiece");
}

TEST(HfTokenizerOracle, SentencePieceBpeWithFusedUnknownsMatchesTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("sentencepiece_unk");
}

// The later SentencePiece layout (Mistral's): a Metaspace pre-tokenizer that prepends "▁" to the
// text's first stretch only (not after a special token), and the Metaspace decoder.
TEST(HfTokenizerOracle, MetaspacePreTokenizerAndDecoderMatchTokenizers) {
  REQUIRE_TOKENIZERS();
  expect_kind_matches("metaspace");
}

// tokenizer.json files written before tokenizers 0.20 spell merges as "left right" strings.
TEST(HfTokenizerOracle, MergesWrittenAsStringsGiveTheSameIds) {
  REQUIRE_TOKENIZERS();
  for (const std::string kind : {"bytelevel", "sentencepiece"}) {
    const std::string dir = oracle_dir(kind);
    json spec = read_json(dir + "/" + kind + ".json");
    ASSERT_TRUE(spec["model"]["merges"][0].is_array()) << "the oracle writes pairs";
    json legacy = json::array({"#version: 0.2"});
    for (const json& merge : spec["model"]["merges"])
      legacy.push_back(merge[0].get<std::string>() + " " + merge[1].get<std::string>());
    spec["model"]["merges"] = legacy;
    const HfTokenizer tokenizer = HfTokenizer::from_json(spec.dump(), kind + " with string merges");
    expect_cases_match(tokenizer, read_json(dir + "/" + kind + "_cases.json"));
  }
}

// encode() is const and shares a locked word cache: threads on one tokenizer agree with Python.
TEST(HfTokenizerOracle, ThreadsEncodingAtOnceGetTheSameIds) {
  REQUIRE_TOKENIZERS();
  const std::string dir = oracle_dir("llama3");
  const HfTokenizer tokenizer = HfTokenizer::from_file(dir + "/llama3.json");
  const json cases = read_json(dir + "/llama3_cases.json");
  std::vector<size_t> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); ++t)
    threads.emplace_back([&, t] {
      for (size_t i = t; i < cases["texts"].size(); i += 2)  // overlapping halves
        if (tokenizer.encode(cases["texts"][i].get<std::string>()) != cases["ids"][i].get<std::vector<TokenId>>())
          ++mismatches[t];
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<size_t>(4, 0));
}

// A run of whitespace past PCRE2's first match limit (Llama 3's split pattern takes a step of it
// per byte of a run), which the matcher retries with a larger limit: the ids are the Rust
// library's. (A run of 10 million stops the Rust library itself: its Oniguruma gives up.)
TEST(HfTokenizerOracle, LongWhitespaceRunsMatchTokenizers) {
  REQUIRE_TOKENIZERS();
  const std::string dir = oracle_dir("llama3");
  const std::string text = "start" + std::string(1'100'000, ' ') + "word\t\u3000 \n\n x";
  const std::string text_file = dir + "/long_whitespace.txt", ids_file = dir + "/long_whitespace_ids.json";
  std::ofstream(text_file, std::ios::binary) << text;
  auto run = zt::testing::run_process(
      {"/usr/bin/env", "python3", std::string(ZT_SOURCE_DIR) + "/tests/support/hf_tokenizer_oracle.py", "encode",
       dir + "/llama3.json", text_file, ids_file},
      {{"PYTHONPATH", hf_pythonpath()}, {"PYTHONNOUSERSITE", "1"}, {"HF_HUB_OFFLINE", "1"}, {"RAYON_NUM_THREADS", "2"}},
      std::chrono::seconds(240));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::vector<TokenId> expected;
  const json runs = read_json(ids_file)["runs"];
  for (const json& r : runs) expected.insert(expected.end(), r[1].get<size_t>(), r[0].get<TokenId>());
  const std::vector<TokenId> ids = HfTokenizer::from_file(dir + "/llama3.json").encode(text);
  EXPECT_EQ(ids.size(), expected.size());
  EXPECT_TRUE(ids == expected) << "the ids differ from the tokenizers library's";
}
