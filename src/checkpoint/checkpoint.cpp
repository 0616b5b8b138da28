#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>

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

std::string rank_file_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

// Tensor names inside a rank file: "<role>:<parameter>:<first element>".
std::string fragment_name(const std::string& role, const std::string& parameter, int64_t begin) {
  return role + ":" + parameter + ":" + std::to_string(begin);
}

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open '" + path.string() + "' to flush it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error("flushing '" + path.string() + "' to disk: " + std::strerror(errno));
}

// Writes `text` to `path` durably and atomically (temporary file, fsync, rename).
void write_file_atomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error("cannot write '" + temporary.string() + "'");
  }
  fsync_path(temporary, false);
  fs::rename(temporary, path);
  fsync_path(path.parent_path(), true);
}

// Runs `work` on this rank; every rank learns whether all succeeded, and all throw if one failed
// (so that no rank waits in a later collective for one that gave up). The failing rank's message
// and error type reach every rank, so that the one rank that prints (rank 0) names the file.
void on_every_rank(Communicator& comm, const std::string& what, const std::function<void()>& work) {
  std::exception_ptr error;
  try {
    work();
  } catch (...) {
    error = std::current_exception();
  }
  at::Tensor failed = at::full({1}, error ? double(comm.rank() + 1) : 0.0, at::kDouble);
  comm.all_reduce(failed, ReduceOp::Max, "checkpoint." + what).wait();
  const int source = int(failed.item<double>()) - 1;
  if (source < 0) return;
  // The message of the (highest-numbered) failing rank, and whether it was bad input.
  std::string message;
  int kind = 0;  // 0 Error, 1 DataError, 2 ConfigError
  if (comm.rank() == source) {
    try {
      std::rethrow_exception(error);
    } catch (const ConfigError& e) {
      message = e.what(), kind = 2;
    } catch (const DataError& e) {
      message = e.what(), kind = 1;
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    if (message.empty()) message = "unknown error";
  }
  at::Tensor header = at::tensor({int64_t(message.size()), int64_t(kind)}, at::kLong);
  comm.broadcast(header, source, "checkpoint." + what + ".error").wait();
  at::Tensor text = at::zeros({header[0].item<int64_t>()}, at::kByte);
  if (comm.rank() == source) std::memcpy(text.data_ptr(), message.data(), message.size());
  comm.broadcast(text, source, "checkpoint." + what + ".error").wait();
  if (error) std::rethrow_exception(error);
  message.assign(reinterpret_cast<const char*>(text.data_ptr()), size_t(text.numel()));
  message += " (on rank " + std::to_string(source) + ")";
  if (header[1].item<int64_t>() == 2) throw ConfigError(message);
  if (header[1].item<int64_t>() == 1) throw DataError(message);
  throw Error(message);
}

// The manifest, its checksum verified.
json read_manifest(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read '" + path.string() + "'");
  std::string text{std::istreambuf_iterator<char>(in), {}};
  json manifest;
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

std::map<std::string, std::string> load_fragments(const fs::path& dir, const std::string& tag_in,
                                                  const std::vector<CheckpointParameter>& parameters,
                                                  std::vector<StateFragment>& fragments);

}  // namespace

void save_sharded_checkpoint(Communicator& comm, const fs::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last) {
  if (tag.empty() || tag.find('/') != std::string::npos || tag == "latest" || tag[0] == '.')
    throw ConfigError("checkpoint tag '" + tag + "': expected a plain name (not empty, 'latest', or starting with '.')");
  const int rank = comm.rank(), world = comm.world_size();
  const fs::path final_dir = dir / tag;
  const fs::path staging = dir / (".partial-" + tag);
  on_every_rank(comm, "save (preparing '" + staging.string() + "')", [&] {
    if (rank != 0) return;
    if (fs::exists(final_dir))
      throw Error("'" + final_dir.string() + "' already exists; a checkpoint is never overwritten");
    fs::create_directories(dir);
    // What interrupted saves left (one job saves into a directory at a time).
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().filename().string().rfind(".partial-", 0) == 0) fs::remove_all(entry.path());
    fs::create_directories(staging);
  });
  // Every rank with state writes its own file, in parallel.
  on_every_rank(comm, "save (writing '" + (staging / rank_file_name(rank, world)).string() + "')", [&] {
    if (fragments.empty()) return;
    std::vector<TensorRecord> records;
    for (const StateFragment& f : fragments)
      for (const auto& [role, tensor] : f.roles)
        records.push_back({fragment_name(role, f.parameter, f.begin), at::kFloat, {f.numel}});
    SafetensorsWriter writer(staging / rank_file_name(rank, world), records, {{"format", kFormat}});
    for (const StateFragment& f : fragments)
      for (const auto& [role, tensor] : f.roles) writer.write(tensor.reshape({-1}).to(at::kFloat));
    writer.finish();
  });
  // Which ranks wrote a file: the manifest lists them, so that a missing one is an error on load.
  at::Tensor wrote = at::zeros({world}, at::kLong);
  wrote[rank] = fragments.empty() ? 0 : 1;
  comm.all_reduce(wrote, ReduceOp::Sum, "checkpoint.save.files").wait();
  on_every_rank(comm, "save (publishing '" + final_dir.string() + "')", [&] {
    if (rank != 0) return;
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
    manifest["scalars"] = contents.scalars;
    manifest["configuration"] = contents.configuration;
    // The checksum covers the text as written with the checksum zeroed (docs/checkpoint.md).
    manifest["checksum"] = kZeroChecksum;
    manifest["checksum"] = crc32_hex(manifest.dump(1));
    write_file_atomically(staging / "manifest.json", manifest.dump(1));
    fsync_path(staging, true);
    fs::rename(staging, final_dir);
    fsync_path(dir, true);
    write_file_atomically(dir / "latest", tag + "\n");
    if (keep_last > 0) {
      // The newest by save order (the manifest's sequence is the directory's modification order).
      std::vector<std::pair<fs::file_time_type, fs::path>> saved;
      for (const auto& entry : fs::directory_iterator(dir))
        if (entry.is_directory() && fs::exists(entry.path() / "manifest.json") &&
            entry.path().filename().string()[0] != '.')
          saved.emplace_back(fs::last_write_time(entry.path() / "manifest.json"), entry.path());
      std::sort(saved.begin(), saved.end());
      for (size_t i = 0; i + size_t(keep_last) < saved.size(); ++i)
        if (saved[i].second != final_dir) fs::remove_all(saved[i].second);
    }
  });
}

std::map<std::string, std::string> load_sharded_checkpoint(Communicator& comm, const fs::path& dir,
                                                           const std::string& tag_in,
                                                           const std::vector<CheckpointParameter>& parameters,
                                                           std::vector<StateFragment>& fragments) {
  std::map<std::string, std::string> scalars;
  on_every_rank(comm, "load", [&] { scalars = load_fragments(dir, tag_in, parameters, fragments); });
  return scalars;
}

namespace {

fs::path resolve_tag(const fs::path& dir, const std::string& tag_in) {
  std::string tag = tag_in;
  if (tag.empty()) {
    std::ifstream latest(dir / "latest", std::ios::binary);
    if (!latest) throw DataError("no checkpoint in '" + dir.string() + "': '" + (dir / "latest").string() + "' is missing");
    // Exactly one line, as written: anything else is damage.
    const std::string text{std::istreambuf_iterator<char>(latest), {}};
    if (text.empty() || text.back() != '\n' || text.find('\n') != text.size() - 1)
      throw DataError("'" + (dir / "latest").string() + "' is damaged: expected one line naming a checkpoint");
    tag = text.substr(0, text.size() - 1);
    if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == ".." || !fs::is_directory(dir / tag))
      throw DataError("'" + (dir / "latest").string() + "' names '" + tag + "', which is not a checkpoint directory in '" +
                      dir.string() + "'");
  }
  return dir / tag;
}

// The checksum proves the manifest's bytes are intact, not that its fields have the expected
// types (a manifest edited by hand, or by another version, passes it). Fields are read inside
// this, so a wrong shape is a DataError naming the file instead of an escaping json exception.
template <typename F>
auto reading_manifest(const std::string& where, F&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const json::exception& e) {
    throw DataError(where + ": malformed manifest (" + e.what() + ")");
  } catch (const std::logic_error& e) {  // std::stoll of a tensor name's offset
    throw DataError(where + ": malformed checkpoint (" + e.what() + ")");
  }
}

// A checkpoint's manifest and files: every header validated, and an index of the saved pieces.
struct OpenCheckpoint {
  struct Piece {
    size_t file;
    std::string tensor;
    int64_t begin, numel;
  };
  fs::path root;
  json manifest;
  std::string where;  // the manifest's path, for messages
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::pair<std::string, std::string>, std::vector<Piece>> pieces;  // (role, parameter) -> pieces

  explicit OpenCheckpoint(const fs::path& checkpoint) : root(checkpoint) {
    manifest = read_manifest(root / "manifest.json");
    where = "'" + (root / "manifest.json").string() + "'";
    reading_manifest(where, [&] { index(); });
  }

  void index() {
    if (manifest.value("format", "") != kFormat || manifest.value("version", 0) != kVersion)
      throw DataError(where + ": not a zerotrain checkpoint of version " + std::to_string(kVersion));
    for (const auto& name : manifest.at("files")) {
      files.push_back(std::make_unique<SafetensorsReader>(root / name.get<std::string>()));
      for (const auto& e : files.back()->entries()) {
        const auto first = e.name.find(':'), last = e.name.rfind(':');
        if (first == std::string::npos || first == last || e.shape.size() != 1)
          throw DataError("'" + files.back()->path().string() + "': unexpected tensor '" + e.name + "'");
        pieces[{e.name.substr(0, first), e.name.substr(first + 1, last - first - 1)}].push_back(
            {files.size() - 1, e.name, std::stoll(e.name.substr(last + 1)), e.shape[0]});
      }
    }
  }

  // How many elements of `role` of `parameter` the files hold (an upper bound of what can be read).
  int64_t saved_elements(const std::string& role, const std::string& parameter) {
    int64_t total = 0;
    for (const Piece& piece : pieces[{role, parameter}]) total += piece.numel;
    return total;
  }

  // Copies elements [begin, begin + destination.numel()) of `role` of `parameter` into
  // `destination` (flat), reading whole saved pieces (checksums verified); all must be found.
  void read_range(const std::string& role, const std::string& parameter, int64_t begin, at::Tensor destination) {
    const int64_t numel = destination.numel();
    int64_t covered = 0;
    for (const Piece& piece : pieces[{role, parameter}]) {
      const int64_t lo = std::max(piece.begin, begin), hi = std::min(piece.begin + piece.numel, begin + numel);
      if (lo >= hi) continue;
      const at::Tensor saved = files[piece.file]->read(piece.tensor);
      destination.narrow(0, lo - begin, hi - lo).copy_(saved.narrow(0, lo - piece.begin, hi - lo));
      covered += hi - lo;
    }
    if (covered != numel)
      throw DataError(where + ": elements [" + std::to_string(begin) + ", " + std::to_string(begin + numel) + ") of '" +
                      role + "' of parameter '" + parameter + "' are not all in the listed files (" +
                      std::to_string(covered) + " found; a shard is missing, or it was saved with another optimizer)");
  }
};

std::map<std::string, std::string> load_fragments(const fs::path& dir, const std::string& tag_in,
                                                  const std::vector<CheckpointParameter>& parameters,
                                                  std::vector<StateFragment>& fragments) {
  OpenCheckpoint checkpoint(resolve_tag(dir, tag_in));
  const json& manifest = checkpoint.manifest;
  const std::string& where = checkpoint.where;
  // The same model: the same parameter names with the same shapes.
  std::map<std::string, std::vector<int64_t>> saved_shapes;
  reading_manifest(where, [&] {
    for (const auto& p : manifest.at("parameters")) saved_shapes[p.at("name")] = p.at("shape").get<std::vector<int64_t>>();
  });
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

  for (StateFragment& f : fragments)
    for (auto& [role, destination] : f.roles) checkpoint.read_range(role, f.parameter, f.begin, destination.reshape({-1}));
  return reading_manifest(where, [&] { return manifest.at("scalars").get<std::map<std::string, std::string>>(); });
}
}  // namespace

int64_t export_checkpoint(const fs::path& dir, const std::string& tag, const fs::path& out, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16)
    throw ConfigError(std::string("export: expected dtype fp32 or bf16, found ") + c10::toString(dtype));
  OpenCheckpoint checkpoint(resolve_tag(dir, tag));
  std::vector<TensorRecord> records;
  std::string step;
  reading_manifest(checkpoint.where, [&] {
    for (const auto& p : checkpoint.manifest.at("parameters")) {
      TensorRecord r{p.at("name").get<std::string>(), dtype, p.at("shape").get<std::vector<int64_t>>()};
      int64_t numel = 1;
      for (int64_t d : r.shape)
        if (d < 0 || __builtin_mul_overflow(numel, d, &numel))
          throw DataError(checkpoint.where + ": parameter '" + r.name + "' has an impossible shape " +
                          json(r.shape).dump());
      if (numel <= 0)
        throw DataError(checkpoint.where + ": parameter '" + r.name + "' has no elements; refusing to export a placeholder");
      // Before allocating the tensor: the files must hold that many elements at all.
      if (checkpoint.saved_elements("master", r.name) < numel)
        throw DataError(checkpoint.where + ": parameter '" + r.name + "' has " + std::to_string(numel) +
                        " elements, more than the listed files hold");
      records.push_back(std::move(r));
    }
    step = checkpoint.manifest.at("scalars").value("global_step", "");
  });
  if (records.empty()) throw DataError(checkpoint.where + ": no parameters to export");
  const fs::path partial = out.string() + ".partial";
  int64_t bytes = 0;
  try {
    SafetensorsWriter writer(partial, records,
                             {{"format", "pt"}, {"zerotrain.checkpoint", checkpoint.root.string()},
                              {"zerotrain.step", step}});
    for (const TensorRecord& r : records) {
      int64_t numel = 1;
      for (int64_t d : r.shape) numel *= d;
      at::Tensor full = at::empty({numel}, at::kFloat);
      checkpoint.read_range("master", r.name, 0, full);
      writer.write(full.view(r.shape).to(dtype));
    }
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
