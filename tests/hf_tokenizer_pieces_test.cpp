// The pieces of the Hugging Face tokenizers (src/data/hf_*.cpp) on small hand-written files, and
// the refusals: unsupported kinds and options, missing and malformed files, each a zt::DataError
// naming the file and the field. Needs no Python (hf_tokenizer_test.cpp compares with it).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <set>

#include "data/hf_bpe.h"
#include "data/hf_regex.h"
#include "data/hf_utf8.h"
#include "support/process.h"
#include "zerotrain/error.h"
#include "zerotrain/tokenizer.h"

using nlohmann::json;
using zt::HfTokenizer;
using zt::TokenId;

namespace {

// A BPE tokenizer.json with the given vocabulary and merges and nothing around the model.
json bare_bpe(const json& vocab, const json& merges) {
  return {{"version", "1.0"},       {"truncation", nullptr}, {"padding", nullptr},
          {"added_tokens", json::array()}, {"normalizer", nullptr},  {"pre_tokenizer", nullptr},
          {"post_processor", nullptr}, {"decoder", nullptr},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false},
                     {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab}, {"merges", merges}}}};
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = zt::testing::make_temp_dir("hf_tokenizer_pieces") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Loading `text` from a file must throw zt::DataError whose message holds every one of `parts`.
void expect_refused(const std::string& text, const std::vector<std::string>& parts) {
  const std::string path = write_file("tokenizer.json", text);
  try {
    HfTokenizer::from_file(path);
    ADD_FAILURE() << "loaded without error; expected a refusal naming " << json(parts).dump();
  } catch (const zt::DataError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

}  // namespace

// GPT-2's map: printable bytes are themselves, the 68 others U+0100… in byte order; every byte
// comes back.
TEST(HfTokenizerPieces, ByteUnicodeMapRoundTripsEveryByte) {
  const auto& map = zt::hf::ByteUnicodeMap::instance();
  std::set<char32_t> seen;
  char32_t next_unprintable = 0x100;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = map.char_of(uint8_t(b));
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    EXPECT_EQ(c, printable ? char32_t(b) : next_unprintable++) << "byte " << b;
    EXPECT_TRUE(seen.insert(c).second) << "byte " << b;
    EXPECT_EQ(map.byte_of(c), uint8_t(b));
    EXPECT_EQ(map.utf8_of(uint8_t(b)), zt::hf::utf8_encode(c));
  }
  EXPECT_EQ(next_unprintable, char32_t(0x100 + 68));
  EXPECT_EQ(map.utf8_of(' '), "\u0120");  // the "Ġ" of GPT-2's vocabularies
  EXPECT_FALSE(map.byte_of(U'\u0200').has_value());
}

// The lowest-ranked pair merges first wherever it is in the word, then the pairs it makes.
TEST(HfTokenizerPieces, MergesApplyByRankNotByPosition) {
  const json vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}};
  const auto bc_first = HfTokenizer::from_json(bare_bpe(vocab, {"b c", "a bc", "a b"}).dump());
  EXPECT_EQ(bc_first.encode("abc"), (std::vector<TokenId>{5}));
  EXPECT_EQ(bc_first.encode("ab"), (std::vector<TokenId>{3}));
  const auto ab_first = HfTokenizer::from_json(bare_bpe(vocab, {"a b", "b c"}).dump());
  EXPECT_EQ(ab_first.encode("abc"), (std::vector<TokenId>{3, 2}));  // "ab c": no merge makes abc
  const auto bc_only = HfTokenizer::from_json(bare_bpe(vocab, {"b c", "a b"}).dump());
  EXPECT_EQ(bc_only.encode("abc"), (std::vector<TokenId>{0, 4}));
  // Equal ranks: the leftmost occurrence merges first ("aaa" → "aa a").
  const auto repeated = HfTokenizer::from_json(bare_bpe({{"a", 0}, {"aa", 1}}, {"a a"}).dump());
  EXPECT_EQ(repeated.encode("aaa"), (std::vector<TokenId>{1, 0}));
}

// Characters outside the vocabulary become their UTF-8 bytes as <0xNN> tokens, which the
// ByteFallback decoder puts back together (and an incomplete sequence becomes U+FFFD per byte).
TEST(HfTokenizerPieces, ByteFallbackSpellsUnknownCharactersAsBytes) {
  json vocab = {{"<unk>", 0}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 1 + b;
  }
  vocab["a"] = 257;
  json spec = bare_bpe(vocab, json::array());
  spec["model"]["unk_token"] = "<unk>";
  spec["model"]["byte_fallback"] = true;
  spec["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  const auto tokenizer = HfTokenizer::from_json(spec.dump());
  const std::vector<TokenId> ids = tokenizer.encode("a\u00e9a");
  EXPECT_EQ(ids, (std::vector<TokenId>{257, 1 + 0xC3, 1 + 0xA9, 257}));
  EXPECT_EQ(tokenizer.decode(ids), "a\u00e9a");
  EXPECT_EQ(tokenizer.decode(std::vector<TokenId>{257, 1 + 0xC3, 257}), "a\uFFFDa");
  EXPECT_EQ(tokenizer.decode(std::vector<TokenId>{1 + 0xE2, 1 + 0x82}), "\uFFFD\uFFFD");
  // Without byte fallback the same character is the unknown token.
  spec["model"]["byte_fallback"] = false;
  EXPECT_EQ(HfTokenizer::from_json(spec.dump()).encode("a\u00e9a"), (std::vector<TokenId>{257, 0, 257}));
}

// Rust's from_utf8_lossy: one U+FFFD per maximal ill-formed subsequence.
TEST(HfTokenizerPieces, LossyUtf8ReplacesEachIllFormedSubsequenceOnce) {
  using zt::hf::utf8_lossy;
  EXPECT_EQ(utf8_lossy("caf\xC3\xA9"), "caf\u00e9");
  EXPECT_EQ(utf8_lossy("a\xE2\x82" "b"), "a\uFFFDb");   // truncated three-byte sequence: one
  EXPECT_EQ(utf8_lossy("\xF0\x80"), "\uFFFD\uFFFD");     // F0 80 can start nothing: two
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // a surrogate: three
  EXPECT_EQ(utf8_lossy("\xFF" "a"), "\uFFFDa");
  EXPECT_EQ(zt::hf::first_invalid_utf8("ab\xC3"), std::optional<size_t>(2));
  EXPECT_FALSE(zt::hf::first_invalid_utf8("\xF0\x9F\x98\x80").has_value());
}

// \s is Unicode's White_Space, as in Oniguruma (which the Rust library uses), in and out of classes.
TEST(HfTokenizerPieces, WhitespaceClassIsUnicodeWhiteSpace) {
  auto matches = [](const std::string& pattern, const std::string& text) {
    std::vector<std::string> found;
    zt::hf::Regex(pattern, "test").for_each_match(text, [&](size_t s, size_t e) { found.push_back(text.substr(s, e - s)); });
    return found;
  };
  for (const char* space : {"\t", "\u0085", "\u00a0", "\u1680", "\u2007", "\u2028", "\u3000"})
    EXPECT_EQ(matches(R"(\s+)", std::string("a") + space + "b"), std::vector<std::string>{space}) << json(space).dump();
  for (const char* other : {"\u180e", "\u200b", "\ufeff"}) {
    EXPECT_TRUE(matches(R"(\s+)", std::string("a") + other + "b").empty()) << json(other).dump();
    EXPECT_EQ(matches(R"([^\s\p{L}]+)", std::string("a") + other + "b"), std::vector<std::string>{other});
  }
  EXPECT_EQ(matches(R"(\S+)", "x\u00a0y"), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(matches(R"((?i:'s|'t))", "IT'S it's"), (std::vector<std::string>{"'S", "'s"}));
}

TEST(HfTokenizerErrors, UnsupportedModelTypeNamesTheFieldAndWhatIsSupported) {
  json spec = bare_bpe({{"a", 0}}, json::array());
  spec["model"] = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}, {"unk_token", "[UNK]"}};
  expect_refused(spec.dump(), {"model.type", "\"WordPiece\"", "\"BPE\""});
  spec["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  expect_refused(spec.dump(), {"model.type", "\"Unigram\""});
}

TEST(HfTokenizerErrors, UnsupportedPreTokenizerNormalizerAndDecoderAreNamed) {
  json spec = bare_bpe({{"a", 0}}, json::array());
  spec["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_refused(spec.dump(), {"pre_tokenizer.type", "\"Whitespace\"", "\"ByteLevel\"", "\"Split\""});
  spec["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Digits"}, {"individual_digits", true}}}}};
  expect_refused(spec.dump(), {"pre_tokenizer.pretokenizers[1].type", "\"Digits\""});
  spec["pre_tokenizer"] = nullptr;
  spec["normalizer"] = {{"type", "NFKC"}};
  expect_refused(spec.dump(), {"normalizer.type", "\"NFKC\"", "\"Prepend\""});
  spec["normalizer"] = nullptr;
  spec["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}};
  expect_refused(spec.dump(), {"decoder.type", "\"WordPiece\""});
  spec["decoder"] = nullptr;
  spec["post_processor"] = {{"type", "BertProcessing"}};
  expect_refused(spec.dump(), {"post_processor.type", "\"BertProcessing\"", "\"TemplateProcessing\""});
}

TEST(HfTokenizerErrors, OptionsThatChangeTheIdsAreRefusedByName) {
  json spec = bare_bpe({{"a", 0}}, json::array());
  spec["model"]["dropout"] = 0.1;
  expect_refused(spec.dump(), {"model.dropout", "0.1"});
  spec["model"]["dropout"] = nullptr;
  spec["model"]["continuing_subword_prefix"] = "##";
  expect_refused(spec.dump(), {"model.continuing_subword_prefix", "\"##\""});
  spec["model"]["continuing_subword_prefix"] = nullptr;
  spec["added_tokens"] = {{{"id", 0}, {"content", "a"}, {"lstrip", true}, {"special", true}}};
  expect_refused(spec.dump(), {"added_tokens[0].lstrip", "true"});
  spec["added_tokens"] = json::array();
  spec["truncation"] = {{"max_length", 512}};
  expect_refused(spec.dump(), {"truncation"});
}

TEST(HfTokenizerErrors, MissingAndMalformedFilesAndFieldsAreNamed) {
  const std::string missing = zt::testing::make_temp_dir("hf_tokenizer_pieces") + "/nowhere";
  try {
    HfTokenizer::from_file(missing);
    ADD_FAILURE() << "a missing file loaded";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(missing + ": cannot open"), std::string::npos) << e.what();
  }
  expect_refused("{\"model\": {\"type\": \"BPE\",", {"not valid JSON"});
  expect_refused("[1, 2]", {"expected a JSON object"});
  json spec = bare_bpe({{"a", 0}}, json::array());
  spec["model"].erase("vocab");
  expect_refused(spec.dump(), {"model.vocab", "missing"});
  spec = bare_bpe({{"a", 0}}, {"a b"});
  expect_refused(spec.dump(), {"model.merges[0]", "\"b\""});
  spec = bare_bpe({{"a", 0}}, {"a a a"});
  expect_refused(spec.dump(), {"model.merges[0]", "\"a a a\""});
  spec = bare_bpe({{"a", "zero"}}, json::array());
  expect_refused(spec.dump(), {"model.vocab[\"a\"]", "\"zero\""});
  spec = bare_bpe({{"a", 0}}, json::array());
  spec["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  expect_refused(spec.dump(), {"pre_tokenizer.pattern", "(unclosed"});
}

TEST(HfTokenizerErrors, BadTextAndUnknownIdsAreDataErrors) {
  const auto tokenizer = HfTokenizer::from_json(bare_bpe({{"a", 0}}, json::array()).dump(), "tiny.json");
  EXPECT_THROW(tokenizer.encode("a\xC3"), zt::DataError);
  try {
    tokenizer.decode(std::vector<TokenId>{0, 7});
    ADD_FAILURE() << "an unknown id decoded";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("id 7 at position 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tokenizer.vocab_size(), 1u);
}
