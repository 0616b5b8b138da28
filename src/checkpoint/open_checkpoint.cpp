#include "checkpoint/open_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>

#include "checkpoint/json_bounds.h"
#include "zerotrain/error.h"

namespace zt::checkpoint_files {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Bounds on a manifest, checked before and while parsing: a hostile one cannot make the parser
// build an outsized document. A manifest lists parameters, files and string maps: 4 levels deep
// (root, "parameters", one parameter, its shape or split); 64 MiB holds the names and shapes of
// about a million parameters.
constexpr int64_t kMaxManifestBytes = int64_t(64) << 20;
constexpr int kMaxManifestDepth = 4;

}  // namespace

std::string rank_file_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

std::string fragment_name(const std::string& role, const std::string& parameter, int64_t begin) {
  return role + ":" + parameter + ":" + std::to_string(begin);
}

int64_t parse_count(std::string_view text) {
  int64_t value = -1;
  if (text.empty() || text.size() > 19 || text.find_first_not_of("0123456789") != std::string_view::npos) return -1;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

bool plain_tag(const std::string& tag) {
  return !tag.empty() && tag != "latest" && tag[0] != '.' && invalid_tensor_name(tag).empty() && tag.size() <= 255;
}

namespace {


// The manifest, its checksum verified.
json read_manifest(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read '" + path.string() + "'");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > kMaxManifestBytes)
    throw DataError("'" + path.string() + "': not a regular file of at most " + std::to_string(kMaxManifestBytes) +
                    " bytes (not a zerotrain manifest)");
  std::string text{std::istreambuf_iterator<char>(in), {}};
  if (int64_t(text.size()) > kMaxManifestBytes)
    throw DataError("'" + path.string() + "': larger than " + std::to_string(kMaxManifestBytes) + " bytes");
  json manifest;
  if (const std::string problem = json_bounds_problem(text, kMaxManifestDepth, 64); !problem.empty())
    throw DataError("'" + path.string() + "' " + problem + " (not a zerotrain manifest)");
  try {
    manifest = json::parse(text);
  } catch (const json::exception& e) {
    throw DataError("'" + path.string() + "' is not valid JSON (" + e.what() + ")");
  }
  const std::string stored = manifest.is_object() && manifest.contains("checksum") && manifest["checksum"].is_string()
                                 ? manifest["checksum"].get<std::string>()
                                 : "";
  const std::string field = "\"checksum\": \"" + stored + "\"";
  const size_t at = text.find(field);
  if (stored.size() != 8 || at == std::string::npos)
    throw DataError("'" + path.string() + "': no checksum (not a complete zerotrain manifest)");
  text.replace(at, field.size(), "\"checksum\": \"" + std::string(kZeroChecksum) + "\"");
  if (const std::string computed = crc32_hex(text); computed != stored)
    throw DataError("'" + path.string() + "' fails its checksum (stored " + stored + ", computed " + computed + ")");
  return manifest;
}

}  // namespace

fs::path resolve_tag(const fs::path& dir, const std::string& tag_in) {
  std::string tag = tag_in;
  if (!tag.empty() && !plain_tag(tag))
    throw ConfigError("checkpoint tag '" + tag + "': expected a plain name in '" + dir.string() +
                      "' (not 'latest', starting with '.', or containing '/', '..' or a control character)");
  if (tag.empty()) {
    std::ifstream latest(dir / "latest", std::ios::binary);
    if (!latest) throw DataError("no checkpoint in '" + dir.string() + "': '" + (dir / "latest").string() + "' is missing");
    // Exactly one line, as written: anything else is damage. A tag is at most 255 bytes.
    std::string text(257, '\0');
    latest.read(text.data(), std::streamsize(text.size()));
    text.resize(size_t(latest.gcount()));
    if (text.empty() || text.back() != '\n' || text.find('\n') != text.size() - 1)
      throw DataError("'" + (dir / "latest").string() + "' is damaged: expected one line naming a checkpoint");
    tag = text.substr(0, text.size() - 1);
    if (!plain_tag(tag) || !fs::is_directory(dir / tag)) {
      // Quoted as written, control characters escaped (the message stays one line).
      const std::string quoted = json(tag).dump(-1, ' ', false, json::error_handler_t::replace);
      throw DataError("'" + (dir / "latest").string() + "' names '" + quoted.substr(1, quoted.size() - 2) +
                      "', which is not a checkpoint directory in '" + dir.string() + "'");
    }
  }
  return dir / tag;
}

OpenCheckpoint::OpenCheckpoint(const fs::path& checkpoint) : root(checkpoint) {
  where = "'" + (root / "manifest.json").string() + "'";
  manifest = read_manifest(root / "manifest.json");
  std::vector<std::string> names;
  try {
    const int version = manifest.is_object() && manifest.contains("version") && manifest.at("version").is_number_integer()
                            ? manifest.at("version").get<int>()
                            : 0;
    if (!manifest.is_object() || manifest.value("format", "") != kFormat || (version != kVersion && version != kSlicedVersion))
      throw DataError(where + ": not a zerotrain checkpoint of version " + std::to_string(kVersion) + " or " +
                      std::to_string(kSlicedVersion));
    names = read_file_names();
    has_frozen = manifest.contains("frozen");
    read_parameter_list("parameters", parameters);
    if (has_frozen) read_parameter_list("frozen", frozen);
    for (const auto& p : parameters)
      if (p.split.ranks > 1 && version != kSlicedVersion)
        throw DataError(where + ": parameter '" + p.name + "' is saved as slices, which version " +
                        std::to_string(version) + " does not have");
    for (const char* key : {"scalars", "configuration"}) {
      const json& map = manifest.at(key);
      if (!map.is_object()) throw DataError(where + ": '" + key + "' is not an object");
      for (const auto& [k, v] : map.items())
        if (!v.is_string()) throw DataError(where + ": '" + key + "' value of '" + k + "' is not a string");
    }
    scalars = manifest.at("scalars").get<std::map<std::string, std::string>>();
    configuration = manifest.at("configuration").get<std::map<std::string, std::string>>();
  } catch (const json::exception& e) {
    throw DataError(where + ": not a zerotrain manifest (" + e.what() + ")");
  }
  for (const std::string& name : names) index_pieces(name);
  for (auto& [key, list] : pieces) {
    std::sort(list.begin(), list.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < list.size(); ++i)
      if (list[i].begin < list[i - 1].begin + list[i - 1].numel)
        throw DataError("'" + files[list[i].file]->path().string() + "': tensor '" + list[i].tensor + "' overlaps '" +
                        list[i - 1].tensor + "' of '" + files[list[i - 1].file]->path().string() + "'");
  }
}

// The manifest's world size and rank file names: rank-RRRRR-of-WWWWW.safetensors with W the
// world size, each once, the only names a save writes.
std::vector<std::string> OpenCheckpoint::read_file_names() const {
  const json& world_json = manifest.at("world_size");
  const int64_t world = world_json.is_number_integer() ? world_json.get<int64_t>() : -1;
  if (world < 1 || world > kMaxWorldSize || (world_json.is_number_unsigned() && world_json.get<uint64_t>() > kMaxWorldSize))
    throw DataError(where + ": world_size " + world_json.dump() + " is not in [1, " + std::to_string(kMaxWorldSize) + "]");
  const json& listed = manifest.at("files");
  if (!listed.is_array() || listed.size() > size_t(world))
    throw DataError(where + ": 'files' is not a list of at most world_size (" + std::to_string(world) + ") names");
  std::vector<std::string> names;
  std::set<std::string> seen;
  const std::string tail = rank_file_name(0, int(world)).substr(10);
  for (const auto& f : listed) {
    const std::string name = f.is_string() ? f.get<std::string>() : f.dump();
    bool valid = false;
    if (f.is_string() && name.size() == 10 + tail.size() && name.rfind("rank-", 0) == 0 && name.substr(10) == tail) {
      const int64_t rank = parse_count(std::string_view(name).substr(5, 5));
      valid = rank >= 0 && rank < world;
    }
    if (!valid || !seen.insert(name).second)
      throw DataError(where + ": file name " + json(name).dump(-1, ' ', false, json::error_handler_t::replace) +
                      " is not one of its rank files (rank-RRRRR-of-" + rank_file_name(0, int(world)).substr(14, 5) +
                      ".safetensors, each once)");
    names.push_back(name);
  }
  return names;
}

// One of the manifest's parameter lists: valid names, shapes whose element count does not
// overflow, no name twice across both lists; a trainable parameter's split, if any, fitting its
// shape.
// A manifest entry's "split" ({"dim", "parts", "ranks"}, integers): the slices it was saved as.
SliceLayout OpenCheckpoint::read_split(const json& entry, CheckpointParameter& parameter, const std::string& quoted,
                                      bool may_split) const {
  std::string problem;
  if (!entry.contains("split")) return slice_layout(parameter.shape, 0, 1, 1, problem);
  const json& split = entry.at("split");
  auto field = [&](const char* key, int64_t lo, int64_t hi) {
    const json* v = split.is_object() && split.contains(key) ? &split.at(key) : nullptr;
    if (!v || !v->is_number_integer() || (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(hi)) ||
        v->get<int64_t>() < lo || v->get<int64_t>() > hi)
      throw DataError(where + ": parameter " + quoted + " has split " + split.dump() + ": expected '" + key +
                      "' an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return int(v->get<int64_t>());
  };
  if (!may_split) throw DataError(where + ": frozen " + quoted + " has a split; frozen values are saved whole");
  parameter.split.dim = field("dim", 0, 64);
  parameter.split.parts = field("parts", 1, INT_MAX);
  parameter.split.ranks = field("ranks", 2, kMaxWorldSize);
  const SliceLayout layout =
      slice_layout(parameter.shape, parameter.split.dim, parameter.split.parts, parameter.split.ranks, problem);
  if (!problem.empty())
    throw DataError(where + ": parameter " + quoted + " of shape " + json(parameter.shape).dump() + " has split " +
                    split.dump() + ": " + problem);
  return layout;
}

void OpenCheckpoint::read_parameter_list(const char* list, std::vector<CheckpointParameter>& into) {
  const json& saved = manifest.at(list);
  if (!saved.is_array()) throw DataError(where + ": '" + list + "' is not a list");
  for (const auto& p : saved) {
    if (!p.is_object() || !p.contains("name") || !p.contains("shape") || !p.at("name").is_string() ||
        !p.at("shape").is_array())
      throw DataError(where + ": a parameter is not {\"name\": string, \"shape\": list}: " + p.dump());
    CheckpointParameter parameter{p.at("name").get<std::string>(), {}};
    const std::string quoted = json(parameter.name).dump(-1, ' ', false, json::error_handler_t::replace);
    if (const std::string why = invalid_tensor_name(parameter.name); !why.empty() || parameter.name.find(':') != std::string::npos)
      throw DataError(where + ": parameter name " + quoted + " " + (why.empty() ? "contains ':'" : why));
    int64_t numel = 1;
    for (const auto& d : p.at("shape")) {
      const int64_t v = d.is_number_integer() && !(d.is_number_unsigned() && d.get<uint64_t>() > INT64_MAX) ? d.get<int64_t>() : -1;
      if (v < 0 || __builtin_mul_overflow(numel, v, &numel))
        throw DataError(where + ": parameter " + quoted + " has shape " + p.at("shape").dump() +
                        " (a negative or non-integer dimension, or more elements than a 64-bit count holds)");
      parameter.shape.push_back(v);
    }
    if (!numels.emplace(parameter.name, numel).second) throw DataError(where + ": parameter " + quoted + " is listed twice");
    layouts[parameter.name] = read_split(p, parameter, quoted, std::string(list) == "parameters");
    into.push_back(std::move(parameter));
  }
}

// Opens a rank file (its header validated) and indexes its tensors: each "<role>:<parameter>:
// <first element>", fp32, one dimension, inside a parameter of the manifest.
void OpenCheckpoint::index_pieces(const std::string& name) {
  files.push_back(std::make_unique<SafetensorsReader>(root / name));
  const std::string file = "'" + files.back()->path().string() + "'";
  for (const auto& e : files.back()->entries()) {
    const auto first = e.name.find(':'), last = e.name.rfind(':');
    const std::string role = first == std::string::npos ? "" : e.name.substr(0, first);
    const std::string parameter = first == last ? "" : e.name.substr(first + 1, last - first - 1);
    const int64_t begin = first == last ? -1 : parse_count(std::string_view(e.name).substr(last + 1));
    const auto numel = numels.find(parameter);
    if (std::find(std::begin(kRoles), std::end(kRoles), role) == std::end(kRoles) || numel == numels.end() ||
        begin < 0 || e.dtype != at::kFloat || e.shape.size() != 1 || begin > numel->second ||
        e.shape[0] > numel->second - begin)
      throw DataError(file + ": unexpected tensor '" + e.name + "' (expected an fp32 range <role>:<parameter>:<first> of " +
                      "a parameter of the manifest, inside it)");
    pieces[{role, parameter}].push_back({files.size() - 1, e.name, begin, e.shape[0]});
  }
}

// Elements of [begin, begin + numel) of `role` of `parameter` in the saved pieces, from the
// headers alone (the pieces do not overlap).
int64_t OpenCheckpoint::covered(const std::string& role, const std::string& parameter, int64_t begin,
                                int64_t numel) const {
  int64_t total = 0;
  if (auto it = pieces.find({role, parameter}); it != pieces.end())
    for (const Piece& piece : it->second)
      total += std::max<int64_t>(0, std::min(piece.begin + piece.numel, begin + numel) - std::max(piece.begin, begin));
  return total;
}

// Hands elements [begin, begin + numel) of `role` of `parameter` to consume(offset from begin,
// count, values) in increasing order, each once, reading whole saved pieces in reads of at most a
// chunk (checksums verified after each piece); all must be found. `buffer` is the read buffer,
// allocated on first use.
void OpenCheckpoint::read_range(const std::string& role, const std::string& parameter, int64_t begin, int64_t numel,
                                const FragmentSink& consume, at::Tensor& buffer) {
  int64_t covered = 0;
  for (const Piece& piece : pieces[{role, parameter}]) {
    const int64_t lo = std::max(piece.begin, begin), hi = std::min(piece.begin + piece.numel, begin + numel);
    if (lo >= hi) continue;
    const int64_t element = int64_t(sizeof(float));
    // Grown to the largest piece read so far, at most a chunk.
    const int64_t wanted = std::min(piece.numel, checkpoint_chunk_bytes() / element);
    if (!buffer.defined() || buffer.numel() < wanted) {
      buffer = at::Tensor();
      buffer = at::empty({wanted}, at::kFloat);
    }
    files[piece.file]->read_pieces(piece.tensor, buffer.data_ptr(), std::min(buffer.numel(), piece.numel) * element,
                                   [&](int64_t offset, const void* data, int64_t bytes) {
                                     const int64_t first = piece.begin + offset / element;
                                     const int64_t from = std::max(first, lo);
                                     const int64_t to = std::min(first + bytes / element, hi);
                                     if (from < to)
                                       consume(from - begin, to - from, static_cast<const float*>(data) + (from - first));
                                   });
    covered += hi - lo;
  }
  if (covered != numel)
    throw DataError(where + ": elements [" + std::to_string(begin) + ", " + std::to_string(begin + numel) + ") of '" +
                    role + "' of parameter '" + parameter + "' are not all in the listed files (" +
                    std::to_string(covered) +
                    " found; a shard is missing, or it was saved with an optimizer without this state: loading "
                    "with reset_optimizer (--reset-optimizer) starts the moments afresh)");
}


SliceLayout layout_of(const CheckpointParameter& p) {
  std::string problem;
  SliceLayout layout = slice_layout(p.shape, p.split.dim, p.split.parts, p.split.ranks, problem);
  if (problem.empty() && (p.split.rank < 0 || p.split.rank >= p.split.ranks))
    problem = "rank " + std::to_string(p.split.rank) + " is not one of its " + std::to_string(p.split.ranks) + " slices";
  if (!problem.empty()) throw Error("checkpoint: parameter '" + p.name + "' split as given: " + problem);
  return layout;
}

void OpenCheckpoint::read_slice(const std::string& role, const std::string& parameter, const SliceLayout& wanted,
                                int64_t rank, int64_t begin, int64_t numel, float* out, at::Tensor& buffer) {
  const SliceLayout& saved = layouts.at(parameter);
  if (!saved.same_slices(wanted)) return read_resliced(role, parameter, wanted, rank, begin, numel, out, buffer);
  // Saved as it is wanted: the slice is one range of the saved concatenation.
  const int64_t first = (wanted.whole() ? 0 : rank * saved.slice_numel()) + begin;
  read_range(role, parameter, first, numel,
             [&](int64_t offset, int64_t count, const float* values) {
               std::copy(values, values + count, out + offset);
             },
             buffer);
}

// Another cut: for each saved slice, the range of it that holds elements of the wanted ones is
// read (once, whole pieces as always) and each run of it copied to where the wanted slice has it.
void OpenCheckpoint::read_resliced(const std::string& role, const std::string& parameter, const SliceLayout& wanted,
                                   int64_t rank, int64_t begin, int64_t numel, float* out, at::Tensor& buffer) {
  const SliceLayout& saved = layouts.at(parameter);
  std::vector<std::pair<int64_t, int64_t>> needed(size_t(saved.ranks), {INT64_MAX, -1});
  for_each_slice_run(wanted, rank, begin, begin + numel, [&](int64_t, int64_t whole, int64_t count) {
    for_each_whole_run(saved, whole, whole + count, [&](int64_t s, int64_t local, int64_t, int64_t n) {
      needed[size_t(s)].first = std::min(needed[size_t(s)].first, local);
      needed[size_t(s)].second = std::max(needed[size_t(s)].second, local + n);
    });
  });
  int64_t filled = 0;
  for (int64_t s = 0; s < saved.ranks; ++s) {
    // Plain variables: the lambda below captures them.
    const int64_t lo = needed[size_t(s)].first, hi = needed[size_t(s)].second;
    if (hi <= lo) continue;
    read_range(role, parameter, s * saved.slice_numel() + lo, hi - lo,
               [&](int64_t offset, int64_t count, const float* values) {
                 for_each_slice_run(saved, s, lo + offset, lo + offset + count, [&](int64_t local, int64_t whole, int64_t n) {
                   for_each_whole_run(wanted, whole, whole + n, [&](int64_t r, int64_t mine, int64_t w, int64_t m) {
                     const int64_t from = std::max(mine, begin), to = std::min(mine + m, begin + numel);
                     if (r != rank || from >= to) return;
                     const float* source = values + (local - lo - offset) + (w - whole) + (from - mine);
                     std::copy(source, source + (to - from), out + (from - begin));
                     filled += to - from;
                   });
                 });
               },
               buffer);
  }
  if (filled != numel)
    throw DataError(where + ": elements [" + std::to_string(begin) + ", " + std::to_string(begin + numel) + ") of '" +
                    role + "' of parameter '" + parameter + "' as slice " + std::to_string(rank) + " of " +
                    std::to_string(wanted.ranks) + ": " + std::to_string(filled) + " found in its saved slices");
}

}  // namespace zt::checkpoint_files
