// The pieces of the Hugging Face tokenizers (src/data/hf_*.cpp) on small hand-written files, and
// the refusals: unsupported kinds and options, missing and malformed files, each a zt::DataError
// naming the file and the field. Needs no Python (hf_tokenizer_test.cpp compares with it).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "common/printable.h"
#include "data/hf_bpe.h"
#include "data/hf_pipeline.h"
#include "data/hf_regex.h"
#include "data/hf_utf8.h"
#include "support/process.h"
#include "zerotrain/error.h"
#include "zerotrain/data/tokenizer.h"

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

// Hostile tokenizer.json files and texts: bounded before anything grows with them, each refusal
// one line of valid UTF-8 naming the file and the field.
namespace {

// `spec` with its `part` set to `leaf` wrapped in `depth` Sequences ({"type": "Sequence", key:
// [...]}), as text: a document that deep is not built here either.
std::string with_nested_sequences(json spec, const std::string& part, const std::string& key, const json& leaf,
                                  int depth) {
  spec[part] = "@nested@";
  std::string nested;
  for (int i = 0; i < depth; ++i) nested += "{\"type\": \"Sequence\", \"" + key + "\": [";
  nested += leaf.dump();
  for (int i = 0; i < depth; ++i) nested += "]}";
  std::string text = spec.dump();
  text.replace(text.find("\"@nested@\""), 10, nested);
  return text;
}

// The message of the zt::DataError that `load` throws, or a failure when it throws none.
template <class F>
std::string refusal(F&& load) {
  try {
    load();
  } catch (const zt::DataError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no zt::DataError";
  return "";
}

bool one_line_of_utf8(const std::string& message) {
  return !zt::hf::first_invalid_utf8(message) && message.find('\n') == std::string::npos &&
         message.find('\r') == std::string::npos;
}

}  // namespace

// Each nested Sequence is two levels of JSON: 200 deep is refused by the bound on nesting before a
// document is built, and 20,000 (0.8 MB, which used to overflow the stack) the same way at once.
TEST(HfTokenizerBounds, DeeplyNestedFilesAreRefusedBeforeParsing) {
  const json bare = bare_bpe({{"a", 0}, {"_", 1}}, json::array());
  const json empty_sequence = {{"type", "Sequence"}, {"normalizers", json::array()}};
  const std::string deep = refusal(
      [&] { HfTokenizer::from_json(with_nested_sequences(bare, "normalizer", "normalizers", empty_sequence, 100), "deep.json"); });
  ASSERT_NE(deep.find("nests deeper than 32 levels"), std::string::npos) << deep;
  EXPECT_NE(deep.find("deep.json"), std::string::npos) << deep;
  for (const auto& [part, key] : {std::pair{"decoder", "decoders"}, std::pair{"post_processor", "processors"}}) {
    const std::string text = with_nested_sequences(bare, part, key, {{"type", "ByteLevel"}}, 20'000);
    const std::string message = refusal([&] { HfTokenizer::from_json(text, "deep.json"); });
    EXPECT_NE(message.find("nests deeper than 32 levels"), std::string::npos) << message;
  }
  // Within the bound, nesting works, and a refusal deep inside names the whole path.
  expect_refused(with_nested_sequences(bare, "normalizer", "normalizers", {{"type", "NFKC"}}, 3),
                 {"normalizer.normalizers[0].normalizers[0].normalizers[0].type", "\"NFKC\""});
  const std::string prepend = with_nested_sequences(bare, "normalizer", "normalizers", {{"type", "Prepend"}, {"prepend", "_"}}, 12);
  EXPECT_EQ(HfTokenizer::from_json(prepend).encode("a"), (std::vector<TokenId>{1, 0}));
}

// A tokenizer path is read only when it is a regular file of at most kMaxFileBytes: a FIFO is not
// waited on, a device such as /dev/zero not read, an oversized file refused by its size.
TEST(HfTokenizerBounds, OnlyRegularFilesOfBoundedSizeAreRead) {
  const std::string dir = zt::testing::make_temp_dir("hf_tokenizer_bounds");
  const std::string fifo = dir + "/tokenizer.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // A writer that would feed a reader "{}" (which a reader of FIFOs would then refuse for
  // lacking a model, after waiting for it); SIGPIPE ignored in case no reader is left.
  ::signal(SIGPIPE, SIG_IGN);
  std::thread writer([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) {
      [[maybe_unused]] const ssize_t n = ::write(fd, "{}", 2);
      ::close(fd);
    }
  });
  const std::string fifo_message = refusal([&] { HfTokenizer::from_file(dir); });
  const int unblock = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);  // lets the writer finish
  writer.join();
  ::close(unblock);
  ASSERT_NE(fifo_message.find(fifo + ": not a regular file"), std::string::npos) << fifo_message;

  const std::string large = dir + "/large.json";
  {
    std::ofstream out(large);
    out << "{\"model\": ";
  }
  ASSERT_EQ(::truncate(large.c_str(), off_t(HfTokenizer::kMaxFileBytes) + 1), 0);  // sparse: costs no disk
  const std::string large_message = refusal([&] { HfTokenizer::from_file(large); });
  EXPECT_NE(large_message.find(std::to_string(HfTokenizer::kMaxFileBytes + 1) + " bytes; expected at most " +
                               std::to_string(HfTokenizer::kMaxFileBytes)),
            std::string::npos)
      << large_message;
  const std::string zero_message = refusal([&] { HfTokenizer::from_file("/dev/zero"); });
  EXPECT_NE(zero_message.find("/dev/zero: not a regular file"), std::string::npos) << zero_message;
  EXPECT_EQ(HfTokenizer::read_json_file(write_file("tokenizer.json", "{}")), "{}");
}

// A Replace normalizer whose content is far longer than what it replaces would turn a small text
// into gigabytes: refused, naming the normalizer, once the output passes 8 times the input plus
// 4 KiB. Llama 2's normalizer, which triples a text of spaces, is well within.
TEST(HfTokenizerBounds, NormalizerOutputIsBoundedByItsInput) {
  json spec = bare_bpe({{"a", 0}, {"x", 1}, {"\u2581", 2}}, json::array());
  spec["normalizer"] = {{"type", "Sequence"},
                        {"normalizers", {{{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", std::string(16 << 10, 'x')}}}}};
  const auto hostile = HfTokenizer::from_json(spec.dump(), "replace.json");
  std::string text;
  for (int i = 0; i < 100; ++i) text += "a ";
  const std::string message = refusal([&] { hostile.encode(text); });
  EXPECT_NE(message.find("replace.json: field normalizer.normalizers[0] makes a text of 200 bytes longer than 5696"),
            std::string::npos)
      << message;
  spec["normalizer"] = {{"type", "Prepend"}, {"prepend", std::string(8 << 10, 'x')}};
  EXPECT_NE(refusal([&] { HfTokenizer::from_json(spec.dump(), "prepend.json").encode("a"); })
                .find("prepend.json: field normalizer makes a text of 1 bytes"),
            std::string::npos);
  spec["normalizer"] = {{"type", "Sequence"},
                        {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}},
                                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
  EXPECT_EQ(HfTokenizer::from_json(spec.dump()).encode(std::string(1000, ' ')), std::vector<TokenId>(1001, 2));
}

// Llama 3's split pattern takes a step of PCRE2's match limit per byte of a run of spaces: a run
// of 10.5 million is split as the Rust library splits shorter ones (checked with tokenizers 0.23.3
// up to 9 million, where its own Oniguruma limit stops it): the letter, the run less its last
// space, and that space with the next letter.
TEST(HfTokenizerBounds, LongWhitespaceRunsSplitPastTheMatchLimit) {
  const zt::hf::Regex llama3(
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      "llama3");
  const size_t run = 10'500'000;
  for (const char space : {' ', '\t'}) {
    const std::string text = "a" + std::string(run, space) + "b";
    std::vector<std::pair<size_t, size_t>> spans;
    llama3.for_each_match(text, [&](size_t s, size_t e) { spans.emplace_back(s, e); });
    EXPECT_EQ(spans, (std::vector<std::pair<size_t, size_t>>{{0, 1}, {1, run}, {run, run + 2}}));
  }
  // A pattern that backtracks without end still stops, with a DataError naming it.
  const zt::hf::Regex runaway(R"((a|aa)+c)", "runaway");
  const std::string message = refusal([&] { runaway.for_each_match(std::string(200, 'a') + "bc", [](size_t, size_t) {}); });
  EXPECT_NE(message.find("runaway: matching the regular expression \"(a|aa)+c\" failed"), std::string::npos) << message;
}

// Added tokens are found by an Aho-Corasick automaton: 20,000 tokens that share a first byte and
// a text of near misses cost a few transitions per byte, not one comparison per token.
TEST(HfTokenizerBounds, AddedTokenMatchingCostsAboutTheTextNotTheTokens) {
  zt::hf::AddedTokenMatcher matcher;
  for (TokenId i = 0; i < 20'000; ++i) matcher.add("<|reserved_special_token_" + std::to_string(i) + "|>", i);
  matcher.build();
  std::string text;
  while (text.size() < 400'000) text += "<|reserved_special_token_x|> ";
  text += "<|reserved_special_token_17|>";
  std::vector<zt::hf::Piece> pieces;
  const size_t transitions = matcher.split(text, true, pieces);
  EXPECT_LE(transitions, 3 * text.size());
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[1].added_id, std::optional<TokenId>(17));
  EXPECT_EQ(pieces[0].text.size(), text.size() - pieces[1].text.size());
  // The matcher keeps a node per byte of the tokens: their text is bounded in all.
  json spec = bare_bpe({{"a", 0}}, json::array());
  for (TokenId i = 0; i < 5; ++i)
    spec["added_tokens"].push_back({{"id", 1 + i}, {"content", std::string(1 << 20, char('a' + i))}, {"special", true}});
  expect_refused(spec.dump(), {"added_tokens[4].content", "5242880 bytes; expected at most 4194304 in all"});
}

// Leftmost, then longest, as the Rust library's LeftmostLongest automaton: checked against the
// definition on random texts over a small alphabet, where tokens overlap and nest.
TEST(HfTokenizerBounds, AddedTokensMatchLeftmostThenLongest) {
  std::mt19937 rng(7);
  auto random_string = [&](size_t max_length) {
    std::string s(1 + rng() % max_length, ' ');
    for (char& c : s) c = "abc"[rng() % 3];
    return s;
  };
  for (int round = 0; round < 200; ++round) {
    std::vector<std::string> tokens;
    zt::hf::AddedTokenMatcher matcher;
    for (int i = 0; i < 1 + int(rng() % 8); ++i) {
      tokens.push_back(random_string(5));
      matcher.add(tokens.back(), TokenId(i));
    }
    matcher.build();
    const std::string text = random_string(40);
    std::vector<zt::hf::Piece> pieces;
    matcher.split(text, true, pieces);
    // The definition: from the left, the first position where any token starts, the longest
    // token there (the first added among equal ones).
    std::vector<std::pair<std::string, std::optional<TokenId>>> expected;
    std::string pending;
    for (size_t at = 0; at < text.size();) {
      std::optional<TokenId> best;
      for (size_t t = 0; t < tokens.size(); ++t)
        if (text.compare(at, tokens[t].size(), tokens[t]) == 0 && (!best || tokens[t].size() > tokens[*best].size()))
          best = TokenId(t);
      if (!best) {
        pending += text[at++];
        continue;
      }
      if (!pending.empty()) expected.emplace_back(std::exchange(pending, ""), std::nullopt);
      expected.emplace_back(tokens[*best], best);
      at += tokens[*best].size();
    }
    if (!pending.empty()) expected.emplace_back(pending, std::nullopt);
    std::vector<std::pair<std::string, std::optional<TokenId>>> found;
    for (const auto& piece : pieces) found.emplace_back(piece.text, piece.added_id);
    ASSERT_EQ(found, expected) << "text " << text << ", tokens " << json(tokens).dump();
  }
}

// Whatever bytes a file holds, a refusal is one line of valid UTF-8: invalid bytes in malformed
// JSON, a quoted value cut inside a character, keys with newlines, a file name with a bad byte.
TEST(HfTokenizerErrors, EveryRefusalIsOneLineOfValidUtf8) {
  std::vector<std::string> messages;
  messages.push_back(refusal([] { HfTokenizer::from_json("{\"model\": \xff\xfe\n}", "bad.json"); }));
  json spec = bare_bpe({{"a", 0}}, json::array());
  spec["model"]["type"] = "x";
  for (int i = 0; i < 40; ++i) spec["model"]["type"] = spec["model"]["type"].get<std::string>() + "\u00e9";
  messages.push_back(refusal([&] { HfTokenizer::from_json(spec.dump(), "cut.json"); }));
  spec = bare_bpe({{"a\nb", "zero"}}, json::array());
  messages.push_back(refusal([&] { HfTokenizer::from_json(spec.dump(), "newline.json"); }));
  spec = bare_bpe({{"a", 0}}, {"a \u0001\n"});
  messages.push_back(refusal([&] { HfTokenizer::from_json(spec.dump(), "merge.json"); }));
  spec = bare_bpe({{"a", 0}}, json::array());
  spec["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(\n"}}}, {"behavior", "Isolated"}};
  messages.push_back(refusal([&] { HfTokenizer::from_json(spec.dump(), "dir\xff/tokenizer.json"); }));
  for (const std::string& message : messages) {
    EXPECT_FALSE(message.empty());
    EXPECT_TRUE(one_line_of_utf8(message)) << json(message).dump(-1, ' ', false, json::error_handler_t::replace);
  }
  EXPECT_NE(messages[2].find("model.vocab[\"a\\nb\"]"), std::string::npos) << messages[2];
  EXPECT_NE(messages[4].find("dir\\xFF/tokenizer.json"), std::string::npos) << messages[4];
}

// The shared helper: valid characters kept, bad bytes and controls escaped, cut on a boundary.
TEST(HfTokenizerErrors, PrintableUtf8EscapesWhatWouldBreakALine) {
  EXPECT_EQ(zt::printable_utf8("caf\u00e9 \U0001F600"), "caf\u00e9 \U0001F600");
  EXPECT_EQ(zt::printable_utf8("a\xff" "b\xc3"), "a\\xFFb\\xC3");
  EXPECT_EQ(zt::printable_utf8("\xed\xa0\x80"), "\\xED\\xA0\\x80");  // a surrogate
  EXPECT_EQ(zt::printable_utf8("\xc0\xaf"), "\\xC0\\xAF");           // an overlong '/'
  EXPECT_EQ(zt::printable_utf8("l1\nl2\t\x01\u0085\u2028"), "l1\\nl2\\t\\u{1}\\u{85}\\u{2028}");
  EXPECT_EQ(zt::printable_utf8("\u00e9\u00e9\u00e9", 5), "\u00e9\u00e9...");
}
