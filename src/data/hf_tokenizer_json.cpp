// tokenizer.json → HfTokenizer::Impl. Whatever would make our ids differ from the Rust library's
// is refused here, by name, rather than approximated. The file comes from the internet: its size
// and nesting are bounded before it is parsed, as for config.json and the checkpoint manifests.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <vector>

#include "checkpoint/json_bounds.h"
#include "common/printable.h"
#include "data/hf_pipeline.h"
#include "data/hf_utf8.h"
#include "zerotrain/error.h"

namespace zt::hf {
namespace {

using nlohmann::json;

// A tokenizer.json nests about 7 levels deep (post_processor.processors[0].special_tokens...ids);
// a Sequence inside a Sequence adds two. Far deeper is not a tokenizer, and the readers below
// recurse once per level.
constexpr int kMaxJsonDepth = 32;
// The top level has about ten keys (model, normalizer, ...); the vocabulary is one level down.
constexpr int64_t kMaxTopLevelKeys = 1000;

// Where a value sits in the file: a chain of links on the callers' stacks, one per level, so that
// reading a nested value copies nothing; the dotted text is built only for a message.
class FieldPath {
 public:
  FieldPath() = default;  // the file's top level
  FieldPath key(std::string_view name) const { return {this, Kind::Key, name, 0}; }
  // ["name"]: a key that comes from the file (a token, a special token's name).
  FieldPath quoted(std::string_view name) const { return {this, Kind::Quoted, name, 0}; }
  FieldPath index(size_t i) const { return {this, Kind::Index, {}, i}; }

  std::string text() const {
    std::vector<const FieldPath*> chain;
    for (const FieldPath* link = this; link->kind_ != Kind::Root; link = link->parent_) chain.push_back(link);
    std::string out;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      const FieldPath& link = **it;
      if (link.kind_ == Kind::Key) {
        if (!out.empty()) out += '.';
        out.append(link.name_);
      } else if (link.kind_ == Kind::Quoted) {
        out.append("[\"").append(printable_utf8(link.name_, 80)).append("\"]");
      } else {
        out.append("[").append(std::to_string(link.index_)).append("]");
      }
    }
    return out.empty() ? "(top level)" : out;
  }

 private:
  enum class Kind { Root, Key, Quoted, Index };
  FieldPath(const FieldPath* parent, Kind kind, std::string_view name, size_t index)
      : parent_(parent), kind_(kind), name_(name), index_(index) {}
  const FieldPath* parent_ = nullptr;
  Kind kind_ = Kind::Root;
  std::string_view name_;
  size_t index_ = 0;
};

// Reads fields of one file; every error names the file and the field's path, and quotes what it
// found as one line of valid UTF-8.
class Reader {
 public:
  explicit Reader(const std::string& source) : label_("tokenizer " + printable_utf8(source, 400)) {}

  [[noreturn]] void fail(const FieldPath& field, const std::string& problem) const {
    throw DataError(label_ + ": field " + field.text() + " " + problem);
  }
  [[noreturn]] void unsupported(const FieldPath& field, const json& found, const std::string& supported) const {
    fail(field, "is " + shown(found) + ", which is not supported (supported: " + supported + ")");
  }
  static std::string shown(const json& value) {
    // Strings in a parsed document are valid UTF-8; the cut and any control characters are not
    // left to chance.
    return printable_utf8(value.dump(-1, ' ', false, json::error_handler_t::replace), 80);
  }

  const json& required(const json& object, const char* key, const FieldPath& path) const {
    auto it = object.find(key);
    if (it == object.end()) fail(path.key(key), "is missing");
    return *it;
  }
  std::string string(const json& value, const FieldPath& field) const {
    if (!value.is_string()) fail(field, "is " + shown(value) + "; expected a string");
    return value.get<std::string>();
  }
  bool boolean(const json& object, const char* key, const FieldPath& path, bool fallback) const {
    auto it = object.find(key);
    if (it == object.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(path.key(key), "is " + shown(*it) + "; expected true or false");
    return it->get<bool>();
  }
  uint64_t unsigned_integer(const json& value, const FieldPath& field, uint64_t limit) const {
    if (!value.is_number_unsigned() || value.get<uint64_t>() > limit)
      fail(field, "is " + shown(value) + "; expected an integer from 0 to " + std::to_string(limit));
    return value.get<uint64_t>();
  }
  const json& object_of_type(const json& value, const FieldPath& field) const {
    if (!value.is_object()) fail(field, "is " + shown(value) + "; expected an object");
    return value;
  }
  std::string type_of(const json& value, const FieldPath& field) const {
    object_of_type(value, field);
    return string(required(value, "type", field), field.key("type"));
  }
  const json& array(const json& object, const char* key, const FieldPath& path) const {
    const json& value = required(object, key, path);
    if (!value.is_array()) fail(path.key(key), "is " + shown(value) + "; expected an array");
    return value;
  }
  // "tokenizer <file>": how messages from other parts (the model, the regexes) name the file.
  const std::string& label() const { return label_; }
  std::string where(const FieldPath& field) const { return label_ + ": field " + field.text(); }

 private:
  std::string label_;
};

// Far above any vocabulary (Llama 3: 128,256); the id-indexed tables stay small for a bad file.
constexpr TokenId kMaxTokenId = (1u << 24) - 1;

// {"String": s} or {"Regex": r} of Split, Replace.
Regex read_pattern(const Reader& reader, const json& owner, const FieldPath& path) {
  const FieldPath field = path.key("pattern");
  const json& pattern = reader.object_of_type(reader.required(owner, "pattern", path), field);
  if (auto it = pattern.find("String"); it != pattern.end())
    return Regex::literal(reader.string(*it, field.key("String")), reader.where(field));
  if (auto it = pattern.find("Regex"); it != pattern.end())
    return Regex(reader.string(*it, field.key("Regex")), reader.where(field));
  reader.unsupported(field, pattern, "{\"String\": ...} or {\"Regex\": ...}");
}

// One character, as a code point (Metaspace's replacement, Strip's content).
char32_t read_character(const Reader& reader, const json& value, const FieldPath& field) {
  const std::string text = reader.string(value, field);
  size_t at = 0;
  if (text.empty() || first_invalid_utf8(text) || (next_code_point(text, at), at != text.size()))
    reader.fail(field, "is " + Reader::shown(value) + "; expected exactly one character");
  at = 0;
  return next_code_point(text, at);
}

PrependScheme read_prepend_scheme(const Reader& reader, const json& object, const FieldPath& path) {
  if (auto it = object.find("prepend_scheme"); it != object.end()) {
    const std::string scheme = reader.string(*it, path.key("prepend_scheme"));
    if (scheme == "always") return PrependScheme::Always;
    if (scheme == "never") return PrependScheme::Never;
    if (scheme == "first") return PrependScheme::First;
    reader.unsupported(path.key("prepend_scheme"), *it, "\"always\", \"never\", \"first\"");
  }
  // Files from before prepend_scheme existed say add_prefix_space.
  return reader.boolean(object, "add_prefix_space", path, true) ? PrependScheme::Always : PrependScheme::Never;
}

void read_normalizer(const Reader& reader, const json& value, const FieldPath& path, std::vector<Normalizer>& out) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "normalizers", path);
    const FieldPath steps_path = path.key("normalizers");
    for (size_t i = 0; i < steps.size(); ++i) read_normalizer(reader, steps[i], steps_path.index(i), out);
  } else if (type == "Prepend") {
    out.push_back(PrependNormalizer{reader.string(reader.required(value, "prepend", path), path.key("prepend")),
                                    reader.where(path)});
  } else if (type == "Replace") {
    out.push_back(ReplaceNormalizer{read_pattern(reader, value, path),
                                    reader.string(reader.required(value, "content", path), path.key("content")),
                                    reader.where(path)});
  } else {
    reader.unsupported(path.key("type"), type, "\"Prepend\", \"Replace\", \"Sequence\" of them");
  }
}

SplitBehavior read_behavior(const Reader& reader, const json& object, const FieldPath& path) {
  const json& value = reader.required(object, "behavior", path);
  const std::string behavior = reader.string(value, path.key("behavior"));
  if (behavior == "Isolated") return SplitBehavior::Isolated;
  if (behavior == "Removed") return SplitBehavior::Removed;
  if (behavior == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (behavior == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (behavior == "Contiguous") return SplitBehavior::Contiguous;
  reader.unsupported(path.key("behavior"), value,
                     "\"Isolated\", \"Removed\", \"MergedWithPrevious\", \"MergedWithNext\", \"Contiguous\"");
}

void read_pre_tokenizer(const Reader& reader, const json& value, const FieldPath& path, std::vector<PreTokenizer>& out) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "pretokenizers", path);
    const FieldPath steps_path = path.key("pretokenizers");
    for (size_t i = 0; i < steps.size(); ++i) read_pre_tokenizer(reader, steps[i], steps_path.index(i), out);
  } else if (type == "ByteLevel") {
    out.push_back(ByteLevelPreTokenizer{reader.boolean(value, "add_prefix_space", path, true),
                                        reader.boolean(value, "use_regex", path, true)});
  } else if (type == "Split") {
    out.push_back(SplitPreTokenizer{read_pattern(reader, value, path), read_behavior(reader, value, path),
                                    reader.boolean(value, "invert", path, false)});
  } else if (type == "Metaspace") {
    const char32_t replacement = read_character(reader, reader.required(value, "replacement", path), path.key("replacement"));
    out.push_back(MetaspacePreTokenizer{utf8_encode(replacement), read_prepend_scheme(reader, value, path),
                                        reader.boolean(value, "split", path, true)});
  } else {
    reader.unsupported(path.key("type"), type, "\"ByteLevel\", \"Split\", \"Metaspace\", \"Sequence\" of them");
  }
}

StripDecoder read_strip_decoder(const Reader& reader, const json& value, const FieldPath& path) {
  return StripDecoder{read_character(reader, reader.required(value, "content", path), path.key("content")),
                      reader.unsigned_integer(reader.required(value, "start", path), path.key("start"), 1u << 20),
                      reader.unsigned_integer(reader.required(value, "stop", path), path.key("stop"), 1u << 20)};
}

void read_decoder(const Reader& reader, const json& value, const FieldPath& path, std::vector<Decoder>& out) {
  const std::string type = reader.type_of(value, path);
  if (type == "Sequence") {
    const json& steps = reader.array(value, "decoders", path);
    const FieldPath steps_path = path.key("decoders");
    for (size_t i = 0; i < steps.size(); ++i) read_decoder(reader, steps[i], steps_path.index(i), out);
  } else if (type == "ByteLevel") {
    out.push_back(ByteLevelDecoder{});
  } else if (type == "ByteFallback") {
    out.push_back(ByteFallbackDecoder{});
  } else if (type == "Fuse") {
    out.push_back(FuseDecoder{});
  } else if (type == "Replace") {
    out.push_back(ReplaceDecoder{read_pattern(reader, value, path),
                                 reader.string(reader.required(value, "content", path), path.key("content"))});
  } else if (type == "Strip") {
    out.push_back(read_strip_decoder(reader, value, path));
  } else if (type == "Metaspace") {
    out.push_back(MetaspaceDecoder{read_character(reader, reader.required(value, "replacement", path), path.key("replacement")),
                                   read_prepend_scheme(reader, value, path)});
  } else {
    reader.unsupported(path.key("type"), type,
                       "\"ByteLevel\", \"ByteFallback\", \"Fuse\", \"Replace\", \"Strip\", \"Metaspace\", \"Sequence\" of them");
  }
}

// Options that change the ids and that this implementation does not have must be off.
void require_off(const Reader& reader, const json& object, const char* key, const FieldPath& path,
                 const std::string& off) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null() || *it == false || (it->is_string() && it->get<std::string>().empty()) ||
      (it->is_number() && it->get<double>() == 0.0))
    return;
  reader.unsupported(path.key(key), *it, off);
}

std::vector<std::pair<std::string, std::string>> read_merges(const Reader& reader, const json& model,
                                                             const FieldPath& model_path) {
  const json& merges = reader.array(model, "merges", model_path);
  const FieldPath merges_path = model_path.key("merges");
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const FieldPath field = merges_path.index(i);
    const json& merge = merges[i];
    if (merge.is_array() && merge.size() == 2) {
      out.emplace_back(reader.string(merge[0], field.index(0)), reader.string(merge[1], field.index(1)));
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

std::unique_ptr<BpeModel> read_model(const Reader& reader, const json& root, const FieldPath& top) {
  const FieldPath path = top.key("model");
  const json& model = reader.object_of_type(reader.required(root, "model", top), path);
  auto type = model.find("type");
  if (type == model.end()) reader.fail(path.key("type"), "is missing (supported: \"BPE\")");
  if (*type != "BPE") reader.unsupported(path.key("type"), *type, "\"BPE\"");
  require_off(reader, model, "dropout", path, "null (BPE dropout is for training)");
  require_off(reader, model, "continuing_subword_prefix", path, "null");
  require_off(reader, model, "end_of_word_suffix", path, "null");
  const FieldPath vocab_path = path.key("vocab");
  const json& vocab_json = reader.object_of_type(reader.required(model, "vocab", path), vocab_path);
  StringMap<TokenId> vocab;
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items())
    vocab.emplace(token, TokenId(reader.unsigned_integer(id, vocab_path.quoted(token), kMaxTokenId)));
  BpeOptions options;
  if (auto unk = model.find("unk_token"); unk != model.end() && !unk->is_null())
    options.unk_token = reader.string(*unk, path.key("unk_token"));
  options.fuse_unk = reader.boolean(model, "fuse_unk", path, false);
  options.byte_fallback = reader.boolean(model, "byte_fallback", path, false);
  options.ignore_merges = reader.boolean(model, "ignore_merges", path, false);
  return std::make_unique<BpeModel>(std::move(vocab), read_merges(reader, model, path), std::move(options),
                                    reader.label());
}

void read_added_tokens(const Reader& reader, const json& root, const FieldPath& top, HfTokenizer::Impl& impl) {
  auto tokens = root.find("added_tokens");
  if (tokens == root.end() || tokens->is_null()) return;
  const FieldPath tokens_path = top.key("added_tokens");
  if (!tokens->is_array()) reader.fail(tokens_path, "is " + Reader::shown(*tokens) + "; expected an array");
  // The matchers keep a node per byte of the tokens: their text is bounded before any is built.
  size_t content_bytes = 0;
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& token = (*tokens)[i];
    auto content = token.is_object() ? token.find("content") : token.end();
    if (content == token.end() || !content->is_string()) continue;  // refused below, by name
    if ((content_bytes += content->get_ref<const std::string&>().size()) > kMaxAddedTokenBytes)
      reader.fail(tokens_path.index(i).key("content"), "brings the added tokens' text to " + std::to_string(content_bytes) +
                                                          " bytes; expected at most " +
                                                          std::to_string(kMaxAddedTokenBytes) + " in all");
  }
  for (size_t i = 0; i < tokens->size(); ++i) {
    const FieldPath path = tokens_path.index(i);
    const json& token = reader.object_of_type((*tokens)[i], path);
    const auto id = TokenId(reader.unsigned_integer(reader.required(token, "id", path), path.key("id"), kMaxTokenId));
    const std::string content = reader.string(reader.required(token, "content", path), path.key("content"));
    for (const char* option : {"single_word", "lstrip", "rstrip"}) require_off(reader, token, option, path, "false");
    const bool special = reader.boolean(token, "special", path, false);
    // The Rust library's default: special tokens are matched in the raw text.
    const bool normalized = reader.boolean(token, "normalized", path, !special);
    (normalized ? impl.normalized_added_tokens : impl.raw_added_tokens).add(content, id);
    impl.added_tokens_by_id[id] = content;
    if (special) impl.special_token_contents.insert(content);
  }
  impl.normalized_added_tokens.build();
  impl.raw_added_tokens.build();
}

// One item of TemplateProcessing's single template: $A, or a special token's ids.
TemplatePart read_template_item(const Reader& reader, const json& item_json, const FieldPath& item_path,
                                const json& specials, const FieldPath& specials_path) {
  const json& item = reader.object_of_type(item_json, item_path);
  if (auto sequence = item.find("Sequence"); sequence != item.end()) {
    const FieldPath sequence_path = item_path.key("Sequence");
    const json& id = reader.required(*sequence, "id", sequence_path);
    if (id != "A") reader.unsupported(sequence_path.key("id"), id, "\"A\" in the single-sequence template");
    return {true, {}};
  }
  const FieldPath special_path = item_path.key("SpecialToken");
  const json& special = reader.required(item, "SpecialToken", item_path);
  const std::string name = reader.string(reader.required(special, "id", special_path), special_path.key("id"));
  auto entry = specials.find(name);
  if (entry == specials.end())
    reader.fail(specials_path, "has no entry \"" + printable_utf8(name, 80) + "\", which " + item_path.text() + " names");
  TemplatePart part;
  const FieldPath entry_path = specials_path.quoted(name);
  const FieldPath ids_path = entry_path.key("ids");
  for (const json& id : reader.array(*entry, "ids", entry_path))
    part.ids.push_back(TokenId(reader.unsigned_integer(id, ids_path, kMaxTokenId)));
  return part;
}

// The single-sequence template of TemplateProcessing, alone or in a Sequence of processors;
// ByteLevel's post-processor changes offsets only and leaves the ids alone.
void read_post_processor(const Reader& reader, const json& value, const FieldPath& path, HfTokenizer::Impl& impl) {
  if (value.is_null()) return;
  const std::string type = reader.type_of(value, path);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json& steps = reader.array(value, "processors", path);
    const FieldPath steps_path = path.key("processors");
    for (size_t i = 0; i < steps.size(); ++i) read_post_processor(reader, steps[i], steps_path.index(i), impl);
    return;
  }
  if (type != "TemplateProcessing")
    reader.unsupported(path.key("type"), type, "\"TemplateProcessing\", \"ByteLevel\", \"Sequence\" of them");
  if (!impl.single_template.empty()) reader.fail(path, "is a second TemplateProcessing (supported: one)");
  const FieldPath specials_path = path.key("special_tokens");
  const json& specials = reader.object_of_type(reader.required(value, "special_tokens", path), specials_path);
  const json& single = reader.array(value, "single", path);
  const FieldPath single_path = path.key("single");
  for (size_t i = 0; i < single.size(); ++i)
    impl.single_template.push_back(read_template_item(reader, single[i], single_path.index(i), specials, specials_path));
}

// The size and nesting of the text, checked before a document is built from it.
json parse_bounded(std::string_view json_text, const std::string& label) {
  if (json_text.size() > kMaxTokenizerJsonBytes)
    throw DataError(label + ": " + std::to_string(json_text.size()) + " bytes; expected at most " +
                    std::to_string(kMaxTokenizerJsonBytes) + " for a tokenizer.json");
  if (const std::string problem = json_bounds_problem(json_text, kMaxJsonDepth, kMaxTopLevelKeys); !problem.empty())
    throw DataError(label + ": the file " + printable_utf8(problem, 300) + " (expected a tokenizer.json, which nests at most " +
                    std::to_string(kMaxJsonDepth) + " levels and has at most " + std::to_string(kMaxTopLevelKeys) +
                    " top-level keys)");
  try {
    return json::parse(json_text);
  } catch (const json::exception& e) {
    throw DataError(label + ": not valid JSON (" + printable_utf8(e.what(), 300) + ")");
  }
}

}  // namespace

std::shared_ptr<const HfTokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source) {
  const Reader reader(source);
  const json root = parse_bounded(json_text, reader.label());
  if (!root.is_object()) throw DataError(reader.label() + ": expected a JSON object, found " + Reader::shown(root));
  const FieldPath top;
  require_off(reader, root, "truncation", top, "null (truncate the ids yourself)");
  require_off(reader, root, "padding", top, "null (pad the ids yourself)");
  auto impl = std::make_shared<HfTokenizer::Impl>();
  impl->source = source;
  impl->model = read_model(reader, root, top);
  read_added_tokens(reader, root, top, *impl);
  if (auto it = root.find("normalizer"); it != root.end())
    read_normalizer(reader, *it, top.key("normalizer"), impl->normalizers);
  if (auto it = root.find("pre_tokenizer"); it != root.end())
    read_pre_tokenizer(reader, *it, top.key("pre_tokenizer"), impl->pre_tokenizers);
  if (auto it = root.find("decoder"); it != root.end() && !it->is_null()) {
    impl->has_decoder = true;
    read_decoder(reader, *it, top.key("decoder"), impl->decoders);
  }
  if (auto it = root.find("post_processor"); it != root.end())
    read_post_processor(reader, *it, top.key("post_processor"), *impl);
  impl->vocab_size = impl->model->id_limit();
  for (const auto& [id, content] : impl->added_tokens_by_id) impl->vocab_size = std::max(impl->vocab_size, size_t(id) + 1);
  return impl;
}

}  // namespace zt::hf
