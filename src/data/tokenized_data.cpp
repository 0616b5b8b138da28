// Corpora through a Hugging Face tokenizer, their token caches, and fine-tuning examples
// (zerotrain/tokenized_data.h).
#include "zerotrain/tokenized_data.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include "data/mix64.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The cache key in the llm.c header's spare ints 3…: a mark, the layout of the key itself, then
// the 64-bit fields split in halves.
constexpr int32_t kCacheMark = 0x4B54545A;  // "ZTTK"
constexpr int32_t kCacheKeyVersion = 1;
constexpr int64_t kProgressMinBytes = 16 << 20;  // smaller corpora tokenize without progress lines

struct CacheKey {
  uint64_t tokenizer_hash = 0;
  uint64_t corpus_size = 0;
  uint64_t corpus_mtime_ns = 0;
  int32_t format = 0;
  int64_t eos = -1;  // none, else 31 bits of the token's hash

  std::vector<int32_t> header_ints() const {
    auto lo = [](uint64_t v) { return int32_t(uint32_t(v)); };
    auto hi = [](uint64_t v) { return int32_t(uint32_t(v >> 32)); };
    return {kCacheMark,         kCacheKeyVersion, lo(tokenizer_hash), hi(tokenizer_hash), lo(corpus_size),
            hi(corpus_size),    lo(corpus_mtime_ns), hi(corpus_mtime_ns), format, int32_t(eos)};
  }
};

std::string read_file(const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("{} '{}': cannot open the file", what, path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw DataError(fmt::format("{} '{}': reading the file failed", what, path.string()));
  return text.str();
}

fs::path tokenizer_file(const fs::path& path) {
  std::error_code error;
  return fs::is_directory(path, error) ? path / "tokenizer.json" : path;
}

// FNV-1a over the bytes: the tokenizer file's identity (a few MB, read once per load).
uint64_t content_hash(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// The key a cache must carry; stat()s the corpus.
CacheKey key_of(const fs::path& corpus, CorpusFormat format, uint64_t tokenizer_hash, const std::string& eos_token) {
  struct stat st {};
  if (::stat(corpus.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    throw DataError(fmt::format("data.path: expected a readable file, found none at '{}'", corpus.string()));
  CacheKey key;
  key.tokenizer_hash = tokenizer_hash;
  key.corpus_size = uint64_t(st.st_size);
  key.corpus_mtime_ns = uint64_t(st.st_mtim.tv_sec) * 1'000'000'000ULL + uint64_t(st.st_mtim.tv_nsec);
  key.format = int32_t(format);
  key.eos = eos_token.empty() ? -1 : int64_t(uint32_t(content_hash(eos_token)) & 0x7fffffff);
  return key;
}

// Whether `cache` exists and carries `key` (its first 1024 bytes only).
bool cache_matches(const fs::path& cache, const CacheKey& key) {
  std::ifstream in(cache, std::ios::binary);
  if (!in) return false;
  int32_t header[256] = {};
  in.read(reinterpret_cast<char*>(header), sizeof header);
  if (in.gcount() != sizeof header || header[0] != 20240520) return false;
  const std::vector<int32_t> want = key.header_ints();
  return std::equal(want.begin(), want.end(), header + 3);
}

// Prints "tokenizing FILE: x of y MiB (p%)" at most every 10% and every 5 s.
class Progress {
 public:
  Progress(bool enabled, const fs::path& file, int64_t total)
      : enabled_(enabled && total >= kProgressMinBytes), file_(file.string()), total_(total) {}
  void update(int64_t done) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    const int64_t tenth = done * 10 / std::max<int64_t>(1, total_);
    if (tenth <= last_tenth_ && now - last_ < std::chrono::seconds(5)) return;
    last_tenth_ = tenth;
    last_ = now;
    std::fprintf(stderr, "tokenizing %s: %.0f of %.0f MiB (%.0f%%)\n", file_.c_str(), double(done) / (1 << 20),
                 double(total_) / (1 << 20), 100.0 * double(done) / double(std::max<int64_t>(1, total_)));
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  std::string file_;
  int64_t total_;
  int64_t last_tenth_ = 0;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// A printable ASCII character other than space: never part of a whitespace run, in any encoding
// of the regexes' \s (a byte >= 0x80 may begin or end a Unicode space such as U+00A0 or U+3000).
bool is_ascii_graphic(char c) { return c > 0x20 && c < 0x7f; }

// The end of the piece starting at `from`: just after the first newline at or past from + target
// that stands alone between two printable ASCII characters (the end of the text when there is
// none). Byte-level BPE's patterns split there in the whole text as in the piece: the newline is a
// piece of its own and the next character starts a new one. (After a longer whitespace run, e.g.
// "\n\n", they would not: GPT-2's `\s+(?!\S)` leaves the run's last character to the next piece
// in the whole text, but takes the whole run at the end of a piece.)
size_t piece_end(std::string_view text, size_t from, size_t target) {
  for (size_t i = std::max<size_t>(from + target, 2); i < text.size(); ++i)
    if (text[i - 1] == '\n' && is_ascii_graphic(text[i - 2]) && is_ascii_graphic(text[i])) return i;
  return text.size();
}

std::vector<TokenId> tokenize_text(std::string_view text, const HfTokenizer& tokenizer, const TokenizeOptions& options,
                                   Progress& progress) {
  std::vector<TokenId> ids;
  const size_t target = size_t(std::max<int64_t>(1, options.text_piece_bytes));
  for (size_t at = 0; at < text.size();) {
    const size_t end = piece_end(text, at, target);
    const std::vector<TokenId> piece = tokenizer.encode(text.substr(at, end - at));
    ids.insert(ids.end(), piece.begin(), piece.end());
    at = end;
    progress.update(int64_t(at));
  }
  return ids;
}

// The JSON object of one jsonl line, or a DataError naming the file and line.
json parse_line(std::string_view line, const std::string& file, int64_t number) {
  json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded())
    throw DataError(fmt::format("{}:{}: expected one JSON object per line, found text that is not JSON", file, number));
  if (!value.is_object())
    throw DataError(fmt::format("{}:{}: expected a JSON object per line, found a JSON {}", file, number,
                                value.type_name()));
  return value;
}

const std::string& string_field(const json& object, const char* key, const std::string& file, int64_t number,
                                const std::string& what) {
  auto it = object.find(key);
  if (it == object.end())
    throw DataError(fmt::format("{}:{}: expected {} with a string \"{}\", found no \"{}\"", file, number, what, key, key));
  if (!it->is_string())
    throw DataError(fmt::format("{}:{}: \"{}\" must be a string, found a JSON {}", file, number, key, it->type_name()));
  return it->get_ref<const std::string&>();
}

// Calls fn(line, number) for every non-blank line of `text`.
template <typename Fn>
void for_each_line(std::string_view text, Fn&& fn) {
  int64_t number = 0;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    ++number;
    std::string_view line = text.substr(at, end - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const bool blank = line.find_first_not_of(" \t") == std::string_view::npos;
    if (!blank) fn(line, number, end);
    at = end + 1;
  }
}

std::vector<TokenId> tokenize_jsonl(std::string_view text, const std::string& file, const HfTokenizer& tokenizer,
                                    std::optional<TokenId> eos, Progress& progress) {
  std::vector<TokenId> ids;
  for_each_line(text, [&](std::string_view line, int64_t number, size_t end) {
    const json object = parse_line(line, file, number);
    const std::string& document = string_field(object, "text", file, number, "a document");
    std::vector<TokenId> doc;
    try {
      doc = tokenizer.encode_with_special_tokens(document);
    } catch (const DataError& e) {
      throw DataError(fmt::format("{}:{}: {}", file, number, e.what()));
    }
    ids.insert(ids.end(), doc.begin(), doc.end());
    if (eos) ids.push_back(*eos);
    progress.update(int64_t(end));
  });
  return ids;
}

// Writes `ids` as an llm.c token file carrying `key`, through a temporary file renamed into place.
void write_cache(const fs::path& cache, const std::vector<TokenId>& ids, bool wide, const CacheKey& key) {
  const fs::path temporary = cache.string() + fmt::format(".tmp-{}", ::getpid());
  const std::vector<int32_t> extra = key.header_ints();
  try {
    if (wide) {
      TokenDataset::write_bin_file(temporary, std::span<const uint32_t>(ids), extra);
    } else {
      std::vector<uint16_t> narrow(ids.begin(), ids.end());
      TokenDataset::write_bin_file(temporary, narrow, BinFormat::LlmC);
      // The uint16 writer leaves the spare ints zero: put the key there.
      std::fstream patch(temporary, std::ios::binary | std::ios::in | std::ios::out);
      patch.seekp(3 * sizeof(int32_t));
      patch.write(reinterpret_cast<const char*>(extra.data()), std::streamsize(extra.size() * sizeof(int32_t)));
      patch.close();
      if (!patch) throw DataError(fmt::format("error writing token cache '{}'", temporary.string()));
    }
    std::error_code error;
    fs::rename(temporary, cache, error);
    if (error)
      throw DataError(fmt::format("cannot move the token cache '{}' into place as '{}': {}", temporary.string(),
                                  cache.string(), error.message()));
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

}  // namespace

TokenizedCorpus load_tokenized_corpus(const fs::path& corpus, CorpusFormat format, const fs::path& tokenizer_path,
                                      const TokenizeOptions& options) {
  const fs::path tokenizer_json = tokenizer_file(tokenizer_path);
  const std::string tokenizer_text = read_file(tokenizer_json, "data.tokenizer");
  const CacheKey key = key_of(corpus, format, content_hash(tokenizer_text), options.eos_token);
  const fs::path dir = options.cache_dir.empty() ? corpus.parent_path() : options.cache_dir;
  const fs::path cache =
      (dir.empty() ? fs::path(".") : dir) /
      fmt::format("{}.{:08x}.tokens.bin", corpus.filename().string(), uint32_t(key.tokenizer_hash));
  TokenizedCorpus out;
  out.cache_file = cache;
  if (cache_matches(cache, key)) {
    out.tokens = TokenDataset::from_bin_file(cache);
    return out;
  }
  const HfTokenizer tokenizer = HfTokenizer::from_json(tokenizer_text, tokenizer_json.string());
  std::optional<TokenId> eos;
  if (!options.eos_token.empty()) eos = require_token(tokenizer, options.eos_token, "data.eos_token");
  const std::string text = read_file(corpus, "data.path");
  Progress progress(options.progress, corpus, int64_t(text.size()));
  std::vector<TokenId> ids = format == CorpusFormat::Text
                                 ? tokenize_text(text, tokenizer, options, progress)
                                 : tokenize_jsonl(text, corpus.string(), tokenizer, eos, progress);
  if (ids.empty()) throw DataError(fmt::format("data.path '{}': no tokens (the corpus is empty)", corpus.string()));
  if (!options.cache_dir.empty()) {
    std::error_code error;
    fs::create_directories(options.cache_dir, error);
    if (error)
      throw DataError(fmt::format("data.cache_dir: cannot create '{}': {}", options.cache_dir.string(),
                                  error.message()));
  }
  write_cache(cache, ids, tokenizer.vocab_size() > 65536, key);
  out.tokens = TokenDataset::from_bin_file(cache);
  out.built = true;
  return out;
}

// ---- fine-tuning examples ----

TokenId require_token(const HfTokenizer& tokenizer, const std::string& token, const std::string& key) {
  if (auto id = tokenizer.token_to_id(token)) return *id;
  throw DataError(fmt::format("{}: expected a token of the tokenizer {}, found \"{}\", which it does not have", key,
                              tokenizer.source(), token));
}

ChatTemplate resolve_chat_template(const std::string& name, const HfTokenizer& tokenizer) {
  auto has_all = [&](std::initializer_list<const char*> tokens) {
    for (const char* t : tokens)
      if (!tokenizer.token_to_id(t)) return std::string(t);
    return std::string();
  };
  const auto chatml = {"<|im_start|>", "<|im_end|>"};
  const auto llama3 = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  if (name == "chatml" || name == "llama3") {
    const std::string missing = has_all(name == "chatml" ? chatml : llama3);
    if (!missing.empty())
      throw DataError(fmt::format("data.chat_template \"{}\": the tokenizer {} has no token {}", name,
                                  tokenizer.source(), missing));
    return name == "chatml" ? ChatTemplate::ChatML : ChatTemplate::Llama3;
  }
  if (name != "auto")
    throw ConfigError(fmt::format("data.chat_template: expected \"auto\", \"chatml\" or \"llama3\", found \"{}\"", name));
  if (has_all(chatml).empty()) return ChatTemplate::ChatML;
  if (has_all(llama3).empty()) return ChatTemplate::Llama3;
  throw DataError(fmt::format(
      "data.chat_template \"auto\": the tokenizer {} has neither ChatML's <|im_start|>/<|im_end|> nor Llama 3's "
      "<|start_header_id|>/<|end_header_id|>/<|eot_id|>; chat messages need one of them",
      tokenizer.source()));
}

void FinetuneExamples::add(const std::vector<uint32_t>& example_tokens, const std::vector<uint8_t>& example_trained,
                           int64_t line) {
  tokens.insert(tokens.end(), example_tokens.begin(), example_tokens.end());
  trained.insert(trained.end(), example_trained.begin(), example_trained.end());
  starts.push_back(int64_t(tokens.size()));
  lines.push_back(line);
}

std::pair<FinetuneExamples, FinetuneExamples> FinetuneExamples::split(double val_fraction) const {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw ConfigError("split: val_fraction must be in [0, 1), found " + std::to_string(val_fraction));
  const int64_t n_val = std::llround(double(count()) * val_fraction);
  const int64_t n_train = count() - n_val;
  FinetuneExamples train, val;
  train.source = source + " [train]";
  val.source = source + " [val]";
  for (int64_t i = 0; i < count(); ++i) {
    FinetuneExamples& to = i < n_train ? train : val;
    const auto b = size_t(starts[size_t(i)]), e = size_t(starts[size_t(i) + 1]);
    to.tokens.insert(to.tokens.end(), tokens.begin() + long(b), tokens.begin() + long(e));
    to.trained.insert(to.trained.end(), trained.begin() + long(b), trained.begin() + long(e));
    to.starts.push_back(int64_t(to.tokens.size()));
    to.lines.push_back(lines[size_t(i)]);
  }
  return {std::move(train), std::move(val)};
}

void FinetuneExamples::validate(int64_t vocab_size) const {
  for (int64_t i = 0; i < count(); ++i)
    for (int64_t k = starts[size_t(i)]; k < starts[size_t(i) + 1]; ++k)
      if (int64_t(tokens[size_t(k)]) >= vocab_size)
        throw DataError(fmt::format("fine-tuning data {}:{}: token id {} is outside the model's vocabulary "
                                    "(expected ids < {})",
                                    source, lines[size_t(i)], tokens[size_t(k)], vocab_size));
}

namespace {

// One example being assembled: ids and whether each is trained.
struct ExampleBuilder {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;
  void append(const std::vector<TokenId>& ids, bool train) {
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    trained.insert(trained.end(), ids.size(), uint8_t(train));
  }
};

void render_messages(const json& messages, ChatTemplate chat, const HfTokenizer& tokenizer, ExampleBuilder& out,
                     const std::string& file, int64_t number) {
  if (!messages.is_array() || messages.empty())
    throw DataError(fmt::format("{}:{}: \"messages\" must be a non-empty array of {{\"role\", \"content\"}} objects, "
                                "found {}",
                                file, number, messages.is_array() ? "an empty array" : messages.type_name()));
  if (chat == ChatTemplate::Llama3) out.append({*tokenizer.token_to_id("<|begin_of_text|>")}, false);
  bool any_assistant = false;
  for (const json& message : messages) {
    if (!message.is_object())
      throw DataError(fmt::format("{}:{}: each message must be an object, found a JSON {}", file, number,
                                  message.type_name()));
    const std::string& role = string_field(message, "role", file, number, "a message");
    const std::string& content = string_field(message, "content", file, number, "a message");
    const bool assistant = role == "assistant";
    any_assistant |= assistant;
    if (chat == ChatTemplate::ChatML) {
      out.append(tokenizer.encode("<|im_start|>" + role + "\n"), false);
      out.append(tokenizer.encode(content), assistant);
      out.append({*tokenizer.token_to_id("<|im_end|>")}, assistant);
      out.append(tokenizer.encode("\n"), false);
    } else {
      out.append(tokenizer.encode("<|start_header_id|>" + role + "<|end_header_id|>\n\n"), false);
      out.append(tokenizer.encode(content), assistant);
      out.append({*tokenizer.token_to_id("<|eot_id|>")}, assistant);
    }
  }
  if (!any_assistant)
    throw DataError(fmt::format("{}:{}: expected at least one message with role \"assistant\" (the trained part), "
                                "found none",
                                file, number));
}

}  // namespace

FinetuneExamples load_finetune_examples(const fs::path& path, const HfTokenizer& tokenizer,
                                        const std::string& chat_template, std::optional<TokenId> eos) {
  const std::string text = read_file(path, "data.path");
  const std::string file = path.string();
  FinetuneExamples examples;
  examples.source = file;
  std::optional<ChatTemplate> chat;
  for_each_line(text, [&](std::string_view line, int64_t number, size_t) {
    const json object = parse_line(line, file, number);
    ExampleBuilder example;
    try {
      if (auto messages = object.find("messages"); messages != object.end()) {
        if (!chat) chat = resolve_chat_template(chat_template, tokenizer);
        render_messages(*messages, *chat, tokenizer, example, file, number);
      } else if (object.contains("prompt") || object.contains("response")) {
        const std::string& prompt = string_field(object, "prompt", file, number, "a prompt/response pair");
        const std::string& response = string_field(object, "response", file, number, "a prompt/response pair");
        example.append(tokenizer.encode_with_special_tokens(prompt), false);
        example.append(tokenizer.encode(response), true);
        if (eos) example.append({*eos}, true);
      } else {
        throw DataError(fmt::format("{}:{}: expected {{\"prompt\", \"response\"}} or {{\"messages\": [...]}}, "
                                    "found neither key",
                                    file, number));
      }
    } catch (const DataError& e) {
      const std::string what = e.what();
      if (what.starts_with(file + ":")) throw;
      throw DataError(fmt::format("{}:{}: {}", file, number, what));  // the tokenizer's own message
    }
    if (std::find(example.trained.begin(), example.trained.end(), 1) == example.trained.end())
      throw DataError(fmt::format("{}:{}: the example has no response tokens to train on (an empty response)", file,
                                  number));
    examples.add(example.tokens, example.trained, number);
  });
  if (examples.count() == 0)
    throw DataError(fmt::format("data.path '{}': expected fine-tuning examples, found none", file));
  return examples;
}

// ---- the sampler ----

FinetuneSampler::FinetuneSampler(FinetuneExamples examples, int64_t seq_len, int64_t micro_batch, int world_size,
                                 int rank, uint64_t seed, bool pack)
    : examples_(std::move(examples)),
      seq_len_(seq_len),
      micro_batch_(micro_batch),
      world_size_(world_size),
      rank_(rank),
      seed_(seed),
      pack_(pack) {
  if (seq_len <= 0) throw ConfigError("FinetuneSampler: seq_len must be > 0, found " + std::to_string(seq_len));
  if (micro_batch <= 0)
    throw ConfigError("FinetuneSampler: micro_batch must be > 0, found " + std::to_string(micro_batch));
  if (world_size <= 0 || rank < 0 || rank >= world_size)
    throw ConfigError(fmt::format("FinetuneSampler: rank must be in [0, world_size), found rank {} of {}", rank,
                                  world_size));
  if (examples_.count() == 0)
    throw DataError(fmt::format("fine-tuning data {}: expected at least one example, found none", examples_.source));
  // An example whose window holds no trained target would make a batch of it alone a 0/0 loss.
  for (int64_t i = 0; i < examples_.count(); ++i) {
    const int64_t b = examples_.starts[size_t(i)];
    const int64_t e = std::min(examples_.starts[size_t(i) + 1], b + seq_len + 1);
    bool any = false;
    for (int64_t k = b + 1; k < e && !any; ++k) any = examples_.trained[size_t(k)] != 0;
    if (!any)
      throw DataError(fmt::format("fine-tuning data {}:{}: no response token within the first {} tokens (the "
                                  "sequence length + 1); expected the prompt to leave room for the response",
                                  examples_.source, examples_.lines[size_t(i)], seq_len + 1));
  }
}

int64_t FinetuneSampler::example_of(int64_t step, int64_t global_sample) const {
  const uint64_t h = mix64(mix64(mix64(seed_) ^ uint64_t(step)) ^ uint64_t(global_sample));
  return int64_t(h % uint64_t(examples_.count()));
}

Batch FinetuneSampler::make_batch(const std::function<int64_t(int64_t i)>& example_of_row) const {
  auto inputs = torch::zeros({micro_batch_, seq_len_}, torch::kLong);
  auto targets = torch::full({micro_batch_, seq_len_}, int64_t{-100}, torch::kLong);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* tg = targets.data_ptr<int64_t>();
  for (int64_t row = 0; row < micro_batch_; ++row) {
    const int64_t i = example_of_row(row);
    const int64_t b = examples_.starts[size_t(i)];
    const int64_t n = std::min(examples_.starts[size_t(i) + 1] - b, seq_len_ + 1);
    for (int64_t t = 0; t < n; ++t) {
      if (t < seq_len_) in[row * seq_len_ + t] = examples_.tokens[size_t(b + t)];
      if (t > 0 && examples_.trained[size_t(b + t)]) tg[row * seq_len_ + t - 1] = examples_.tokens[size_t(b + t)];
    }
  }
  return {std::move(inputs), std::move(targets), /*segments=*/{}};
}

Batch FinetuneSampler::make_packed_batch(int64_t step, int64_t first_sample) const {
  auto inputs = torch::zeros({micro_batch_, seq_len_}, torch::kLong);
  auto targets = torch::full({micro_batch_, seq_len_}, int64_t{-100}, torch::kLong);
  auto segments = torch::full({micro_batch_, seq_len_}, int64_t{-1}, torch::kLong);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* tg = targets.data_ptr<int64_t>();
  int64_t* sg = segments.data_ptr<int64_t>();
  for (int64_t row = 0; row < micro_batch_; ++row) {
    const int64_t g = first_sample + row;
    const uint64_t row_hash = mix64(mix64(mix64(seed_) ^ uint64_t(step)) ^ uint64_t(g));
    int64_t used = 0;  // positions of the row taken
    // The first example is the unpacked row's; each takes at least one position (the constructor
    // checked a trained target within it), so the row fills within seq_len examples.
    for (int64_t k = 0;; ++k) {
      const int64_t i =
          k == 0 ? example_of(step, g) : int64_t(mix64(row_hash ^ uint64_t(k)) % uint64_t(examples_.count()));
      const int64_t b = examples_.starts[size_t(i)];
      const int64_t n = std::min(examples_.starts[size_t(i) + 1] - b, seq_len_ + 1);
      if (used + n - 1 > seq_len_) break;
      int64_t* row_in = in + row * seq_len_ + used;
      int64_t* row_tg = tg + row * seq_len_ + used;
      int64_t* row_sg = sg + row * seq_len_ + used;
      for (int64_t t = 0; t + 1 < n; ++t) {
        row_in[t] = examples_.tokens[size_t(b + t)];
        row_sg[t] = k;
        if (examples_.trained[size_t(b + t + 1)]) row_tg[t] = examples_.tokens[size_t(b + t + 1)];
      }
      used += n - 1;
      if (used == seq_len_) break;
    }
  }
  return {std::move(inputs), std::move(targets), std::move(segments)};
}

Batch FinetuneSampler::batch(int64_t step, int64_t micro_step) const {
  if (step < 0 || micro_step < 0)
    throw ConfigError(fmt::format("FinetuneSampler::batch: step and micro_step must be >= 0, found {}, {}", step,
                                  micro_step));
  const int64_t base = micro_step * world_size_ * micro_batch_ + rank_ * micro_batch_;
  if (pack_) return make_packed_batch(step, base);
  return make_batch([&](int64_t row) { return example_of(step, base + row); });
}

int64_t FinetuneSampler::eval_batches() const {
  const int64_t per_index = int64_t(world_size_) * micro_batch_;
  return std::max<int64_t>(1, (examples_.count() + per_index - 1) / per_index);
}

Batch FinetuneSampler::eval_batch(int64_t index) const {
  if (index < 0) throw ConfigError("FinetuneSampler::eval_batch: index must be >= 0, found " + std::to_string(index));
  const int64_t base = (index * world_size_ + rank_) * micro_batch_;
  return make_batch([&](int64_t row) { return (base + row) % examples_.count(); });
}

}  // namespace zt
