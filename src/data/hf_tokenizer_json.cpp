// tokenizer.json → HfTokenizer::Impl. Whatever would make our ids differ from the Rust library's
// is refused here, by name, rather than approximated.
#include <nlohmann/json.hpp>

#include <algorithm>

#include "data/hf_pipeline.h"
#include "data/hf_utf8.h"
#include "zerotrain/error.h"

namespace zt::hf {
namespace {

using nlohmann::json;

// Reads fields of one file; every error names the file and the field's path.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw DataError("tokenizer " + source_ + ": field " + field + " " + problem);
  }
  [[noreturn]] void unsupported(const std::string& field, const json& found, const std::string& supported) const {
    fail(field, "is " + shown(found) + ", which is not supported (supported: " + supported + ")");
  }
  static std::string shown(const json& value) {
    std::string text = value.dump();
    return text.size() > 80 ? text.substr(0, 77) + "..." : text;
  }

  const json& required(const json& object, const std::string& key, const std::string& path) const {
    auto it = object.find(key);
    if (it == object.end()) fail(joined(path, key), "is missing");
    return *it;
  }
  std::string string(const json& value, const std::string& field) const {
    if (!value.is_string()) fail(field, "is " + shown(value) + "; expected a string");
    return value.get<std::string>();
  }
  bool boolean(const json& object, const std::string& key, const std::string& path, bool fallback) const {
    auto it = object.find(key);
    if (it == object.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(path + "." + key, "is " + shown(*it) + "; expected true or false");
    return it->get<bool>();
  }
  uint64_t unsigned_integer(const json& value, const std::string& field, uint64_t limit) const {
    if (!value.is_number_unsigned() || value.get<uint64_t>() > limit)
      fail(field, "is " + shown(value) + "; expected an integer from 0 to " + std::to_string(limit));
    return value.get<uint64_t>();
  }
  const json& object_of_type(const json& value, const std::string& field) const {
    if (!value.is_object()) fail(field, "is " + shown(value) + "; expected an object");
    return value;
  }
  std::string type_of(const json& value, const std::string& field) const {
    object_of_type(value, field);
    return string(required(value, "type", field), field + ".type");
  }
  const json& array(const json& object, const std::string& key, const std::string& path) const {
    const json& value = required(object, key, path);
    if (!value.is_array()) fail(path + "." + key, "is " + shown(value) + "; expected an array");
    return value;
  }
  const std::string& source() const { return source_; }
  // The path of `key` inside the object at `path` ("" for the file's top level).
  static std::string joined(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }

 private:
  std::string source_;
};

// Far above any vocabulary (Llama 3: 128,256); the id-indexed tables stay small for a bad file.
constexpr TokenId kMaxTokenId = (1u << 24) - 1;

// {"String": s} or {"Regex": r} of Split, Replace.
Regex read_pattern(const Reader& reader, const json& owner, const std::string& path) {
  const json& pattern = reader.object_of_type(reader.required(owner, "pattern", path), path + ".pattern");
  const std::string where = "tokenizer " + reader.source() + ": field " + path + ".pattern";
  if (auto it = pattern.find("String"); it != pattern.end())
    return Regex::literal(reader.string(*it, path + ".pattern.String"), where);
  if (auto it = pattern.find("Regex"); it != pattern.end())
    return Regex(reader.string(*it, path + ".pattern.Regex"), where);
  reader.unsupported(path + ".pattern", pattern, "{\"String\": ...} or {\"Regex\": ...}");
}

// One character, as a code point (Metaspace's replacement, Strip's content).
char32_t read_character(const Reader& reader, const json& value, const std::string& field) {
  const std::string text = reader.string(value, field);
  size_t at = 0;
  if (text.empty() || first_invalid_utf8(text) || (next_code_point(text, at), at != text.size()))
    reader.fail(field, "is " + Reader::shown(value) + "; expected exactly one character");
  at = 0;
  return next_code_point(text, at);
}

PrependScheme read_prepend_scheme(const Reader& reader, const json& object, const std::string& path) {
  if (auto it = object.find("prepend_scheme"); it != object.end()) {
    const std::string scheme = reader.string(*it, path + ".prepend_scheme");
    if (scheme == "always") return PrependScheme::Always;
    if (scheme == "never") return PrependScheme::Never;
    if (scheme == "first") return PrependScheme::First;
    reader.unsupported(path + ".prepend_scheme", *it, "\"always\", \"never\", \"first\"");
  }
  // Files from before prepend_scheme existed say add_prefix_space.
  return reader.boolean(object, "add_prefix_space", path, true) ? PrependScheme::Always : PrependScheme::Never;
}

void read_normalizer(const Reader& reader, const json& value, const std::string& path, std::vector<Normalizer>& out) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "normalizers", path);
    for (size_t i = 0; i < steps.size(); ++i)
      read_normalizer(reader, steps[i], path + ".normalizers[" + std::to_string(i) + "]", out);
  } else if (type == "Prepend") {
    out.push_back(PrependNormalizer{reader.string(reader.required(value, "prepend", path), path + ".prepend")});
  } else if (type == "Replace") {
    out.push_back(ReplaceNormalizer{read_pattern(reader, value, path),
                                    reader.string(reader.required(value, "content", path), path + ".content")});
  } else {
    reader.unsupported(path + ".type", type, "\"Prepend\", \"Replace\", \"Sequence\" of them");
  }
}

SplitBehavior read_behavior(const Reader& reader, const json& object, const std::string& path) {
  const json& value = reader.required(object, "behavior", path);
  const std::string behavior = reader.string(value, path + ".behavior");
  if (behavior == "Isolated") return SplitBehavior::Isolated;
  if (behavior == "Removed") return SplitBehavior::Removed;
  if (behavior == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (behavior == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (behavior == "Contiguous") return SplitBehavior::Contiguous;
  reader.unsupported(path + ".behavior", value,
                     "\"Isolated\", \"Removed\", \"MergedWithPrevious\", \"MergedWithNext\", \"Contiguous\"");
}

void read_pre_tokenizer(const Reader& reader, const json& value, const std::string& path, std::vector<PreTokenizer>& out) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "pretokenizers", path);
    for (size_t i = 0; i < steps.size(); ++i)
      read_pre_tokenizer(reader, steps[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
  } else if (type == "ByteLevel") {
    out.push_back(ByteLevelPreTokenizer{reader.boolean(value, "add_prefix_space", path, true),
                                        reader.boolean(value, "use_regex", path, true)});
  } else if (type == "Split") {
    out.push_back(SplitPreTokenizer{read_pattern(reader, value, path), read_behavior(reader, value, path),
                                    reader.boolean(value, "invert", path, false)});
  } else if (type == "Metaspace") {
    const char32_t replacement = read_character(reader, reader.required(value, "replacement", path), path + ".replacement");
    out.push_back(MetaspacePreTokenizer{utf8_encode(replacement), read_prepend_scheme(reader, value, path),
                                        reader.boolean(value, "split", path, true)});
  } else {
    reader.unsupported(path + ".type", type, "\"ByteLevel\", \"Split\", \"Metaspace\", \"Sequence\" of them");
  }
}

void read_decoder(const Reader& reader, const json& value, const std::string& path, std::vector<Decoder>& out) {
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "decoders", path);
    for (size_t i = 0; i < steps.size(); ++i)
      read_decoder(reader, steps[i], path + ".decoders[" + std::to_string(i) + "]", out);
  } else if (type == "ByteLevel") {
    out.push_back(ByteLevelDecoder{});
  } else if (type == "ByteFallback") {
    out.push_back(ByteFallbackDecoder{});
  } else if (type == "Fuse") {
    out.push_back(FuseDecoder{});
  } else if (type == "Replace") {
    out.push_back(ReplaceDecoder{read_pattern(reader, value, path),
                                 reader.string(reader.required(value, "content", path), path + ".content")});
  } else if (type == "Strip") {
    out.push_back(StripDecoder{read_character(reader, reader.required(value, "content", path), path + ".content"),
                               reader.unsigned_integer(reader.required(value, "start", path), path + ".start", 1u << 20),
                               reader.unsigned_integer(reader.required(value, "stop", path), path + ".stop", 1u << 20)});
  } else if (type == "Metaspace") {
    out.push_back(MetaspaceDecoder{read_character(reader, reader.required(value, "replacement", path), path + ".replacement"),
                                   read_prepend_scheme(reader, value, path)});
  } else {
    reader.unsupported(path + ".type", type,
                       "\"ByteLevel\", \"ByteFallback\", \"Fuse\", \"Replace\", \"Strip\", \"Metaspace\", \"Sequence\" of them");
  }
}

// Options that change the ids and that this implementation does not have must be off.
void require_off(const Reader& reader, const json& object, const std::string& key, const std::string& path,
                 const std::string& off) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null() || *it == false || (it->is_string() && it->get<std::string>().empty()) ||
      (it->is_number() && it->get<double>() == 0.0))
    return;
  reader.unsupported(Reader::joined(path, key), *it, off);
}

std::vector<std::pair<std::string, std::string>> read_merges(const Reader& reader, const json& model) {
  const json& merges = reader.array(model, "merges", "model");
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    const json& merge = merges[i];
    if (merge.is_array() && merge.size() == 2) {
      out.emplace_back(reader.string(merge[0], field + "[0]"), reader.string(merge[1], field + "[1]"));
      continue;
    }
    const std::string line = merge.is_string() ? merge.get<std::string>() : std::string();
    if (merge.is_string() && line.starts_with("#version")) continue;
    const size_t space = line.find(' ');
    if (!merge.is_string() || space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
      reader.fail(field, "is " + Reader::shown(merge) + "; expected \"left right\" or [\"left\", \"right\"]");
    out.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  return out;
}

std::unique_ptr<BpeModel> read_model(const Reader& reader, const json& root) {
  const json& model = reader.object_of_type(reader.required(root, "model", ""), "model");
  auto type = model.find("type");
  if (type == model.end()) reader.fail("model.type", "is missing (supported: \"BPE\")");
  if (*type != "BPE") reader.unsupported("model.type", *type, "\"BPE\"");
  require_off(reader, model, "dropout", "model", "null (BPE dropout is for training)");
  require_off(reader, model, "continuing_subword_prefix", "model", "null");
  require_off(reader, model, "end_of_word_suffix", "model", "null");
  const json& vocab_json = reader.object_of_type(reader.required(model, "vocab", "model"), "model.vocab");
  StringMap<TokenId> vocab;
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items())
    vocab.emplace(token, TokenId(reader.unsigned_integer(id, "model.vocab[\"" + token + "\"]", kMaxTokenId)));
  BpeOptions options;
  if (auto unk = model.find("unk_token"); unk != model.end() && !unk->is_null())
    options.unk_token = reader.string(*unk, "model.unk_token");
  options.fuse_unk = reader.boolean(model, "fuse_unk", "model", false);
  options.byte_fallback = reader.boolean(model, "byte_fallback", "model", false);
  options.ignore_merges = reader.boolean(model, "ignore_merges", "model", false);
  return std::make_unique<BpeModel>(std::move(vocab), read_merges(reader, model), std::move(options),
                                    "tokenizer " + reader.source());
}

void read_added_tokens(const Reader& reader, const json& root, HfTokenizer::Impl& impl) {
  auto tokens = root.find("added_tokens");
  if (tokens == root.end() || tokens->is_null()) return;
  if (!tokens->is_array()) reader.fail("added_tokens", "is " + Reader::shown(*tokens) + "; expected an array");
  for (size_t i = 0; i < tokens->size(); ++i) {
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    const json& token = reader.object_of_type((*tokens)[i], path);
    const auto id = TokenId(reader.unsigned_integer(reader.required(token, "id", path), path + ".id", kMaxTokenId));
    const std::string content = reader.string(reader.required(token, "content", path), path + ".content");
    for (const char* option : {"single_word", "lstrip", "rstrip"}) require_off(reader, token, option, path, "false");
    const bool special = reader.boolean(token, "special", path, false);
    // The Rust library's default: special tokens are matched in the raw text.
    const bool normalized = reader.boolean(token, "normalized", path, !special);
    (normalized ? impl.normalized_added_tokens : impl.raw_added_tokens).add(content, id);
    impl.added_tokens_by_id[id] = content;
    if (special) impl.special_token_contents.insert(content);
  }
}

// The single-sequence template of TemplateProcessing, alone or in a Sequence of processors;
// ByteLevel's post-processor changes offsets only and leaves the ids alone.
void read_post_processor(const Reader& reader, const json& value, const std::string& path, HfTokenizer::Impl& impl) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json& steps = reader.array(value, "processors", path);
    for (size_t i = 0; i < steps.size(); ++i)
      read_post_processor(reader, steps[i], path + ".processors[" + std::to_string(i) + "]", impl);
    return;
  }
  if (type != "TemplateProcessing")
    reader.unsupported(path + ".type", type, "\"TemplateProcessing\", \"ByteLevel\", \"Sequence\" of them");
  if (!impl.single_template.empty()) reader.fail(path, "is a second TemplateProcessing (supported: one)");
  const json& specials = reader.object_of_type(reader.required(value, "special_tokens", path), path + ".special_tokens");
  const json& single = reader.array(value, "single", path);
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item_path = path + ".single[" + std::to_string(i) + "]";
    const json& item = reader.object_of_type(single[i], item_path);
    if (auto sequence = item.find("Sequence"); sequence != item.end()) {
      const json& id = reader.required(*sequence, "id", item_path + ".Sequence");
      if (id != "A") reader.unsupported(item_path + ".Sequence.id", id, "\"A\" in the single-sequence template");
      impl.single_template.push_back({true, {}});
      continue;
    }
    const json& special = reader.required(item, "SpecialToken", item_path);
    const std::string name = reader.string(reader.required(special, "id", item_path + ".SpecialToken"),
                                           item_path + ".SpecialToken.id");
    auto entry = specials.find(name);
    if (entry == specials.end()) reader.fail(path + ".special_tokens", "has no entry \"" + name + "\", which " + item_path + " names");
    TemplatePart part;
    const std::string ids_path = path + ".special_tokens[\"" + name + "\"].ids";
    for (const json& id : reader.array(*entry, "ids", path + ".special_tokens[\"" + name + "\"]"))
      part.ids.push_back(TokenId(reader.unsigned_integer(id, ids_path, kMaxTokenId)));
    impl.single_template.push_back(std::move(part));
  }
}

}  // namespace

std::shared_ptr<const HfTokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source) {
  Reader reader(source);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw DataError("tokenizer " + source + ": not valid JSON (" + e.what() + ")");
  }
  if (!root.is_object()) throw DataError("tokenizer " + source + ": expected a JSON object, found " + Reader::shown(root));
  require_off(reader, root, "truncation", "", "null (truncate the ids yourself)");
  require_off(reader, root, "padding", "", "null (pad the ids yourself)");
  auto impl = std::make_shared<HfTokenizer::Impl>();
  impl->source = source;
  impl->model = read_model(reader, root);
  read_added_tokens(reader, root, *impl);
  if (auto it = root.find("normalizer"); it != root.end()) read_normalizer(reader, *it, "normalizer", impl->normalizers);
  if (auto it = root.find("pre_tokenizer"); it != root.end())
    read_pre_tokenizer(reader, *it, "pre_tokenizer", impl->pre_tokenizers);
  if (auto it = root.find("decoder"); it != root.end() && !it->is_null()) {
    impl->has_decoder = true;
    read_decoder(reader, *it, "decoder", impl->decoders);
  }
  if (auto it = root.find("post_processor"); it != root.end()) read_post_processor(reader, *it, "post_processor", *impl);
  impl->vocab_size = impl->model->id_limit();
  for (const auto& [id, content] : impl->added_tokens_by_id) impl->vocab_size = std::max(impl->vocab_size, size_t(id) + 1);
  return impl;
}

}  // namespace zt::hf
