// Training data through a tokenizer (include/zerotrain/data/tokenized_data.h): the token cache (miss,
// hit, stale, atomic, damaged), uint32 ids for large vocabularies, jsonl documents, fine-tuning
// examples and their mapped cache (read by example), with the loss on the responses only (equal to transformers' loss with labels -100 on the
// prompts), packed examples for the GPT and the Llama (the loss of each example alone; the
// Llama's also against transformers on each example), and the CLI's one-line refusals before
// launch.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <sys/stat.h>

#include "checkpoint/hf.h"
#include "data/hf_bpe.h"
#include "data/token_cache.h"
#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/error.h"
#include "models/packed_rows.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/data/tokenized_data.h"

namespace fs = std::filesystem;
using nlohmann::json;
using zt::TokenId;
using zt::testing::cli_path;
using zt::testing::make_temp_dir;
using zt::testing::run_process;

namespace {

// A byte-level BPE tokenizer.json as GPT-2's: ids 0-255 are the bytes, a few merges, and added
// special tokens at `special_ids` (<|endoftext|>, <|im_start|>, <|im_end|>).
json byte_level_tokenizer(const std::vector<int64_t>& special_ids = {259, 260, 261}) {
  const auto& map = zt::hf::ByteUnicodeMap::instance();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[map.utf8_of(uint8_t(b))] = b;
  vocab["he"] = 256;
  vocab["\u0120t"] = 257;
  vocab["\u0120the"] = 258;
  const std::vector<std::string> names = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  json added = json::array();
  for (size_t i = 0; i < names.size(); ++i) {
    vocab[names[i]] = special_ids[i];
    added.push_back({{"id", special_ids[i]}, {"content", names[i]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
            {"vocab", vocab}, {"merges", json::array({"h e", "\u0120 t", "\u0120t he"})}}}};
}

std::string write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

std::string write_tokenizer(const fs::path& dir, const json& tokenizer) {
  write_file(dir / "tokenizer.json", tokenizer.dump());
  return dir.string();
}

const std::string kText =
    "the cat sat on the mat.\nThe other cat\n\n  watched the hat\nthen  the end\n   indented line\nlast";

template <typename Fn>
std::string data_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const zt::DataError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a zt::DataError";
  return "";
}

std::vector<uint32_t> ids_of(const zt::TokenDataset& d) {
  std::vector<uint32_t> out;
  for (int64_t i = 0; i < d.size(); ++i) out.push_back(d[i]);
  return out;
}

// The examples as a transformers user holds them: ids and labels (-100 off the response).
json hf_examples_of(const zt::FinetuneExamples& examples) {
  json out = json::array();
  for (int64_t i = 0; i < examples.count(); ++i) {
    json ids = json::array(), labels = json::array();
    for (int64_t k = examples.starts[size_t(i)]; k < examples.starts[size_t(i) + 1]; ++k) {
      ids.push_back(examples.tokens[size_t(k)]);
      labels.push_back(examples.trained[size_t(k)] ? int64_t(examples.tokens[size_t(k)]) : -100);
    }
    out.push_back({{"input_ids", ids}, {"labels", labels}});
  }
  return out;
}

}  // namespace

// A miss tokenizes and writes the cache, a hit reads it back unchanged, a changed corpus makes it
// stale (rebuilt), another tokenizer has its own cache file; no temporary file is left.
TEST(TokenizedCorpus, CacheMissHitStaleAndPerTokenizer) {
  const fs::path dir = make_temp_dir("tokenized");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const fs::path corpus = write_file(dir / "corpus.txt", kText);
  zt::TokenizeOptions options;
  options.cache_dir = dir / "cache";
  const auto first = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options);
  EXPECT_TRUE(first.built);
  EXPECT_EQ(first.cache_file.parent_path(), dir / "cache");
  EXPECT_TRUE(fs::exists(first.cache_file));
  const auto tokenizer = zt::HfTokenizer::from_file(tok);
  EXPECT_EQ(ids_of(first.tokens), tokenizer.encode(kText));
  EXPECT_EQ(first.tokens.width(), zt::TokenWidth::U16);

  const auto second = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options);
  EXPECT_FALSE(second.built);
  EXPECT_EQ(second.cache_file, first.cache_file);
  EXPECT_EQ(ids_of(second.tokens), ids_of(first.tokens));
  // The cache is an ordinary llm.c file.
  EXPECT_EQ(ids_of(zt::TokenDataset::from_bin_file(first.cache_file)), ids_of(first.tokens));

  // A changed corpus (size and time) makes the cache stale.
  write_file(corpus, kText + " more");
  const auto third = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options);
  EXPECT_TRUE(third.built);
  EXPECT_EQ(third.cache_file, first.cache_file);
  EXPECT_EQ(ids_of(third.tokens), tokenizer.encode(kText + " more"));
  // The same size, another modification time: stale too.
  write_file(corpus, kText + " mare");
  fs::last_write_time(corpus, fs::last_write_time(corpus) + std::chrono::seconds(5));
  const auto fourth = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options);
  EXPECT_TRUE(fourth.built);
  EXPECT_EQ(ids_of(fourth.tokens), tokenizer.encode(kText + " mare"));

  // Another tokenizer file (one more merge): its own cache, beside the corpus without cache_dir.
  json other = byte_level_tokenizer();
  other["model"]["vocab"]["at"] = 262;
  other["model"]["merges"].push_back("a t");
  const std::string tok2 = write_tokenizer(dir / "tok2", other);
  const auto beside = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok2, {});
  EXPECT_TRUE(beside.built);
  EXPECT_EQ(beside.cache_file.parent_path(), corpus.parent_path());
  EXPECT_NE(beside.cache_file.filename(), first.cache_file.filename());
  EXPECT_EQ(ids_of(beside.tokens), zt::HfTokenizer::from_file(tok2).encode(kText + " mare"));
  EXPECT_FALSE(zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options).built);

  for (const fs::path& d : {dir / "cache", dir})
    for (const auto& entry : fs::directory_iterator(d))
      EXPECT_EQ(entry.path().string().find(".tmp-"), std::string::npos) << entry.path();
}

// A cache whose tokens do not match its checksum is rebuilt, not trusted: truncated (which the
// token file's reader would refuse) or with an id changed to another id of the vocabulary (which
// it would use silently).
TEST(TokenizedCorpus, DamagedCacheIsRebuiltFromTheCorpus) {
  const fs::path dir = make_temp_dir("tokenized");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const fs::path corpus = write_file(dir / "corpus.txt", kText);
  const std::vector<TokenId> expected = zt::HfTokenizer::from_file(tok).encode(kText);
  const auto first = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, {});
  ASSERT_TRUE(first.built);
  const auto size = fs::file_size(first.cache_file);

  fs::resize_file(first.cache_file, size - 3);
  const auto truncated = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, {});
  EXPECT_TRUE(truncated.built);
  EXPECT_EQ(ids_of(truncated.tokens), expected);
  EXPECT_EQ(fs::file_size(first.cache_file), size);

  {  // the first token becomes 'z' (122): inside the vocabulary, same size, same header
    std::fstream patch(first.cache_file, std::ios::binary | std::ios::in | std::ios::out);
    patch.seekp(1024);
    const uint16_t z = 122;
    patch.write(reinterpret_cast<const char*>(&z), sizeof z);
  }
  ASSERT_EQ(zt::TokenDataset::from_bin_file(first.cache_file)[0], 122u);
  const auto altered = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, {});
  EXPECT_TRUE(altered.built);
  EXPECT_EQ(ids_of(altered.tokens), expected);
  EXPECT_FALSE(zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, {}).built);
}

// An invalid byte in a text corpus encoded in pieces is reported with data.path and its offset in
// the file (not in the piece), without the raw byte in the message.
TEST(TokenizedCorpus, InvalidUtf8NamesTheDataPathAndTheOffsetInTheFile) {
  const fs::path dir = make_temp_dir("tokenized");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  std::string text;
  for (int i = 0; i < 20; ++i) text += "line " + std::to_string(i) + ".\nNext";
  const size_t bad_at = text.size() + 3;
  text += "ok \xff\xfe end.\nLast";
  const fs::path corpus = write_file(dir / "bad.txt", text);
  zt::TokenizeOptions options;
  options.text_piece_bytes = 16;
  const std::string message =
      data_error_of([&] { zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options); });
  EXPECT_NE(message.find("data.path '" + corpus.string() + "'"), std::string::npos) << message;
  EXPECT_NE(message.find("offset " + std::to_string(bad_at) + " of the file"), std::string::npos) << message;
  EXPECT_NE(message.find("0xff"), std::string::npos) << message;
  EXPECT_EQ(message.find('\xff'), std::string::npos) << "the raw byte is escaped";
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 0) << message;
}

// data.tokenizer is read as a tokenizer.json is everywhere: a FIFO (which would wait for a writer
// forever) or a device (/dev/zero, endless) is refused unread, for text corpora and fine-tuning
// examples alike.
TEST(TokenizedCorpus, TokenizerThatIsNotARegularFileIsRefusedUnread) {
  const fs::path dir = make_temp_dir("tokenized");
  const fs::path corpus = write_file(dir / "corpus.txt", kText);
  const fs::path examples = write_file(dir / "chat.jsonl", R"({"prompt": "a", "response": "b"})" "\n");
  const fs::path fifo = dir / "tokenizer.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const fs::path& tokenizer : {fifo, fs::path("/dev/zero")}) {
    SCOPED_TRACE(tokenizer.string());
    const std::string text_error =
        data_error_of([&] { zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tokenizer, {}); });
    EXPECT_NE(text_error.find("data.tokenizer"), std::string::npos) << text_error;
    EXPECT_NE(text_error.find("not a regular file"), std::string::npos) << text_error;
    const std::string finetune_error =
        data_error_of([&] { zt::load_finetune_cache(examples, tokenizer, "chatml", {}); });
    EXPECT_NE(finetune_error.find("not a regular file"), std::string::npos) << finetune_error;
  }
}

// Cutting a text into pieces after lone newlines gives the ids of the whole text, blank lines,
// indentation and non-ASCII spaces around newlines included (with a merge of "\n\n", which a cut
// inside a run of newlines would change).
TEST(TokenizedCorpus, TextPiecesGiveTheIdsOfTheWholeText) {
  const fs::path dir = make_temp_dir("tokenized");
  json with_newlines = byte_level_tokenizer();
  const std::string nl(zt::hf::ByteUnicodeMap::instance().utf8_of('\n'));
  with_newlines["model"]["vocab"][nl + nl] = 262;
  with_newlines["model"]["merges"].push_back(nl + " " + nl);
  const std::string tok = write_tokenizer(dir / "tok", with_newlines);
  const std::vector<std::string> lines = {"the hat\n", "  then\n\n", "x.\n", "\u00a0y\n", "z\u3000\n", "\n\n\n"};
  std::string text;
  for (int i = 0; i < 60; ++i) text += lines[size_t(i) % lines.size()] + std::to_string(i) + (i % 4 ? " " : "");
  const fs::path corpus = write_file(dir / "c.txt", text);
  zt::TokenizeOptions options;
  options.text_piece_bytes = 7;
  const auto pieces = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Text, tok, options);
  const auto whole = zt::HfTokenizer::from_file(tok).encode(text);
  EXPECT_EQ(ids_of(pieces.tokens), whole);
  EXPECT_NE(std::find(whole.begin(), whole.end(), 262u), whole.end()) << "the text has the merged \\n\\n";
}

// jsonl: every document with the template's tokens, then the end-of-document token; a bad line
// and an unknown end token name the file and the line.
TEST(TokenizedCorpus, JsonlDocumentsEndWithTheEosToken) {
  const fs::path dir = make_temp_dir("tokenized");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const fs::path corpus =
      write_file(dir / "docs.jsonl", "{\"text\": \"the cat\", \"id\": 1}\n\n{\"text\": \"then <|im_end|> he\"}\n");
  zt::TokenizeOptions options;
  options.eos_token = "<|endoftext|>";
  const auto loaded = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Jsonl, tok, options);
  const auto tokenizer = zt::HfTokenizer::from_file(tok);
  std::vector<TokenId> expected = tokenizer.encode_with_special_tokens("the cat");
  expected.push_back(259);
  for (TokenId id : tokenizer.encode_with_special_tokens("then <|im_end|> he")) expected.push_back(id);
  expected.push_back(259);
  EXPECT_EQ(ids_of(loaded.tokens), expected);
  EXPECT_NE(std::find(expected.begin(), expected.end(), 261u), expected.end()) << "special tokens in text match";
  // Another end token is another cache key.
  options.eos_token = "<|im_end|>";
  EXPECT_TRUE(zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Jsonl, tok, options).built);
  options.eos_token = "<eos>";
  auto message = data_error_of([&] { zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Jsonl, tok, options); });
  EXPECT_NE(message.find("data.eos_token"), std::string::npos) << message;
  EXPECT_NE(message.find("<eos>"), std::string::npos) << message;

  const fs::path bad = write_file(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n");
  message = data_error_of([&] { zt::load_tokenized_corpus(bad, zt::CorpusFormat::Jsonl, tok, {}); });
  EXPECT_NE(message.find(bad.string() + ":2"), std::string::npos) << message;
  EXPECT_NE(message.find("\"text\""), std::string::npos) << message;
  const fs::path not_json = write_file(dir / "nj.jsonl", "{\"text\": \"ok\"}\nplain words\n");
  message = data_error_of([&] { zt::load_tokenized_corpus(not_json, zt::CorpusFormat::Jsonl, tok, {}); });
  EXPECT_NE(message.find(not_json.string() + ":2"), std::string::npos) << message;
}

// A vocabulary past 65,535 ids: the cache is llm.c version 2 and the ids come back as uint32.
TEST(TokenizedCorpus, LargeVocabulariesRoundTripAsUint32) {
  const fs::path dir = make_temp_dir("tokenized");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer({70000, 128000, 128255}));
  const fs::path corpus = write_file(dir / "docs.jsonl", "{\"text\": \"<|im_start|>the hat<|im_end|>\"}\n");
  zt::TokenizeOptions options;
  options.eos_token = "<|endoftext|>";
  const auto loaded = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Jsonl, tok, options);
  ASSERT_EQ(loaded.tokens.width(), zt::TokenWidth::U32);
  const std::vector<uint32_t> ids = ids_of(loaded.tokens);
  EXPECT_EQ(ids.front(), 128000u);
  EXPECT_EQ(ids.back(), 70000u);
  EXPECT_EQ(ids[ids.size() - 2], 128255u);
  std::ifstream in(loaded.cache_file, std::ios::binary);
  int32_t header[3] = {};
  in.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 2);
  EXPECT_EQ(header[2], int32_t(ids.size()));
  const auto again = zt::load_tokenized_corpus(corpus, zt::CorpusFormat::Jsonl, tok, options);
  EXPECT_FALSE(again.built);
  EXPECT_EQ(ids_of(again.tokens), ids);
  auto message = data_error_of([&] { again.tokens.validate(100000); });
  EXPECT_NE(message.find("128000"), std::string::npos) << message;
  EXPECT_NE(message.find("< 100000"), std::string::npos) << message;
}

// Prompt/response pairs and ChatML messages: which tokens are trained, and the sampler's targets.
TEST(FinetuneExamples, TrainsOnTheResponsesOnly) {
  const fs::path dir = make_temp_dir("finetune");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const auto tokenizer = zt::HfTokenizer::from_file(tok);
  const fs::path file = write_file(dir / "ft.jsonl",
                                   "{\"prompt\": \"Q: the cat?\\nA:\", \"response\": \" the hat\"}\n"
                                   "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, {\"role\": "
                                   "\"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"then\"}]}\n");
  const auto examples = zt::load_finetune_examples(file, tokenizer, "auto", 259);
  ASSERT_EQ(examples.count(), 2);
  // Pair: prompt untrained, response and <|endoftext|> trained.
  std::vector<uint32_t> pair = tokenizer.encode_with_special_tokens("Q: the cat?\nA:");
  const size_t prompt = pair.size();
  for (TokenId id : tokenizer.encode(" the hat")) pair.push_back(id);
  pair.push_back(259);
  ASSERT_EQ(examples.starts[1], int64_t(pair.size()));
  EXPECT_TRUE(std::equal(pair.begin(), pair.end(), examples.tokens.begin()));
  for (size_t k = 0; k < pair.size(); ++k) EXPECT_EQ(examples.trained[k], k >= prompt ? 1 : 0) << k;
  // Chat: exactly "then" and its <|im_end|> are trained.
  std::vector<uint32_t> trained_ids;
  for (int64_t k = examples.starts[1]; k < examples.starts[2]; ++k)
    if (examples.trained[size_t(k)]) trained_ids.push_back(examples.tokens[size_t(k)]);
  std::vector<uint32_t> expected = tokenizer.encode("then");
  expected.push_back(261);
  EXPECT_EQ(trained_ids, expected);
  EXPECT_EQ(tokenizer.decode(std::vector<TokenId>(examples.tokens.begin() + examples.starts[1], examples.tokens.end())),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nthen"
            "<|im_end|>\n");

  // The sampler: inputs are the example, padded with 0; targets the trained next tokens, else -100.
  zt::FinetuneSampler sampler(examples, 40, 2, 1, 0, 3);
  const zt::Batch batch = sampler.eval_batch(0);
  for (int64_t row = 0; row < 2; ++row) {
    const int64_t b = examples.starts[size_t(row)], n = examples.starts[size_t(row) + 1] - b;
    for (int64_t t = 0; t < 40; ++t) {
      const int64_t in = t < n ? examples.tokens[size_t(b + t)] : 0;
      const int64_t target =
          t + 1 < n && examples.trained[size_t(b + t + 1)] ? int64_t(examples.tokens[size_t(b + t + 1)]) : int64_t{-100};
      EXPECT_EQ(batch.inputs[row][t].item<int64_t>(), in) << row << "," << t;
      EXPECT_EQ(batch.targets[row][t].item<int64_t>(), target) << row << "," << t;
    }
  }
  // Training batches draw whole examples.
  const zt::Batch drawn = sampler.batch(5, 0);
  for (int64_t row = 0; row < 2; ++row) {
    const int64_t i = sampler.example_of(5, row);
    EXPECT_EQ(drawn.inputs[row][0].item<int64_t>(), examples.tokens[size_t(examples.starts[size_t(i)])]);
  }
  // A window too short to reach the response is refused, naming the line.
  auto message = data_error_of([&] { zt::FinetuneSampler(examples, 4, 1, 1, 0, 0); });
  EXPECT_NE(message.find(file.string() + ":1"), std::string::npos) << message;
}

// An empty response trains the end token alone when data.eos_token is set (the example teaches
// the model to stop there, as TRL accepts it); without an end token there is nothing to train and
// the refusal says what would make it valid.
TEST(FinetuneExamples, EmptyResponseTrainsTheEndTokenOnlyWithAnEosToken) {
  const fs::path dir = make_temp_dir("finetune");
  const auto tokenizer = zt::HfTokenizer::from_file(write_tokenizer(dir / "tok", byte_level_tokenizer()));
  const fs::path file = write_file(dir / "e.jsonl", "{\"prompt\": \"Q: stop?\", \"response\": \"\"}\n");
  const auto examples = zt::load_finetune_examples(file, tokenizer, "auto", TokenId{259});
  ASSERT_EQ(examples.count(), 1);
  std::vector<uint32_t> expected = tokenizer.encode_with_special_tokens("Q: stop?");
  expected.push_back(259);
  EXPECT_EQ(std::vector<uint32_t>(examples.tokens.begin(), examples.tokens.end()), expected);
  for (size_t k = 0; k < expected.size(); ++k) EXPECT_EQ(examples.trained[k], k + 1 == expected.size() ? 1 : 0) << k;
  const zt::Batch batch = zt::FinetuneSampler(examples, 16, 1, 1, 0, 0).eval_batch(0);
  EXPECT_EQ((batch.targets != -100).sum().item<int64_t>(), 1);
  EXPECT_EQ(batch.targets[0][int64_t(expected.size()) - 2].item<int64_t>(), 259);

  const std::string message = data_error_of([&] { zt::load_finetune_examples(file, tokenizer, "auto", {}); });
  EXPECT_NE(message.find(file.string() + ":1"), std::string::npos) << message;
  EXPECT_NE(message.find("data.eos_token"), std::string::npos) << message;
}

TEST(FinetuneExamples, BadExamplesAndTemplatesAreDataErrors) {
  const fs::path dir = make_temp_dir("finetune");
  const auto tokenizer = zt::HfTokenizer::from_file(write_tokenizer(dir / "tok", byte_level_tokenizer()));
  auto refused = [&](const std::string& line, const std::string& chat, const std::vector<std::string>& parts) {
    const fs::path file = write_file(dir / "x.jsonl", "{\"prompt\": \"a\", \"response\": \"b\"}\n" + line + "\n");
    const std::string message = data_error_of([&] { zt::load_finetune_examples(file, tokenizer, chat, {}); });
    for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << part << " in " << message;
  };
  refused("{\"prompt\": \"a\"}", "auto", {"x.jsonl:2", "\"response\""});
  refused("{\"prompt\": \"a\", \"response\": \"\"}", "auto", {"x.jsonl:2", "no response tokens"});
  refused("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", "auto", {"x.jsonl:2", "assistant"});
  refused("{\"messages\": [{\"role\": \"user\", \"content\": 3}]}", "auto", {"x.jsonl:2", "\"content\""});
  refused("{\"input\": \"a\"}", "auto", {"x.jsonl:2", "prompt", "messages"});
  refused("{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}", "llama3", {"<|begin_of_text|>", "llama3"});
  // A tokenizer with neither template's tokens cannot render messages.
  json plain = byte_level_tokenizer();
  plain["added_tokens"] = json::array();
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) plain["model"]["vocab"].erase(t);
  const auto bare = zt::HfTokenizer::from_json(plain.dump(), "bare.json");
  const fs::path chat = write_file(dir / "c.jsonl", "{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\"}]}\n");
  const std::string message = data_error_of([&] { zt::load_finetune_examples(chat, bare, "auto", {}); });
  EXPECT_NE(message.find("bare.json"), std::string::npos) << message;
  EXPECT_NE(message.find("data.chat_template"), std::string::npos) << message;
}

namespace {

// The examples' content as plain vectors, to compare two loads.
json content_of(const zt::FinetuneExamples& e) {
  json out = hf_examples_of(e);
  return {{"examples", out}, {"lines", std::vector<int64_t>(e.lines.begin(), e.lines.end())}};
}

// Resident bytes of this process's mapping of `file` (/proc/self/smaps), -1 when it is not mapped.
int64_t mapped_rss(const fs::path& file) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in_mapping = false;
  int64_t total = -1;
  while (std::getline(smaps, line)) {
    const bool header = !line.empty() && line.find(':') != std::string::npos && line.find(' ') < line.find(':') &&
                        std::isxdigit(static_cast<unsigned char>(line[0]));
    if (header) {
      in_mapping = line.size() >= file.string().size() &&
                   line.compare(line.size() - file.string().size(), std::string::npos, file.string()) == 0;
    } else if (in_mapping && line.rfind("Rss:", 0) == 0) {
      total = std::max<int64_t>(total, 0) + std::stoll(line.substr(4)) * 1024;
    }
  }
  return total;
}

std::string pair_lines(int count, int from = 0) {
  std::string lines;
  for (int i = from; i < from + count; ++i)
    lines += json({{"prompt", "Q" + std::to_string(i) + ": the cat " + std::string(size_t(i % 7), '?') + "\nA:"},
                   {"response", " the hat " + std::to_string(i * 7)}})
                 .dump() +
             "\n";
  return lines;
}

}  // namespace

// The fine-tuning cache: tokenized once into a file (the same examples as read in memory), then
// mapped without tokenizing again; a changed data file, another template, a changed id or a
// truncated cache make it rebuild; no temporary file is left.
TEST(FinetuneCache, TokenizedOnceMappedAndRebuiltWhenStaleOrDamaged) {
  const fs::path dir = make_temp_dir("finetune-cache");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const auto tokenizer = zt::HfTokenizer::from_file(tok);
  const std::string chat =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": "
      "\"then\"}]}\n";
  const fs::path file = write_file(dir / "ft.jsonl", pair_lines(6) + "\n" + chat);
  zt::TokenizeOptions options;
  options.eos_token = "<|endoftext|>";
  options.cache_dir = dir / "cache";
  const json expected = content_of(zt::load_finetune_examples(file, tokenizer, "auto", TokenId{259}));

  const auto first = zt::load_finetune_cache(file, tok, "auto", options);
  EXPECT_TRUE(first.built);
  EXPECT_EQ(first.cache_file.parent_path(), dir / "cache");
  EXPECT_EQ(content_of(first.examples), expected);
  EXPECT_EQ(first.examples.lines[6], 8) << "the chat line, after a blank one";
  const auto written = fs::last_write_time(first.cache_file);
  const auto second = zt::load_finetune_cache(file, tok, "auto", options);
  EXPECT_FALSE(second.built);
  EXPECT_EQ(content_of(second.examples), expected);
  EXPECT_EQ(fs::last_write_time(first.cache_file), written) << "a hit does not write the cache";

  {  // the first token becomes 'z' (122): inside the vocabulary, same size, same header
    std::fstream patch(first.cache_file, std::ios::binary | std::ios::in | std::ios::out);
    patch.seekp(1024);
    const uint32_t z = 122;
    patch.write(reinterpret_cast<const char*>(&z), sizeof z);
  }
  const auto altered = zt::load_finetune_cache(file, tok, "auto", options);
  EXPECT_TRUE(altered.built);
  EXPECT_EQ(content_of(altered.examples), expected);
  fs::resize_file(first.cache_file, fs::file_size(first.cache_file) - 5);
  const auto truncated = zt::load_finetune_cache(file, tok, "auto", options);
  EXPECT_TRUE(truncated.built);
  EXPECT_EQ(content_of(truncated.examples), expected);

  EXPECT_TRUE(zt::load_finetune_cache(file, tok, "chatml", options).built) << "another template, another key";
  write_file(file, pair_lines(7) + "\n" + chat);
  const auto grown = zt::load_finetune_cache(file, tok, "chatml", options);
  EXPECT_TRUE(grown.built);
  EXPECT_EQ(grown.examples.count(), 8);
  EXPECT_FALSE(zt::load_finetune_cache(file, tok, "chatml", options).built);
  // A bad line is the in-memory reader's error, naming the file and line; nothing is left behind.
  write_file(dir / "bad.jsonl", pair_lines(2) + "{\"prompt\": \"a\", \"response\": 3}\n");
  const std::string message =
      data_error_of([&] { zt::load_finetune_cache(dir / "bad.jsonl", tok, "auto", options); });
  EXPECT_NE(message.find((dir / "bad.jsonl").string() + ":3"), std::string::npos) << message;
  for (const auto& entry : fs::directory_iterator(dir / "cache"))
    EXPECT_EQ(entry.path().string().find(".tmp-"), std::string::npos) << entry.path();
}

// A cache whose checksum was made to match a hostile index (an example reaching past the tokens)
// or a false largest id is rebuilt, never read past its columns.
TEST(FinetuneCache, HostileIndexWithAMatchingChecksumIsRebuilt) {
  const fs::path dir = make_temp_dir("finetune-cache-hostile");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  const fs::path file = write_file(dir / "ft.jsonl", pair_lines(4));
  const auto first = zt::load_finetune_cache(file, tok, "auto", {});
  const json expected = content_of(first.examples);
  const int64_t n_tokens = int64_t(first.examples.tokens.size());
  // Offsets of the layout (src/data/finetune_cache.cpp): header, tokens, flags, zeros to a
  // multiple of 8, starts.
  const int64_t starts_at = (1024 + 5 * n_tokens + 7) / 8 * 8;
  auto rewrite = [&](int64_t at, int64_t value, int64_t max_id) {
    std::string bytes = zt::data::read_file(first.cache_file, "test");
    std::memcpy(bytes.data() + at, &value, sizeof value);
    std::memcpy(bytes.data() + 72, &max_id, sizeof max_id);
    zt::data::Checksum sum;
    sum.update(bytes.data() + 1024, bytes.size() - 1024);
    const uint64_t checksum = sum.value();
    std::memcpy(bytes.data() + 80, &checksum, sizeof checksum);
    std::ofstream(first.cache_file, std::ios::binary | std::ios::trunc) << bytes;
  };
  int64_t max_id = 0;
  std::memcpy(&max_id, zt::data::read_file(first.cache_file, "test").data() + 72, sizeof max_id);
  rewrite(starts_at + 8, int64_t(1) << 40, max_id);  // example 0 ends far past the tokens
  const auto past = zt::load_finetune_cache(file, tok, "auto", {});
  EXPECT_TRUE(past.built);
  EXPECT_EQ(content_of(past.examples), expected);
  rewrite(starts_at + 8, first.examples.starts[1], 100);  // a largest id below the true one
  const auto lying = zt::load_finetune_cache(file, tok, "auto", {});
  EXPECT_TRUE(lying.built);
  EXPECT_EQ(content_of(lying.examples), expected);
}

// A rank reads the cache's index and the examples it samples, not the rest: the resident part of
// its mapping stays near the index while the tokens are many times larger.
TEST(FinetuneCache, RankReadsTheIndexAndTheExamplesItSamplesOnly) {
  const fs::path dir = make_temp_dir("finetune-cache-rss");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  std::string lines;
  const std::string filler(400, 'x');
  for (int i = 0; i < 20000; ++i)
    lines += json({{"prompt", "Q" + std::to_string(i) + ": " + filler + "\nA:"}, {"response", " the hat"}}).dump() + "\n";
  const fs::path file = write_file(dir / "big.jsonl", lines);
  zt::TokenizeOptions options;
  options.eos_token = "<|endoftext|>";
  ASSERT_TRUE(zt::load_finetune_cache(file, tok, "auto", options).built);

  const zt::FinetuneCache cache = zt::load_finetune_cache(file, tok, "auto", options);
  ASSERT_FALSE(cache.built);
  const auto [train, val] = cache.examples.split(0.1);
  train.validate(262);
  const int64_t micro = 2, steps = 3;
  const zt::FinetuneSampler sampler(train, 512, micro, 2, 1, 7);
  for (int64_t step = 0; step < steps; ++step) sampler.batch(step, 0);
  const int64_t file_size = int64_t(fs::file_size(cache.cache_file));
  const int64_t resident = mapped_rss(cache.cache_file);
  ASSERT_GE(resident, 0) << "the cache is mapped";
  // The index (header, starts, lines, first targets), and per example read its tokens and its
  // flags, each with what the kernel maps around a fault (a large folio of the page cache: up to a
  // few hundred KiB, allowed 512 KiB here).
  const int64_t bound = cache.examples.setup_bytes() + (micro * steps * 2 + 2) * (512 << 10);
  EXPECT_EQ(cache.examples.setup_bytes(), 1024 + 8 * (20000 + 1) + 2 * 8 * 20000);
  EXPECT_LE(resident, bound) << "of a " << file_size << "-byte cache";
  EXPECT_LT(resident, file_size / 4);
}

// The response-only loss of zerotrain's GPT on a fine-tuning batch equals transformers'
// GPT2LMHeadModel loss with the same weights on the examples with labels -100 on the prompts and
// the padding.
TEST(FinetuneLoss, EqualsTransformersWithLabelsMinus100OnThePrompt) {
  REQUIRE_TRANSFORMERS();
  const fs::path dir = make_temp_dir("finetune-loss");
  const auto tokenizer = zt::HfTokenizer::from_file(write_tokenizer(dir / "tok", byte_level_tokenizer()));
  std::string lines;
  for (int i = 0; i < 6; ++i)
    lines += json({{"prompt", "Q" + std::to_string(i) + ": the cat" + std::string(size_t(i), '?') + "\nA:"},
                   {"response", " the hat " + std::to_string(i * 7)}})
                 .dump() +
             "\n";
  lines += json({{"messages", {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "then"}},
                               {{"role", "user"}, {"content", "more"}}, {{"role", "assistant"}, {"content", "the end"}}}}})
               .dump() +
           "\n";
  const auto examples =
      zt::load_finetune_examples(write_file(dir / "ft.jsonl", lines), tokenizer, "chatml", TokenId{259});
  zt::GPTConfig config = zt::gpt_preset("tiny");
  config.vocab_size = 262;
  config.dropout = 0.0;
  const int64_t seq_len = config.context_length - 1;  // transformers reads seq_len + 1 positions
  torch::manual_seed(5);
  zt::GPT model(config);
  model->eval();
  zt::FinetuneSampler sampler(examples, seq_len, 4, 1, 0, 9);
  // Two batches: one drawn for training, and the held-out walk (with the chat example).
  json batches = json::array();
  std::vector<double> losses;
  const std::vector<std::pair<zt::Batch, std::vector<int64_t>>> drawn = {
      {sampler.batch(0, 0), {sampler.example_of(0, 0), sampler.example_of(0, 1), sampler.example_of(0, 2),
                             sampler.example_of(0, 3)}},
      {sampler.eval_batch(1), {4, 5, 6, 0}}};  // the walk: examples 4·1 + row, modulo 7
  for (const auto& [batch, rows] : drawn) {
    torch::NoGradGuard no_grad;
    losses.push_back(model->loss(batch.inputs, batch.targets).item<double>());
    batches.push_back(rows);
  }
  std::vector<zt::HfTensor> tensors;
  for (const auto& named : model->named_parameters()) {
    const torch::Tensor value = named.value().detach().clone();
    tensors.push_back({named.key(), value.sizes().vec(), [value] { return value; }});
  }
  zt::write_hf_model(tensors, config, dir / "hf", torch::kFloat, zt::hf_default_max_shard_bytes());
  std::ofstream(dir / "case.json") << json({{"examples", hf_examples_of(examples)}, {"batches", batches}, {"losses", losses},
                                            {"seq_len", seq_len}})
                                          .dump();
  auto r = zt::testing::run_transformers_script("finetune_loss_oracle.py", {(dir / "hf").string(), (dir / "case.json").string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("batch 1: zerotrain"), std::string::npos) << r.output;
}

namespace {

// The examples of a packing test: pairs of different lengths, short enough that several share a row.
zt::FinetuneExamples packing_examples(const fs::path& dir) {
  const auto tokenizer = zt::HfTokenizer::from_file(write_tokenizer(dir / "tok", byte_level_tokenizer()));
  std::string lines;
  for (int i = 0; i < 9; ++i)
    lines += json({{"prompt", "Q" + std::to_string(i) + ":" + std::string(size_t(i % 4), ' ') + "the cat\n"},
                   {"response", " hat " + std::string(size_t(i % 3 + 1), 'x')}})
                 .dump() +
             "\n";
  return zt::load_finetune_examples(write_file(dir / "ft.jsonl", lines), tokenizer, "auto", TokenId{259});
}

// The positions [begin, end) of segment k in a packed row.
std::pair<int64_t, int64_t> segment_span(const torch::Tensor& row_segments, int64_t k) {
  const auto positions = (row_segments == k).nonzero().flatten();
  if (positions.numel() == 0) return {0, 0};
  return {positions[0].item<int64_t>(), positions[-1].item<int64_t>() + 1};
}

// The index of the example whose tokens but its last are `row_inputs`[b, e) (-1 for none).
int64_t example_in_segment(const zt::FinetuneExamples& examples, const torch::Tensor& row_inputs, int64_t b, int64_t e) {
  for (int64_t i = 0; i < examples.count(); ++i) {
    const int64_t s0 = examples.starts[size_t(i)], n = examples.starts[size_t(i) + 1] - s0;
    if (n != e - b + 1) continue;
    bool same = true;
    for (int64_t t = 0; t < n - 1 && same; ++t) same = row_inputs[b + t].item<int64_t>() == examples.tokens[size_t(s0 + t)];
    if (same) return i;
  }
  return -1;
}

// The examples of each packed batch of the first `steps` steps, as example indices, the rows in order.
std::vector<std::vector<int64_t>> packed_example_indices(const zt::FinetuneExamples& examples,
                                                         const zt::FinetuneSampler& packed, int64_t steps) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t step = 0; step < steps; ++step) {
    const zt::Batch batch = packed.batch(step, 0);
    out.emplace_back();
    for (int64_t row = 0; row < batch.inputs.size(0); ++row) {
      const torch::Tensor seg = batch.segments[row];
      for (int64_t k = 0; k <= seg.max().item<int64_t>(); ++k) {
        const auto [b, e] = segment_span(seg, k);
        out.back().push_back(example_in_segment(examples, batch.inputs[row], b, e));
      }
    }
  }
  return out;
}

// A decoder as the packing tests see it: its loss on a batch (packed when segments are given) and
// its per-position outputs on a batch (the GPT's hidden states, the Llama's logits).
struct PackedDecoder {
  std::function<torch::Tensor(const torch::Tensor& inputs, const torch::Tensor& targets, const torch::Tensor& segments)> loss;
  std::function<torch::Tensor(const torch::Tensor& inputs, const torch::Tensor& segments)> outputs;
  double output_tolerance;  // largest difference between a packed example's outputs and its own alone
};

// The packed batches of the first two steps of `examples` (micro-batch 3, seed 11): each row holds
// whole examples back to back, numbered by Batch::segments (-1 on the padding), and `model`'s
// loss on it equals the losses of the same examples each alone in an unpacked batch, weighted by
// their trained tokens. Plain causal attention over the row (the same batch without segments)
// gives another loss, and a later example's outputs equal those of the example alone.
void expect_packed_loss_is_the_weighted_loss_alone(const PackedDecoder& model, const zt::FinetuneExamples& examples,
                                                   int64_t seq_len) {
  torch::NoGradGuard no_grad;
  const zt::FinetuneSampler packed(examples, seq_len, 3, 1, 0, 11, /*pack=*/true);
  const zt::FinetuneSampler unpacked(examples, seq_len, 3, 1, 0, 11);
  ASSERT_TRUE(packed.packed());
  EXPECT_FALSE(unpacked.batch(0, 0).segments.defined()) << "unpacked batches carry no segments";

  int64_t later_segments_trained = 0;  // trained targets in segments after the first of a row
  for (int64_t step = 0; step < 2; ++step) {
    const zt::Batch batch = packed.batch(step, 0);
    ASSERT_TRUE(batch.segments.defined());
    ASSERT_EQ(batch.segments.sizes(), batch.inputs.sizes());
    const zt::Batch plain = unpacked.batch(step, 0);
    const torch::Tensor packed_outputs = model.outputs(batch.inputs, batch.segments);
    double weighted = 0, counted = 0;
    for (int64_t row = 0; row < 3; ++row) {
      const torch::Tensor seg = batch.segments[row];
      // Segments 0, 1, … in order, then only padding: input 0, target -100.
      const int64_t last = seg.max().item<int64_t>();
      ASSERT_GE(last, 0);
      int64_t next_start = 0;
      for (int64_t k = 0; k <= last; ++k) {
        const auto [b, e] = segment_span(seg, k);
        ASSERT_EQ(b, next_start) << "row " << row << " segment " << k;
        ASSERT_EQ((seg.narrow(0, b, e - b) == k).all().item<bool>(), true);
        next_start = e;
        // The example this segment holds: one whose first e - b + 1 tokens are its inputs then its last target.
        const torch::Tensor tg = batch.targets[row].narrow(0, b, e - b);
        const int64_t found = example_in_segment(examples, batch.inputs[row], b, e);
        ASSERT_GE(found, 0) << "row " << row << " segment " << k << " is no whole example";
        if (k == 0) EXPECT_EQ(found, unpacked.example_of(step, row)) << "the first is the unpacked row's example";
        // The example alone, as an unpacked batch of one row.
        zt::FinetuneExamples alone;
        const int64_t s0 = examples.starts[size_t(found)], n = examples.starts[size_t(found) + 1] - s0;
        alone.add(std::vector<uint32_t>(examples.tokens.begin() + s0, examples.tokens.begin() + s0 + n),
                  std::vector<uint8_t>(examples.trained.begin() + s0, examples.trained.begin() + s0 + n), 1);
        const zt::Batch single = zt::FinetuneSampler(alone, seq_len, 1, 1, 0, 0).eval_batch(0);
        EXPECT_TRUE(single.targets[0].narrow(0, 0, e - b).equal(tg)) << "targets of row " << row << " segment " << k;
        const double count = (single.targets != -100).sum().item<double>();
        weighted += count * model.loss(single.inputs, single.targets, {}).item<double>();
        counted += count;
        if (k > 0) {
          later_segments_trained += int64_t(count);
          // Its outputs in the row equal those of the example alone.
          const auto in_row = packed_outputs[row].narrow(0, b, e - b);
          const auto by_itself = model.outputs(single.inputs, {})[0].narrow(0, 0, e - b);
          EXPECT_LT((in_row - by_itself).abs().max().item<double>(), model.output_tolerance) << row << "/" << k;
        }
      }
      const int64_t pad = seq_len - next_start;
      EXPECT_TRUE((seg.narrow(0, next_start, pad) == -1).all().item<bool>());
      EXPECT_TRUE((batch.inputs[row].narrow(0, next_start, pad) == 0).all().item<bool>());
      EXPECT_TRUE((batch.targets[row].narrow(0, next_start, pad) == -100).all().item<bool>());
    }
    const double expected = weighted / counted;
    const double loss = model.loss(batch.inputs, batch.targets, batch.segments).item<double>();
    EXPECT_NEAR(loss, expected, 1e-6 * expected) << "step " << step;
    const double unmasked = model.loss(batch.inputs, batch.targets, {}).item<double>();
    EXPECT_GT(std::abs(unmasked - expected), 1e-3) << "step " << step << ": segments must change the loss";
    // The packed rows hold more trained tokens than the unpacked ones.
    EXPECT_GT(counted, (plain.targets != -100).sum().item<double>());
  }
  EXPECT_GT(later_segments_trained, 0) << "no row packed a second example: the test would not see the mask";
}

// A Llama small enough for the packing tests, over the test tokenizer's 262 ids: grouped-query
// attention, untied head. Its weights are drawn wider than transformers' 0.02, so that what a
// token attends to moves its logits clearly (at 0.02 the whole row's context moved the loss by
// less than 1e-3).
zt::LlamaConfig packing_llama() {
  zt::LlamaConfig c;
  c.vocab_size = 262;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.2;
  return c;
}

}  // namespace

// The GPT: a later example's hidden states equal those of the example alone, so neither the mask
// nor the restart of the learned positions can be missing.
TEST(FinetunePacking, PackedLossIsTheTokenWeightedLossOfTheExamplesAlone) {
  const fs::path dir = make_temp_dir("finetune-pack");
  zt::GPTConfig config = zt::gpt_preset("tiny");
  config.vocab_size = 262;
  config.dropout = 0.0;
  torch::manual_seed(7);
  zt::GPT model(config);
  model->eval();
  expect_packed_loss_is_the_weighted_loss_alone(
      {[&](const torch::Tensor& in, const torch::Tensor& tg, const torch::Tensor& seg) { return model->loss(in, tg, seg); },
       [&](const torch::Tensor& in, const torch::Tensor& seg) { return model->hidden(in, seg); }, 1e-5},
      packing_examples(dir), 48);
}

// The Llama: a later example's logits equal those of the example alone within fp32 rounding (the
// masked attention sums in another order than the causal one).
TEST(FinetunePacking, LlamaPackedLossIsTheTokenWeightedLossOfTheExamplesAlone) {
  const fs::path dir = make_temp_dir("finetune-pack-llama");
  torch::manual_seed(7);
  zt::Llama model(packing_llama());
  model->eval();
  expect_packed_loss_is_the_weighted_loss_alone(
      {[&](const torch::Tensor& in, const torch::Tensor& tg, const torch::Tensor& seg) { return model->loss(in, tg, seg); },
       [&](const torch::Tensor& in, const torch::Tensor& seg) { return model->forward(in, seg); }, 1e-5},
      packing_examples(dir), 48);
}

// The positions restart at each segment (the padding's -1 is one more) and each token may attend
// exactly to the earlier tokens of its own segment.
TEST(FinetunePacking, SegmentsGiveRestartedPositionsAndABlockDiagonalCausalMask) {
  const auto segments = torch::tensor({0, 0, 0, 1, 1, 2, -1, -1}, torch::kLong).view({1, 8});
  const auto ids = torch::zeros({1, 8}, torch::kLong);
  const zt::PackedRows rows = zt::packed_rows(ids, segments, "Test");
  EXPECT_TRUE(rows.positions.equal(torch::tensor({0, 1, 2, 0, 1, 0, 0, 1}, torch::kLong).view({1, 8})))
      << rows.positions;
  ASSERT_EQ(rows.allowed.sizes(), (std::vector<int64_t>{1, 1, 8, 8}));
  for (int64_t q = 0; q < 8; ++q)
    for (int64_t k = 0; k < 8; ++k) {
      const bool expected = k <= q && segments[0][q].item<int64_t>() == segments[0][k].item<int64_t>();
      EXPECT_EQ(rows.allowed[0][0][q][k].item<bool>(), expected) << q << "," << k;
    }
  EXPECT_THROW(zt::packed_rows(ids, segments.to(torch::kFloat), "Test"), zt::ConfigError);
  EXPECT_THROW(zt::packed_rows(ids, segments.narrow(1, 0, 7), "Test"), zt::ConfigError);
}

// The Llama's response-only loss on packed rows equals transformers' LlamaForCausalLM loss on the
// same weights with each of the rows' examples computed on its own (one per row, labels -100 on the
// prompt and the padding): the loss counts every response token once, however the examples share rows.
TEST(FinetunePacking, LlamaPackedLossEqualsTransformersOnEachExampleAlone) {
  REQUIRE_TRANSFORMERS();
  const fs::path dir = make_temp_dir("finetune-pack-llama-hf");
  const zt::FinetuneExamples examples = packing_examples(dir);
  const zt::LlamaConfig config = packing_llama();
  const int64_t seq_len = 48;
  torch::manual_seed(5);
  zt::Llama model(config);
  model->eval();
  const zt::FinetuneSampler packed(examples, seq_len, 3, 1, 0, 11, /*pack=*/true);
  json batches = json::array();
  std::vector<double> losses;
  const auto indices = packed_example_indices(examples, packed, 2);
  for (int64_t step = 0; step < 2; ++step) {
    torch::NoGradGuard no_grad;
    const zt::Batch batch = packed.batch(step, 0);
    losses.push_back(model->loss(batch.inputs, batch.targets, batch.segments).item<double>());
    batches.push_back(indices[size_t(step)]);
    ASSERT_GT(indices[size_t(step)].size(), 3u) << "step " << step << ": no row packed a second example";
  }
  std::vector<zt::HfTensor> tensors;
  for (const auto& named : model->named_parameters()) {
    const torch::Tensor value = named.value().detach().clone();
    tensors.push_back({named.key(), value.sizes().vec(), [value] { return value; }});
  }
  zt::write_hf_llama_model(tensors, config, dir / "hf", torch::kFloat, zt::hf_default_max_shard_bytes(), "");
  std::ofstream(dir / "case.json") << json({{"class", "llama"}, {"examples", hf_examples_of(examples)},
                                            {"batches", batches}, {"losses", losses}, {"seq_len", seq_len}})
                                          .dump();
  auto r = zt::testing::run_transformers_script("finetune_loss_oracle.py", {(dir / "hf").string(), (dir / "case.json").string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("batch 1: zerotrain"), std::string::npos) << r.output;
}

// Full activation recomputation runs a packed block again in backward with the same mask: the
// gradients equal those of the plain model.
TEST(FinetunePacking, RecomputationKeepsTheMask) {
  const fs::path dir = make_temp_dir("finetune-pack-ckpt");
  const zt::FinetuneExamples examples = packing_examples(dir);
  zt::GPTConfig config = zt::gpt_preset("tiny");
  config.vocab_size = 262;
  config.dropout = 0.0;
  const zt::Batch batch = zt::FinetuneSampler(examples, 48, 2, 1, 0, 3, /*pack=*/true).batch(1, 0);
  std::vector<std::vector<torch::Tensor>> grads;
  for (zt::Recompute recompute : {zt::Recompute::None, zt::Recompute::Full, zt::Recompute::Selective}) {
    torch::manual_seed(3);
    zt::GPT model(config);
    zt::GPTImpl::Checkpointing settings;
    settings.recompute = recompute;
    model->set_checkpointing(settings);
    model->loss(batch.inputs, batch.targets, batch.segments).backward();
    grads.emplace_back();
    for (const auto& p : model->parameters()) grads.back().push_back(p.grad().clone());
  }
  for (size_t run = 1; run < grads.size(); ++run)
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(grads[run][i].equal(grads[0][i])) << "run " << run << " parameter " << i;
}

// The same for the Llama: full recomputation (its only kind) with the packed mask and per-token
// rotary positions gives bitwise the gradients of the plain model.
TEST(FinetunePacking, LlamaRecomputationKeepsTheMask) {
  const fs::path dir = make_temp_dir("finetune-pack-llama-ckpt");
  const zt::Batch batch = zt::FinetuneSampler(packing_examples(dir), 48, 2, 1, 0, 3, /*pack=*/true).batch(1, 0);
  std::vector<std::vector<torch::Tensor>> grads;
  for (zt::Recompute recompute : {zt::Recompute::None, zt::Recompute::Full}) {
    torch::manual_seed(3);
    zt::Llama model(packing_llama());
    zt::CheckpointingSettings settings;
    settings.recompute = recompute;
    model->set_checkpointing(settings);
    model->loss(batch.inputs, batch.targets, batch.segments).backward();
    grads.emplace_back();
    for (const auto& p : model->parameters()) grads.back().push_back(p.grad().clone());
  }
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(grads[1][i].equal(grads[0][i])) << "parameter " << i;
}

// data.pack is refused where it cannot apply: one line, exit 2, before launch.
TEST(FinetunePacking, RefusedOutsideFineTuningAndForTheBert) {
  const fs::path dir = make_temp_dir("finetune-pack-cli");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  write_file(dir / "ft.jsonl", "{\"prompt\": \"Q: a\", \"response\": \" b\"}\n{\"prompt\": \"Q: c\", \"response\": \" d\"}\n");
  const std::string config = write_file(dir / "config.json", R"({
    "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "model": {"preset": "tiny"}, "data": {"sequence_length": 16, "pack": true},
    "train": {"steps": 2, "threads": 1, "log_dir": ")" + (dir / "runs").string() + R"("}})");
  const std::vector<std::vector<std::string>> cases = {
      {},  // the embedded corpus
      {"--set", "data.source=text", "--set", "data.path=" + write_file(dir / "t.txt", "the cat sat on the mat\n")},
      {"--set", "model.type=bert", "--set", "model.preset=bert-tiny", "--set", "data.source=finetune", "--set",
       "data.path=" + (dir / "ft.jsonl").string(), "--set", "data.tokenizer=" + tok}};
  const std::vector<std::string> expected = {"\"finetune\"", "\"text\"", "model.type \"bert\""};
  for (size_t c = 0; c < cases.size(); ++c) {
    std::vector<std::string> args = {cli_path(), "train", config, "--nproc", "1"};
    args.insert(args.end(), cases[c].begin(), cases[c].end());
    auto r = run_process(args, {}, std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find("data.pack"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(expected[c]), std::string::npos) << expected[c] << " in " << r.output;
  }
  EXPECT_FALSE(fs::exists(dir / "runs" / "logs")) << "nothing may start";
}

// The CLI: an id past the model's vocabulary in a token file, and a tokenizer of a kind not
// implemented, are one line on stderr and exit 2 before any rank starts; a fine-tuning run trains.
TEST(TokenizedDataCli, BadDataIsOneLineBeforeLaunchAndFinetuningTrains) {
  const fs::path dir = make_temp_dir("tokenized-cli");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  std::vector<uint16_t> ids(400, 7);
  ids[123] = 300;
  zt::TokenDataset::write_bin_file(dir / "big.bin", ids);
  const std::string config = write_file(dir / "config.json", R"({
    "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "model": {"preset": "tiny"},
    "data": {"source": "bin", "path": ")" + (dir / "big.bin").string() + R"(", "sequence_length": 16},
    "train": {"steps": 2, "threads": 1, "log_dir": ")" + (dir / "runs").string() + R"("}})");
  auto r = run_process({cli_path(), "train", config, "--nproc", "1"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  for (const std::string& part : std::vector<std::string>{(dir / "big.bin").string(), "300", "< 256"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " in " << r.output;
  EXPECT_FALSE(fs::exists(dir / "runs" / "logs")) << "nothing may start";

  // The BERT reads uint16 ids only: an llm.c file of uint32 ids is refused before launch too.
  zt::TokenDataset::write_bin_file(dir / "wide.bin", std::vector<uint32_t>(400, 7));
  r = run_process({cli_path(), "train", config, "--nproc", "1", "--set", "model.type=bert", "--set",
                   "model.preset=bert-tiny", "--set",
                   "data.path=" + (dir / "wide.bin").string()},
                  {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_NE(r.output.find("wide.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("uint32"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "runs" / "logs")) << "nothing may start";

  // A WordPiece tokenizer.json (BERT's) is refused by the tokenizer layer, before launch.
  json wordpiece = byte_level_tokenizer();
  wordpiece["model"] = {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"vocab", {{"[UNK]", 0}, {"a", 1}}}};
  const std::string wp = write_tokenizer(dir / "wp", wordpiece);
  write_file(dir / "docs.jsonl", "{\"text\": \"the cat\"}\n");
  r = run_process({cli_path(), "train", config, "--nproc", "1", "--set", "data.source=jsonl", "--set",
                   "data.path=" + (dir / "docs.jsonl").string(), "--set", "data.tokenizer=" + wp},
                  {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_NE(r.output.find("WordPiece"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "runs" / "logs")) << "nothing may start";

  // Fine-tuning through the CLI: 2 steps on 2 ranks with evaluation.
  std::string lines;
  for (int i = 0; i < 10; ++i)
    lines += json({{"prompt", "Q: the cat " + std::to_string(i)}, {"response", " the hat"}}).dump() + "\n";
  write_file(dir / "ft.jsonl", lines);
  r = run_process({cli_path(), "train", config, "--nproc", "2", "--set", "data.source=finetune", "--set",
                   "data.path=" + (dir / "ft.jsonl").string(), "--set", "data.tokenizer=" + tok, "--set",
                   "data.eos_token=<|endoftext|>", "--set", "model.vocab_size=262", "--set", "train.eval_interval=2",
                   "--set", "train.eval_iters=1", "--set", "data.val_fraction=0.2"},
                  {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("8 train / 2 held-out fine-tuning examples"), std::string::npos) << r.output;
  // And packed: several examples per row.
  r = run_process({cli_path(), "train", config, "--nproc", "2", "--set", "data.source=finetune", "--set",
                   "data.path=" + (dir / "ft.jsonl").string(), "--set", "data.tokenizer=" + tok, "--set",
                   "data.eos_token=<|endoftext|>", "--set", "model.vocab_size=262", "--set", "data.pack=true"},
                  {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 2/2"), std::string::npos) << r.output;
  // And the Llama, packed, on one rank.
  r = run_process({cli_path(), "train", config, "--nproc", "1", "--set", "model.type=llama", "--set",
                   "model.preset=llama-tiny", "--set", "data.source=finetune", "--set",
                   "data.path=" + (dir / "ft.jsonl").string(), "--set", "data.tokenizer=" + tok, "--set",
                   "data.eos_token=<|endoftext|>", "--set", "model.vocab_size=262", "--set", "data.pack=true"},
                  {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step 2/2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fine-tuning examples (loss on the response tokens)"), std::string::npos) << r.output;
}

// Fine-tuning through the CLI with data.cache_dir: the launcher's check tokenizes the file once
// into the cache, the ranks map it, and the memory estimate counts what a rank holds of it (the
// cache's header and index).
TEST(TokenizedDataCli, FinetuningCachesTheExamplesAndTheEstimateCountsTheirIndex) {
  const fs::path dir = make_temp_dir("finetune-cache-cli");
  const std::string tok = write_tokenizer(dir / "tok", byte_level_tokenizer());
  write_file(dir / "ft.jsonl", pair_lines(10));
  const std::string config = write_file(dir / "config.json", R"({
    "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "model": {"preset": "tiny", "vocab_size": 262},
    "data": {"source": "finetune", "path": ")" + (dir / "ft.jsonl").string() + R"(", "tokenizer": ")" + tok +
                                                   R"(", "eos_token": "<|endoftext|>", "sequence_length": 32,
             "cache_dir": ")" + (dir / "cache").string() + R"("},
    "train": {"steps": 2, "threads": 1, "log_dir": ")" + (dir / "runs").string() + R"("}})");
  const std::string summary = (dir / "summary.json").string();
  auto r = run_process({cli_path(), "train", config, "--nproc", "2", "--summary", summary}, {},
                       std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<fs::path> caches;
  for (const auto& entry : fs::directory_iterator(dir / "cache")) caches.push_back(entry.path());
  ASSERT_EQ(caches.size(), 1u);
  EXPECT_TRUE(caches[0].string().ends_with(".examples.bin")) << caches[0];
  std::ifstream in(summary);
  const json s = json::parse(in);
  EXPECT_EQ(s["memory"]["estimate"]["per_device"]["data"].get<int64_t>(), 1024 + 8 * 11 + 2 * 8 * 10) << s["memory"];
}
