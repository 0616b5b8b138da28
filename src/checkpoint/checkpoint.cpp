#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <optional>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>

#include "checkpoint/file_system.h"
#include "checkpoint/json_bounds.h"
#include "checkpoint/safetensors.h"
#include "zerotrain/comm.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kFormat = "zerotrain-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kZeroChecksum = "00000000";
// Bounds on a manifest, checked before and while parsing: a hostile one cannot make the parser
// build an outsized document. A manifest lists parameters, files and string maps: 4 levels deep
// (root, "parameters", one parameter, its shape); 64 MiB holds the names and shapes of about a
// million parameters.
constexpr int64_t kMaxManifestBytes = int64_t(64) << 20;
constexpr int kMaxManifestDepth = 4;
constexpr int kMaxWorldSize = 99'999;  // the rank file names have 5 digits
// "frozen": the whole value of a frozen parameter or floating-point buffer (rank 0 saves it).
const char* const kRoles[] = {"master", "exp_avg", "exp_avg_sq", "frozen"};

std::string rank_file_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

// Tensor names inside a rank file: "<role>:<parameter>:<first element>".
std::string fragment_name(const std::string& role, const std::string& parameter, int64_t begin) {
  return role + ":" + parameter + ":" + std::to_string(begin);
}

// "<digits>" as a non-negative int64, or -1.
int64_t parse_count(std::string_view text) {
  int64_t value = -1;
  if (text.empty() || text.size() > 19 || text.find_first_not_of("0123456789") != std::string_view::npos) return -1;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

// The roles of a fragment, however given, in name order (the order of its tensors in a file).
std::vector<std::string> role_names(const StateFragment& f) {
  std::set<std::string> names;
  auto add = [&](const std::string& role) {
    if (!names.insert(role).second)
      throw Error("checkpoint: role '" + role + "' of fragment '" + f.parameter + ":" + std::to_string(f.begin) +
                  "' is given twice (as a tensor, a source or a sink)");
  };
  for (const auto& entry : f.roles) add(entry.first);
  for (const auto& entry : f.sources) add(entry.first);
  for (const auto& entry : f.sinks) add(entry.first);
  return {names.begin(), names.end()};
}

// Writes `text` to `path` durably and atomically (temporary file, fsync, rename, fsync of the
// directory).
void write_file_atomically(FileSystem& files, const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  {
    auto file = files.create(temporary);
    file->write_at(text.data(), int64_t(text.size()), 0);
    file->sync();
    file->close();
  }
  files.rename(temporary, path);
  files.sync_path(path.parent_path(), true);
}

// A checkpoint tag: a plain directory name (it is joined to the checkpoint directory).
bool plain_tag(const std::string& tag) {
  return !tag.empty() && tag != "latest" && tag[0] != '.' && invalid_tensor_name(tag).empty() && tag.size() <= 255;
}


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

LoadedCheckpoint load_fragments(const fs::path& dir, const std::string& tag_in,
                                const std::vector<CheckpointParameter>& parameters,
                                std::vector<StateFragment>& fragments,
                                const std::function<void(const LoadedCheckpoint&)>& check,
                                const std::vector<CheckpointParameter>& frozen);

}  // namespace

int64_t checkpoint_chunk_bytes() {
  constexpr int64_t kDefault = int64_t(64) << 20, kGranule = 4096, kMax = int64_t(1) << 30;
  const char* value = std::getenv("ZT_CHECKPOINT_CHUNK_BYTES");
  if (value == nullptr || *value == '\0') return kDefault;
  const int64_t bytes = parse_count(value);
  if (bytes < kGranule || bytes > kMax || bytes % kGranule != 0)
    throw ConfigError("ZT_CHECKPOINT_CHUNK_BYTES='" + std::string(value) + "': expected a multiple of " +
                      std::to_string(kGranule) + " from " + std::to_string(kGranule) + " to " + std::to_string(kMax));
  return bytes;
}

void save_sharded_checkpoint(Communicator& comm, const fs::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last) {
  save_sharded_checkpoint(comm, dir, tag, contents, fragments, keep_last, FileSystem::real());
}

namespace {

// Rank 0's last phase of a save: the manifest into the staging directory, then the one step that
// publishes (the directory's rename and `latest`'s replacement), undone if anything up to the
// final fsync fails, so that a failed save leaves `latest` and the directory as they were.
void publish(FileSystem& files, const fs::path& dir, const std::string& tag, const fs::path& staging,
             const fs::path& final_dir, const std::string& manifest_text) {
  write_file_atomically(files, staging / "manifest.json", manifest_text);
  // The new `latest` is written before anything is published, so that running out of space fails
  // here, while there is nothing to undo.
  const fs::path latest = dir / "latest", latest_tmp = dir / "latest.tmp";
  std::optional<std::string> previous;
  if (std::ifstream in(latest, std::ios::binary); in) previous = std::string{std::istreambuf_iterator<char>(in), {}};
  {
    auto file = files.create(latest_tmp);
    const std::string text = tag + "\n";
    file->write_at(text.data(), int64_t(text.size()), 0);
    file->sync();
    file->close();
  }
  files.rename(staging, final_dir);
  bool replaced = false;
  try {
    files.rename(latest_tmp, latest);
    replaced = true;
    files.sync_path(dir, true);  // both renames durable
  } catch (const std::exception& e) {
    std::string undo_error;
    try {
      if (replaced) {
        if (previous) write_file_atomically(files, latest, *previous);
        else files.remove_all(latest);
      }
      files.rename(final_dir, staging);
      files.sync_path(dir, true);
    } catch (const std::exception& undo) {
      undo_error = undo.what();
    }
    if (undo_error.empty()) throw;
    throw Error(std::string(e.what()) + "; undoing the publication of '" + final_dir.string() + "' failed too: " +
                undo_error);
  }
}

// This rank's file of a save: every role of every fragment, the roles given as sources through one
// buffer of at most a chunk.
void write_rank_file(FileSystem& files, const fs::path& path, const std::vector<StateFragment>& fragments) {
  std::vector<TensorRecord> records;
  int64_t largest_source = 0;
  for (const StateFragment& f : fragments) {
    for (const std::string& role : role_names(f))
      records.push_back({fragment_name(role, f.parameter, f.begin), at::kFloat, {f.numel}});
    if (!f.sources.empty()) largest_source = std::max(largest_source, f.numel);
  }
  SafetensorsWriter writer(files, path, records, {{"format", kFormat}});
  at::Tensor buffer;
  if (largest_source > 0)
    buffer = at::empty({std::min(largest_source, checkpoint_chunk_bytes() / int64_t(sizeof(float)))}, at::kFloat);
  for (const StateFragment& f : fragments)
    for (const std::string& role : role_names(f)) {
      if (auto tensor = f.roles.find(role); tensor != f.roles.end()) {
        writer.write(tensor->second.reshape({-1}).to(at::kCPU, at::kFloat));  // device state too
        continue;
      }
      const FragmentSource& source = f.sources.at(role);
      if (f.numel == 0) writer.append(nullptr, 0);
      for (int64_t done = 0; done < f.numel;) {
        const int64_t n = std::min(f.numel - done, buffer.numel());
        source(done, n, buffer.data_ptr<float>());
        writer.append(buffer.data_ptr(), n * int64_t(sizeof(float)));
        done += n;
      }
    }
  writer.finish();
}

// The manifest of a save; `wrote` says which ranks wrote a file, so that a missing one is an
// error on load. The checksum covers the text as written with the checksum zeroed
// (docs/checkpoint.md).
json manifest_of(const std::string& tag, int world, const at::Tensor& wrote, const CheckpointContents& contents) {
  json manifest;
  manifest["format"] = kFormat;
  manifest["version"] = kVersion;
  manifest["tag"] = tag;
  manifest["world_size"] = world;
  manifest["files"] = json::array();
  for (int r = 0; r < world; ++r)
    if (wrote[r].item<int64_t>() > 0) manifest["files"].push_back(rank_file_name(r, world));
  manifest["parameters"] = json::array();
  for (const auto& p : contents.parameters) manifest["parameters"].push_back({{"name", p.name}, {"shape", p.shape}});
  manifest["frozen"] = json::array();
  for (const auto& p : contents.frozen) manifest["frozen"].push_back({{"name", p.name}, {"shape", p.shape}});
  manifest["scalars"] = contents.scalars;
  manifest["configuration"] = contents.configuration;
  manifest["checksum"] = kZeroChecksum;
  manifest["checksum"] = crc32_hex(manifest.dump(1));
  return manifest;
}

// keep_last: the newest checkpoints by save order (the manifest's modification order) stay.
// Published already: a failure here names what it could not remove.
void keep_newest(FileSystem& files, const fs::path& dir, const fs::path& final_dir, int keep_last) {
  std::vector<std::pair<fs::file_time_type, fs::path>> saved;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_directory() && fs::exists(entry.path() / "manifest.json") && entry.path().filename().string()[0] != '.')
      saved.emplace_back(fs::last_write_time(entry.path() / "manifest.json"), entry.path());
  std::sort(saved.begin(), saved.end());
  for (size_t i = 0; i + size_t(keep_last) < saved.size(); ++i)
    if (saved[i].second != final_dir) files.remove_all(saved[i].second);
}

}  // namespace

void save_sharded_checkpoint(Communicator& comm, const fs::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last, FileSystem& files) {
  if (!plain_tag(tag))
    throw ConfigError("checkpoint tag '" + tag + "': expected a plain name (not empty, 'latest', starting with '.', or "
                      "containing '/', '..' or a control character)");
  const int rank = comm.rank(), world = comm.world_size();
  const fs::path final_dir = dir / tag;
  const fs::path staging = dir / (".partial-" + tag);
  try {
    on_every_rank(comm, "save (preparing '" + staging.string() + "')", [&] {
      if (rank != 0) return;
      if (fs::exists(final_dir))
        throw Error("'" + final_dir.string() + "' already exists; a checkpoint is never overwritten");
      files.create_directories(dir);
      // What interrupted saves left (one job saves into a directory at a time).
      for (const auto& entry : fs::directory_iterator(dir))
        if (entry.path().filename().string().rfind(".partial-", 0) == 0) files.remove_all(entry.path());
      files.create_directories(staging);
    });
    // Every rank with state writes its own file, in parallel.
    on_every_rank(comm, "save (writing '" + (staging / rank_file_name(rank, world)).string() + "')", [&] {
      if (!fragments.empty()) write_rank_file(files, staging / rank_file_name(rank, world), fragments);
    });
  } catch (...) {
    // Nothing was published; the staging directory goes (best effort: the next save clears it too).
    if (rank == 0) try {
        files.remove_all(staging);
      } catch (...) {
      }
    throw;
  }
  // Which ranks wrote a file: the manifest lists them, so that a missing one is an error on load.
  at::Tensor wrote = at::zeros({world}, at::kLong);
  wrote[rank] = fragments.empty() ? 0 : 1;
  comm.all_reduce(wrote, ReduceOp::Sum, "checkpoint.save.files").wait();
  on_every_rank(comm, "save (publishing '" + final_dir.string() + "')", [&] {
    if (rank != 0) return;
    const json manifest = manifest_of(tag, world, wrote, contents);
    try {
      publish(files, dir, tag, staging, final_dir, manifest.dump(1));
    } catch (...) {
      try {
        files.remove_all(staging);
        files.remove_all(dir / "latest.tmp");
      } catch (...) {
      }
      throw;
    }
    if (keep_last > 0) keep_newest(files, dir, final_dir, keep_last);
  });
}

std::map<std::string, std::string> load_sharded_checkpoint(Communicator& comm, const fs::path& dir,
                                                           const std::string& tag_in,
                                                           const std::vector<CheckpointParameter>& parameters,
                                                           std::vector<StateFragment>& fragments) {
  return load_sharded_checkpoint(comm, dir, tag_in, parameters, fragments, nullptr, {}).scalars;
}

LoadedCheckpoint load_sharded_checkpoint(Communicator& comm, const fs::path& dir, const std::string& tag_in,
                                         const std::vector<CheckpointParameter>& parameters,
                                         std::vector<StateFragment>& fragments,
                                         const std::function<void(const LoadedCheckpoint&)>& check,
                                         const std::vector<CheckpointParameter>& frozen) {
  LoadedCheckpoint loaded;
  on_every_rank(comm, "load", [&] { loaded = load_fragments(dir, tag_in, parameters, fragments, check, frozen); });
  return loaded;
}

namespace {

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

// A checkpoint's manifest and files, every part validated before any tensor is read: the
// manifest's structure, its file names (plain rank file names of its world size: a name never
// leads outside the checkpoint's directory), the parameters (valid names, shapes whose element
// count does not overflow), every file's header, and the saved pieces (known roles, fp32, inside
// their parameter, no two overlapping).
struct OpenCheckpoint {
  struct Piece {
    size_t file;
    std::string tensor;
    int64_t begin, numel;
  };
  fs::path root;
  json manifest;
  std::string where;  // the manifest's path, for messages
  std::vector<CheckpointParameter> parameters;  // in saved order
  std::vector<CheckpointParameter> frozen;      // frozen parameters and buffers, in saved order
  bool has_frozen = false;                      // the manifest lists them (saved since the list exists)
  std::map<std::string, int64_t> numels;        // of both lists
  std::map<std::string, std::string> scalars, configuration;
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::pair<std::string, std::string>, std::vector<Piece>> pieces;  // (role, parameter) -> pieces by begin

  explicit OpenCheckpoint(const fs::path& checkpoint) : root(checkpoint) {
    where = "'" + (root / "manifest.json").string() + "'";
    manifest = read_manifest(root / "manifest.json");
    std::vector<std::string> names;
    try {
      if (!manifest.is_object() || manifest.value("format", "") != kFormat || manifest.value("version", 0) != kVersion)
        throw DataError(where + ": not a zerotrain checkpoint of version " + std::to_string(kVersion));
      names = read_file_names();
      has_frozen = manifest.contains("frozen");
      read_parameter_list("parameters", parameters);
      if (has_frozen) read_parameter_list("frozen", frozen);
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
  std::vector<std::string> read_file_names() const {
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
  // overflow, no name twice across both lists.
  void read_parameter_list(const char* list, std::vector<CheckpointParameter>& into) {
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
      into.push_back(std::move(parameter));
    }
  }

  // Opens a rank file (its header validated) and indexes its tensors: each "<role>:<parameter>:
  // <first element>", fp32, one dimension, inside a parameter of the manifest.
  void index_pieces(const std::string& name) {
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
  int64_t covered(const std::string& role, const std::string& parameter, int64_t begin, int64_t numel) const {
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
  void read_range(const std::string& role, const std::string& parameter, int64_t begin, int64_t numel,
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

  // The same into a flat fp32 tensor of numel elements.
  void read_range(const std::string& role, const std::string& parameter, int64_t begin, at::Tensor destination,
                  at::Tensor& buffer) {
    destination = destination.view({-1});
    read_range(role, parameter, begin, destination.numel(),
               [&](int64_t offset, int64_t count, const float* values) {
                 destination.narrow(0, offset, count)
                     .copy_(at::from_blob(const_cast<float*>(values), {count}, at::kFloat));
               },
               buffer);
  }
};

LoadedCheckpoint load_fragments(const fs::path& dir, const std::string& tag_in,
                                const std::vector<CheckpointParameter>& parameters,
                                std::vector<StateFragment>& fragments,
                                const std::function<void(const LoadedCheckpoint&)>& check,
                                const std::vector<CheckpointParameter>& frozen) {
  checkpoint_chunk_bytes();  // a bad ZT_CHECKPOINT_CHUNK_BYTES fails here, on every rank, before anything is read
  OpenCheckpoint checkpoint(resolve_tag(dir, tag_in));
  const std::string& where = checkpoint.where;
  // The same model: the same parameter names with the same shapes.
  std::map<std::string, std::vector<int64_t>> saved_shapes;
  for (const auto& p : checkpoint.parameters) saved_shapes[p.name] = p.shape;
  for (const auto& p : parameters) {
    auto it = saved_shapes.find(p.name);
    if (it == saved_shapes.end())
      throw DataError(where + ": checkpoint of another model: it has no parameter '" + p.name + "'");
    if (it->second != p.shape)
      throw DataError(where + ": checkpoint of another model: parameter '" + p.name + "' has shape " +
                      json(it->second).dump() + " there and " + json(p.shape).dump() + " here");
  }
  if (saved_shapes.size() != parameters.size())
    throw DataError(where + ": checkpoint of another model: " + std::to_string(saved_shapes.size()) +
                    " parameters there, " + std::to_string(parameters.size()) + " here");
  // The frozen values likewise, when the checkpoint lists them.
  if (checkpoint.has_frozen) {
    std::map<std::string, std::vector<int64_t>> saved_frozen;
    for (const auto& p : checkpoint.frozen) saved_frozen[p.name] = p.shape;
    for (const auto& p : frozen) {
      auto it = saved_frozen.find(p.name);
      if (it == saved_frozen.end())
        throw DataError(where + ": checkpoint of another model: it has no frozen parameter or buffer '" + p.name +
                        "' (frozen here)");
      if (it->second != p.shape)
        throw DataError(where + ": checkpoint of another model: frozen '" + p.name + "' has shape " +
                        json(it->second).dump() + " there and " + json(p.shape).dump() + " here");
    }
    if (saved_frozen.size() != frozen.size())
      throw DataError(where + ": checkpoint of another model: " + std::to_string(saved_frozen.size()) +
                      " frozen parameters and buffers there, " + std::to_string(frozen.size()) + " here");
  }
  LoadedCheckpoint loaded{checkpoint.has_frozen, checkpoint.scalars, checkpoint.configuration, where};
  if (check) check(loaded);
  at::Tensor buffer;  // one read buffer of at most a chunk for the whole load
  for (StateFragment& f : fragments)
    for (const std::string& role : role_names(f)) {
      if (role == "frozen" && !checkpoint.has_frozen) continue;
      if (auto tensor = f.roles.find(role); tensor != f.roles.end()) {
        checkpoint.read_range(role, f.parameter, f.begin, tensor->second, buffer);
      } else if (auto sink = f.sinks.find(role); sink != f.sinks.end()) {
        checkpoint.read_range(role, f.parameter, f.begin, f.numel, sink->second, buffer);
      } else {
        throw Error("checkpoint: role '" + role + "' of fragment '" + f.parameter + "' is given as a source to a load");
      }
    }
  return loaded;
}
}  // namespace

struct CheckpointModel::State {
  explicit State(const fs::path& checkpoint) : open(checkpoint) {}
  OpenCheckpoint open;
  std::vector<CheckpointParameter> tensors;
  std::map<std::string, std::string> role;  // tensor -> the role holding it
  at::Tensor buffer;
};

CheckpointModel::CheckpointModel(const fs::path& dir, const std::string& tag)
    : state_(std::make_unique<State>(resolve_tag(dir, tag))) {
  State& s = *state_;
  auto add = [&](const CheckpointParameter& p, const std::string& role) {
    const int64_t numel = s.open.numels.at(p.name);
    if (numel <= 0)
      throw DataError(s.open.where + ": parameter '" + p.name + "' has no elements; refusing to export a placeholder");
    // Checked from the headers before anything is allocated or written: every element is saved.
    if (const int64_t found = s.open.covered(role, p.name, 0, numel); found != numel)
      throw DataError(s.open.where + ": " + (role == "frozen" ? "frozen tensor '" : "parameter '") + p.name + "' has " +
                      std::to_string(numel) + " elements, " + std::to_string(found) +
                      " of them in the listed files (a shard is missing); refusing to export it");
    s.tensors.push_back(p);
    s.role[p.name] = role;
  };
  for (const auto& p : s.open.parameters) add(p, "master");
  for (const auto& p : s.open.frozen) add(p, "frozen");
  if (s.tensors.empty()) throw DataError(s.open.where + ": no parameters to export");
}

CheckpointModel::~CheckpointModel() = default;
const std::vector<CheckpointParameter>& CheckpointModel::tensors() const { return state_->tensors; }
const std::map<std::string, std::string>& CheckpointModel::configuration() const { return state_->open.configuration; }
const std::map<std::string, std::string>& CheckpointModel::scalars() const { return state_->open.scalars; }
std::string CheckpointModel::root() const { return state_->open.root.string(); }
std::string CheckpointModel::where() const { return state_->open.where; }

at::Tensor CheckpointModel::read(const std::string& name) {
  State& s = *state_;
  auto role = s.role.find(name);
  if (role == s.role.end()) throw DataError(s.open.where + ": no tensor '" + name + "' in the checkpoint");
  const int64_t numel = s.open.numels.at(name);
  at::Tensor full = at::empty({numel}, at::kFloat);
  s.open.read_range(role->second, name, 0, full, s.buffer);
  for (const auto& p : s.tensors)
    if (p.name == name) return full.view(p.shape);
  return full;
}

int64_t export_checkpoint(const fs::path& dir, const std::string& tag, const fs::path& out, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    throw ConfigError(std::string("export: expected dtype fp32 or bf16, found ") + c10::toString(dtype));
  CheckpointModel model(dir, tag);
  std::vector<TensorRecord> records;
  for (const auto& p : model.tensors()) records.push_back({p.name, dtype, p.shape});
  const fs::path partial = out.string() + ".partial";
  int64_t bytes = 0;
  try {
    SafetensorsWriter writer(partial, records,
                             {{"format", "pt"}, {"zerotrain.checkpoint", model.root()},
                              {"zerotrain.step", model.scalars().count("global_step") ? model.scalars().at("global_step") : ""}});
    for (const TensorRecord& r : records) writer.write(model.read(r.name).to(dtype));
    writer.finish();
    bytes = writer.bytes();
    fs::rename(partial, out);
  } catch (...) {
    std::error_code ignored;
    fs::remove(partial, ignored);
    throw;
  }
  return bytes;
}

}  // namespace zt
