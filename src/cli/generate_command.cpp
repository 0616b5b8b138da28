// `zerotrain generate`: a trained model continues a prompt, token by token with a key/value cache
// (zerotrain/models/generation.h), on this process alone, the text streamed to stdout as it comes.
#include "cli/cli.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_system.h"
#include "checkpoint/hf.h"
#include "zerotrain/error.h"
#include "zerotrain/models/generation.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/data/tokenizer.h"

namespace zt::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The model to generate with, whole, and where its tokenizer and end-of-sequence ids may be read.
struct LoadedModel {
  std::shared_ptr<GPTImpl> gpt;
  std::shared_ptr<LlamaImpl> llama;
  std::string tokenizer;        // its tokenizer.json or a directory holding one; "": none known (bytes)
  std::string tokenizer_named;  // "of DIR", "that checkpoint X names as its KEY 'P'": for errors
  std::string stop_ids_dir;     // where generation_config.json / config.json give the eos ids; "": none
  std::string description;

  int64_t vocab_size() const { return llama ? llama->config().vocab_size : gpt->config().vocab_size; }
};

bool holds_tokenizer(const std::string& dir) { return fs::exists(fs::path(dir) / "tokenizer.json"); }

void copy_parameters(torch::nn::Module& model, const std::function<torch::Tensor(const std::string&)>& value_of) {
  torch::NoGradGuard no_grad;
  for (auto& named : model.named_parameters(/*recurse=*/true)) {
    const torch::Tensor value = value_of(named.key());
    if (value.sizes() != named.value().sizes())
      throw DataError(fmt::format("generate: tensor '{}' has shape {}, the model expects {}", named.key(),
                                  c10::str(value.sizes()), c10::str(named.value().sizes())));
    named.value().copy_(value);
  }
}

// A LlamaForCausalLM or Qwen2ForCausalLM directory of transformers.
LoadedModel load_hf_directory(const std::string& dir) {
  const LlamaConfig config = read_llama_hf_config(dir, "generate SOURCE");
  LoadedModel loaded;
  // Opened (every tensor there with its shape) before the model is built.
  HfModelReader reader(dir, config, "generate SOURCE");
  loaded.llama = Llama(config).ptr();
  copy_parameters(*loaded.llama, [&](const std::string& name) {
    torch::Tensor values = torch::empty(loaded.llama->named_parameters()[name].sizes(), torch::kFloat32);
    reader.read(name, values.sizes().vec(), 0, values.numel(), values.data_ptr<float>());
    return values;
  });
  // A directory without tokenizer.json (an export of a run on bytes) generates bytes.
  if (holds_tokenizer(dir)) loaded.tokenizer = dir;
  loaded.tokenizer_named = fmt::format("of the model directory '{}'", dir);
  loaded.stop_ids_dir = dir;
  loaded.description = fmt::format("{} from '{}'", llama_hf_architecture(config), dir);
  return loaded;
}

std::string saved_string(const std::map<std::string, std::string>& resolved, const std::string& key) {
  auto it = resolved.find(key);
  if (it == resolved.end()) return "";
  try {
    const json value = json::parse(it->second);
    return value.is_string() ? value.get<std::string>() : "";
  } catch (const json::exception&) {
    return "";
  }
}

// The tokenizer a checkpoint names: the one the run read its data with (data.tokenizer), else the
// one beside the weights it started from (the Llama's model.init_from or model.config_from). Once
// named it must be found: moved away, the text would silently become bytes. A directory that is
// there without a tokenizer.json is a byte model's (an export of a run on bytes).
void set_checkpoint_tokenizer(LoadedModel& loaded, const std::map<std::string, std::string>& resolved,
                              const std::string& source_dir, const std::string& where) {
  if (const std::string data_tokenizer = saved_string(resolved, "data.tokenizer"); !data_tokenizer.empty()) {
    loaded.tokenizer = data_tokenizer;
    loaded.tokenizer_named = fmt::format("that checkpoint {} names as its data.tokenizer '{}'", where, data_tokenizer);
    if (fs::is_directory(data_tokenizer)) loaded.stop_ids_dir = data_tokenizer;
    return;
  }
  if (source_dir.empty()) return;
  const char* key = saved_string(resolved, "model.init_from").empty() ? "model.config_from" : "model.init_from";
  loaded.tokenizer_named = fmt::format("that checkpoint {} names as its {} '{}'", where, key, source_dir);
  if (!fs::is_directory(source_dir) || holds_tokenizer(source_dir)) loaded.tokenizer = source_dir;
  if (fs::is_directory(source_dir)) loaded.stop_ids_dir = source_dir;
}

// A zerotrain checkpoint of a GPT or a Llama (its weights gathered whole from the rank files).
LoadedModel load_checkpoint(const std::string& dir, const std::string& tag) {
  CheckpointModel checkpoint(dir, tag);
  const auto& resolved = checkpoint.configuration();
  const std::string type = model_type_from_resolved(resolved, checkpoint.where());
  LoadedModel loaded;
  std::string source_dir;
  if (type == "llama") {
    loaded.llama =
        Llama(llama_config_from_resolved(resolved, checkpoint.where(), source_dir, carried_hf_config(checkpoint.scalars())))
            .ptr();
  } else if (type == "gpt") {
    loaded.gpt = GPT(gpt_config_from_resolved(resolved, checkpoint.where())).ptr();
  } else {
    throw ConfigError(fmt::format("generate: {} holds a {} model; only the decoders (gpt, llama) generate text",
                                  checkpoint.where(), type));
  }
  torch::nn::Module& model = loaded.llama ? static_cast<torch::nn::Module&>(*loaded.llama) : *loaded.gpt;
  copy_parameters(model, [&](const std::string& name) { return checkpoint.read(name); });
  set_checkpoint_tokenizer(loaded, resolved, source_dir, checkpoint.where());
  loaded.description = fmt::format("{} checkpoint {}", type, checkpoint.root());
  return loaded;
}

// The end-of-sequence ids of a Hugging Face directory: generation_config.json's eos_token_id, else
// config.json's (an id or a list of ids), as transformers' generate() reads them.
std::vector<int64_t> stop_ids_of(const std::string& dir) {
  for (const char* file : {"generation_config.json", "config.json"}) {
    const fs::path path = fs::path(dir) / file;
    if (dir.empty() || !fs::exists(path)) continue;
    std::ifstream in(path);
    const json parsed = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("eos_token_id")) continue;
    const json& eos = parsed["eos_token_id"];
    std::vector<int64_t> ids;
    if (eos.is_number_integer()) ids.push_back(eos.get<int64_t>());
    if (eos.is_array())
      for (const json& id : eos)
        if (id.is_number_integer()) ids.push_back(id.get<int64_t>());
    return ids;
  }
  return {};
}

// Text in and out: the Hugging Face tokenizer of the model, or bytes (id = byte value) when the
// model was trained on bytes and no tokenizer is known.
class TextCodec {
 public:
  TextCodec() = default;
  explicit TextCodec(HfTokenizer tokenizer) : tokenizer_(std::move(tokenizer)) {}
  std::vector<int64_t> encode(const std::string& text) const {
    if (!tokenizer_) {
      std::vector<int64_t> bytes;
      for (unsigned char byte : text) bytes.push_back(byte);
      return bytes;
    }
    const auto ids = tokenizer_->encode_with_special_tokens(text);
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    if (!tokenizer_) {
      std::string text;
      for (int64_t id : ids) text += id >= 0 && id < 256 ? std::string(1, char(id)) : std::string("\xEF\xBF\xBD");
      return text;
    }
    const std::vector<TokenId> narrow(ids.begin(), ids.end());
    return tokenizer_->decode(narrow, /*skip_special_tokens=*/true);
  }
  std::string name() const { return tokenizer_ ? "its tokenizer" : "bytes"; }
  bool is_bytes() const { return !tokenizer_; }
  // The ids it can decode: its vocabulary, or the 256 byte values.
  int64_t vocab_size() const { return tokenizer_ ? int64_t(tokenizer_->vocab_size()) : 256; }
  std::string source() const { return tokenizer_ ? "'" + tokenizer_->source() + "'" : "bytes"; }

 private:
  std::optional<HfTokenizer> tokenizer_;
};

// Prints the new text as tokens arrive: the decoded whole (prompt and new tokens, so that a
// tokenizer's spacing at the seam is kept) past what is already printed, held back while it ends in
// an incomplete UTF-8 character (decoded as U+FFFD).
class TextStream {
 public:
  TextStream(const TextCodec& codec, std::vector<int64_t> prompt)
      : codec_(codec), ids_(std::move(prompt)), prompt_text_(codec.decode(ids_)) {}
  void add(int64_t id) {
    ids_.push_back(id);
    const std::string whole = codec_.decode(ids_);
    if (whole.ends_with("\xEF\xBF\xBD") || whole.compare(0, prompt_text_.size(), prompt_text_) != 0) return;
    const std::string text = whole.substr(prompt_text_.size());
    if (text.compare(0, printed_.size(), printed_) != 0) return;
    std::cout << text.substr(printed_.size()) << std::flush;
    printed_ = text;
  }
  std::string text() const {
    const std::string whole = codec_.decode(ids_);
    return whole.compare(0, prompt_text_.size(), prompt_text_) == 0 ? whole.substr(prompt_text_.size()) : whole;
  }
  void finish() {
    const std::string all = text();
    if (all.compare(0, printed_.size(), printed_) == 0) std::cout << all.substr(printed_.size());
    std::cout << "\n" << std::flush;
  }

 private:
  const TextCodec& codec_;
  std::vector<int64_t> ids_;
  std::string prompt_text_, printed_;
};

// The text's codec: --tokenizer; else the tokenizer the model names, which must then be found;
// else bytes.
TextCodec open_codec(const GenerateArgs& args, const LoadedModel& model) {
  if (!args.tokenizer.empty()) return TextCodec(HfTokenizer::from_file(args.tokenizer));
  if (model.tokenizer.empty()) return TextCodec();
  try {
    return TextCodec(HfTokenizer::from_file(model.tokenizer));
  } catch (const DataError& e) {
    throw DataError(fmt::format("generate: cannot read the tokenizer {} ({}); give the one the model was trained "
                                "with as --tokenizer PATH",
                                model.tokenizer_named, one_line(e.what())));
  }
}

// The ids generation may choose. A model's vocabulary may be padded beyond its tokenizer's (to a
// multiple of 64, or by the export of a bytes run): the ids past the tokenizer's are never chosen,
// since they decode to nothing. A tokenizer larger than the model's vocabulary is the wrong one: it
// would give the model ids it has no embedding for. (Bytes are checked id by id in the prompt: a
// model trained on ASCII may have fewer than 256 ids.)
int64_t vocabulary_limit(const LoadedModel& model, const TextCodec& codec) {
  const int64_t model_vocab = model.vocab_size(), codec_vocab = codec.vocab_size();
  if (!codec.is_bytes() && codec_vocab > model_vocab)
    throw ConfigError(fmt::format("generate: the tokenizer {} has {} ids, the model's vocabulary {}: expected a "
                                  "tokenizer of at most the model's vocabulary (give the one it was trained with "
                                  "as --tokenizer PATH)",
                                  codec.source(), codec_vocab, model_vocab));
  if (codec_vocab >= model_vocab) return 0;
  std::cerr << fmt::format("zerotrain: note: the model's vocabulary has {} ids, {} {}: ids {} and above are never "
                           "chosen\n",
                           model_vocab, codec.is_bytes() ? "the text is bytes with" : "its tokenizer", codec_vocab,
                           codec_vocab);
  return codec_vocab;
}

// --summary is checked before the model is read: a path that cannot be written fails now, not
// after the run. It is replaced by a rename, so it must be a regular file when it exists (a rename
// over a device such as /dev/null would replace the device).
void check_summary_path(const std::string& path) {
  check_output_file(path, "--summary", /*creates_parents=*/true);
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_regular_file(path, ec))
    throw ConfigError(fmt::format("--summary: expected a regular file (it is replaced whole), found '{}', which is "
                                  "something else",
                                  path));
}

bool is_valid_utf8(const std::string& text) {
  try {
    (void)json(text).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

// `text` into `path` whole or not at all: written beside it under a temporary name, flushed, then
// renamed over it, so that a failure leaves an earlier file as it was.
void write_atomically(const fs::path& path, const std::string& text) {
  FileSystem& files = FileSystem::real();
  const fs::path parent = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  files.create_directories(parent);
  const fs::path temporary = parent / fmt::format(".{}.tmp-{}", path.filename().string(), ::getpid());
  try {
    const auto out = files.create(temporary);
    out->write_at(text.data(), int64_t(text.size()), 0);
    out->sync();
    out->close();
    files.rename(temporary, path);
  } catch (...) {
    std::error_code ec;
    fs::remove(temporary, ec);
    throw;
  }
}

// The summary: the ids, the text and the time. JSON strings are UTF-8: new bytes that are not (a
// byte-level model may stop inside a character) are kept whole in text_bytes, text then holding
// U+FFFD in place of each invalid sequence.
void write_summary(const std::string& path, const std::vector<int64_t>& prompt, const std::vector<int64_t>& generated,
                   const std::string& text, double seconds) {
  json summary = {{"prompt_ids", prompt}, {"new_ids", generated}, {"text", text}, {"seconds", seconds}};
  if (!is_valid_utf8(text)) summary["text_bytes"] = std::vector<uint8_t>(text.begin(), text.end());
  write_atomically(path, summary.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
}

}  // namespace

int run_generate(const GenerateArgs& args) {
  if (!fs::is_directory(args.source))
    throw ConfigError(fmt::format("generate: expected a zerotrain checkpoint directory or a Hugging Face model "
                                  "directory, found no directory '{}'",
                                  args.source));
  GenerationOptions options;
  options.max_new_tokens = args.max_new_tokens;
  options.temperature = args.temperature;
  options.top_p = args.top_p;
  options.seed = args.seed;
  // What can be refused without the model is refused before it is read.
  check_generation_options(options);
  if (!args.summary.empty()) check_summary_path(args.summary);
  const bool hf_dir = fs::exists(fs::path(args.source) / "config.json");
  torch::manual_seed(args.seed);  // the model's construction before its weights are copied in
  LoadedModel model = hf_dir ? load_hf_directory(args.source) : load_checkpoint(args.source, args.tag);
  const TextCodec codec = open_codec(args, model);
  options.vocab_limit = vocabulary_limit(model, codec);
  options.stop_ids = stop_ids_of(model.stop_ids_dir);
  const std::vector<int64_t> prompt = codec.encode(args.prompt);
  std::cerr << fmt::format("zerotrain: generating with the {}, text through {}, {}\n", model.description,
                           codec.name(),
                           options.temperature == 0.0 ? std::string("greedy")
                                                      : fmt::format("temperature {} top_p {} seed {}",
                                                                    options.temperature, options.top_p, options.seed));
  TextStream stream(codec, prompt);
  const auto started = std::chrono::steady_clock::now();
  const std::vector<int64_t> generated =
      model.llama ? generate(*model.llama, prompt, options, [&](int64_t id) { stream.add(id); })
                  : generate(*model.gpt, prompt, options, [&](int64_t id) { stream.add(id); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  stream.finish();
  std::cerr << fmt::format("zerotrain: {} tokens after a prompt of {} in {:.2f} s ({:.1f} tokens/s)\n",
                           generated.size(), prompt.size(), seconds, double(generated.size()) / std::max(seconds, 1e-9));
  if (!args.summary.empty()) write_summary(args.summary, prompt, generated, stream.text(), seconds);
  return 0;
}

CLI::App* add_generate_command(CLI::App& app, GenerateArgs& args) {
  auto* cmd = app.add_subcommand("generate",
                                 "continue a prompt with a trained decoder (a zerotrain checkpoint of a GPT or a "
                                 "Llama, or a Hugging Face LlamaForCausalLM/Qwen2ForCausalLM directory), one process");
  cmd->add_option("source", args.source, "checkpoint directory (a run's --save-dir) or Hugging Face model directory")
      ->required();
  cmd->add_option("--prompt", args.prompt, "the text to continue")->required();
  cmd->add_option("--max-new-tokens", args.max_new_tokens, "at most this many new tokens (default 64)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--temperature", args.temperature, "0 (default): greedy; above 0: sampled at this temperature")
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-p", args.top_p, "with --temperature: sample from the most probable tokens whose "
                                         "probabilities add up to P (default 1: all)")
      ->check(CLI::Range(1e-9, 1.0));
  cmd->add_option("--seed", args.seed, "the sampling generator's seed (default 0)");
  cmd->add_option("--tokenizer", args.tokenizer,
                  "a tokenizer.json or a directory holding one (default: the model directory's, a checkpoint's "
                  "data.tokenizer or its model.init_from directory's, else bytes)");
  cmd->add_option("--tag", args.tag, "which checkpoint (default: the one 'latest' names)");
  cmd->add_option("--summary", args.summary, "write the prompt's and the new tokens' ids and the text as JSON here");
  return cmd;
}

}  // namespace zt::cli
