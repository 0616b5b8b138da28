// Fine-tuning examples: their storage and views, the encoding of a jsonl line, the in-memory
// reader, and the sampler of batches with the loss on the responses (zerotrain/data/tokenized_data.h).
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "data/finetune_storage.h"
#include "data/mix64.h"
#include "zerotrain/error.h"

namespace zt {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- the examples ----

FinetuneExamples::FinetuneExamples() : storage_(std::make_shared<Storage>()) { refresh(); }

// The views over all of the storage's vectors.
void FinetuneExamples::refresh() {
  const Storage& s = *storage_;
  tokens = s.tokens;
  trained = s.trained;
  starts = s.starts;
  lines = s.lines;
  first_targets = s.first_targets;
}

// Storage of this view's own, as vectors: mapped or shared storage, or a part of it, is copied.
void FinetuneExamples::own() {
  const Storage& s = *storage_;
  const bool whole = starts.data() == s.starts.data() && starts.size() == s.starts.size();
  if (!s.map && whole && storage_.use_count() == 1) return;
  auto copy = std::make_shared<Storage>();
  const int64_t b = starts.front(), e = starts.back();
  copy->tokens.assign(tokens.begin() + b, tokens.begin() + e);
  copy->trained.assign(trained.begin() + b, trained.begin() + e);
  copy->starts.clear();
  for (int64_t start : starts) copy->starts.push_back(start - b);
  copy->lines.assign(lines.begin(), lines.end());
  copy->first_targets.assign(first_targets.begin(), first_targets.end());
  storage_ = std::move(copy);
  refresh();
}

int64_t first_target_of(const uint8_t* trained, int64_t size) {
  for (int64_t k = 1; k < size; ++k)
    if (trained[k]) return k;
  return size;
}

void FinetuneExamples::add(const std::vector<uint32_t>& example_tokens, const std::vector<uint8_t>& example_trained,
                           int64_t line) {
  if (example_tokens.size() != example_trained.size())
    throw ConfigError(fmt::format("FinetuneExamples::add: {} tokens but {} trained flags", example_tokens.size(),
                                  example_trained.size()));
  own();
  Storage& s = *storage_;
  s.tokens.insert(s.tokens.end(), example_tokens.begin(), example_tokens.end());
  s.trained.insert(s.trained.end(), example_trained.begin(), example_trained.end());
  s.starts.push_back(int64_t(s.tokens.size()));
  s.lines.push_back(line);
  s.first_targets.push_back(first_target_of(example_trained.data(), int64_t(example_trained.size())));
  for (uint32_t id : example_tokens) max_id = std::max(max_id, id);
  refresh();
}

std::pair<FinetuneExamples, FinetuneExamples> FinetuneExamples::split(double val_fraction) const {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw ConfigError("split: val_fraction must be in [0, 1), found " + std::to_string(val_fraction));
  const size_t n_val = size_t(std::llround(double(count()) * val_fraction));
  const size_t n_train = size_t(count()) - n_val;
  FinetuneExamples train = *this, val = *this;
  train.source = source + " [train]";
  val.source = source + " [val]";
  train.starts = starts.first(n_train + 1);
  train.lines = lines.first(n_train);
  train.first_targets = first_targets.first(n_train);
  val.starts = starts.subspan(n_train);
  val.lines = lines.subspan(n_train);
  val.first_targets = first_targets.subspan(n_train);
  return {std::move(train), std::move(val)};
}

void FinetuneExamples::validate(int64_t vocab_size) const {
  if (int64_t(max_id) < vocab_size) return;  // no id of the storage reaches it: nothing to read
  for (int64_t i = 0; i < count(); ++i)
    for (int64_t k = starts[size_t(i)]; k < starts[size_t(i) + 1]; ++k)
      if (int64_t(tokens[size_t(k)]) >= vocab_size)
        throw DataError(fmt::format("fine-tuning data {}:{}: token id {} is outside the model's vocabulary "
                                    "(expected ids < {})",
                                    source, lines[size_t(i)], tokens[size_t(k)], vocab_size));
}

int64_t FinetuneExamples::setup_bytes() const {
  const Storage& s = *storage_;
  if (s.map) return s.map_setup_bytes;
  return int64_t(s.tokens.capacity() * sizeof(uint32_t) + s.trained.capacity() +
                 (s.starts.capacity() + s.lines.capacity() + s.first_targets.capacity()) * sizeof(int64_t));
}

FinetuneExamples FinetuneStorageAccess::mapped(std::shared_ptr<FinetuneExamples::Storage> storage,
                                               std::span<const uint32_t> tokens, std::span<const uint8_t> trained,
                                               std::span<const int64_t> starts, std::span<const int64_t> lines,
                                               std::span<const int64_t> first_targets, uint32_t max_id,
                                               std::string source) {
  FinetuneExamples out;
  out.storage_ = std::move(storage);
  out.tokens = tokens;
  out.trained = trained;
  out.starts = starts;
  out.lines = lines;
  out.first_targets = first_targets;
  out.max_id = max_id;
  out.source = std::move(source);
  return out;
}

// ---- one jsonl line ----

namespace {

void render_messages(const json& messages, ChatTemplate chat, const HfTokenizer& tokenizer, EncodedExample& out,
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
    const std::string& role = data::string_field(message, "role", file, number, "a message");
    const std::string& content = data::string_field(message, "content", file, number, "a message");
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


// A prompt/response pair: the prompt with the template's tokens (untrained), the response and the
// end token (trained).
void encode_pair(const json& object, const HfTokenizer& tokenizer, std::optional<TokenId> eos, EncodedExample& out,
                 const std::string& file, int64_t number) {
  const std::string& prompt = data::string_field(object, "prompt", file, number, "a prompt/response pair");
  const std::string& response = data::string_field(object, "response", file, number, "a prompt/response pair");
  out.append(tokenizer.encode_with_special_tokens(prompt), false);
  out.append(tokenizer.encode(response), true);
  if (eos) out.append({*eos}, true);
}

}  // namespace

EncodedExample encode_example(std::string_view line, const std::string& file, int64_t number,
                              const HfTokenizer& tokenizer, const std::string& chat_template,
                              std::optional<ChatTemplate>& chat, std::optional<TokenId> eos) {
  const json object = data::parse_line(line, file, number);
  EncodedExample example;
  try {
    if (auto messages = object.find("messages"); messages != object.end()) {
      if (!chat) chat = resolve_chat_template(chat_template, tokenizer);
      render_messages(*messages, *chat, tokenizer, example, file, number);
    } else if (object.contains("prompt") || object.contains("response")) {
      encode_pair(object, tokenizer, eos, example, file, number);
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
    throw DataError(fmt::format("{}:{}: the example has no response tokens to train on: expected a non-empty "
                                "\"response\", or data.eos_token set (an empty response then trains the end "
                                "token alone), found an empty response",
                                file, number));
  return example;
}

FinetuneExamples load_finetune_examples(const fs::path& path, const HfTokenizer& tokenizer,
                                        const std::string& chat_template, std::optional<TokenId> eos) {
  const std::string text = data::read_file(path, "data.path");
  const std::string file = path.string();
  FinetuneExamples examples;
  examples.source = file;
  std::optional<ChatTemplate> chat;
  data::for_each_line(text, [&](std::string_view line, int64_t number, size_t) {
    const EncodedExample example = encode_example(line, file, number, tokenizer, chat_template, chat, eos);
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
  // Read from the index: a mapped cache's tokens stay unread until a batch uses them.
  for (int64_t i = 0; i < examples_.count(); ++i) {
    const int64_t n = examples_.starts[size_t(i) + 1] - examples_.starts[size_t(i)];
    if (examples_.first_targets[size_t(i)] >= std::min(n, seq_len + 1))
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
