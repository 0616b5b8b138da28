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
#include "checkpoint/open_checkpoint.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace checkpoint_files;

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

void save_sharded_checkpoint(CheckpointGroup group, const fs::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last) {
  save_sharded_checkpoint(group, dir, tag, contents, fragments, keep_last, FileSystem::real());
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
  const bool sliced = std::any_of(contents.parameters.begin(), contents.parameters.end(),
                                  [](const CheckpointParameter& p) { return p.split.ranks > 1; });
  manifest["version"] = sliced ? kSlicedVersion : kVersion;
  manifest["tag"] = tag;
  manifest["world_size"] = world;
  manifest["files"] = json::array();
  for (int r = 0; r < world; ++r)
    if (wrote[r].item<int64_t>() > 0) manifest["files"].push_back(rank_file_name(r, world));
  manifest["parameters"] = json::array();
  for (const auto& p : contents.parameters) {
    json entry = {{"name", p.name}, {"shape", p.shape}};
    if (p.split.ranks > 1) entry["split"] = {{"dim", p.split.dim}, {"parts", p.split.parts}, {"ranks", p.split.ranks}};
    manifest["parameters"].push_back(std::move(entry));
  }
  manifest["frozen"] = json::array();
  for (const auto& p : contents.frozen) manifest["frozen"].push_back({{"name", p.name}, {"shape", p.shape}});
  manifest["scalars"] = contents.scalars;
  manifest["configuration"] = contents.configuration;
  manifest["checksum"] = kZeroChecksum;
  manifest["checksum"] = crc32_hex(manifest.dump(1));
  return manifest;
}

// What this rank writes: a split parameter's pieces at their place in the saved concatenation of
// its slices; a value replicated over the tensor group (not split, or frozen) from tensor rank 0
// alone. Throws zt::Error for a split that is not this group's.
std::vector<StateFragment> placed_fragments(const CheckpointGroup& group, const CheckpointContents& contents,
                                            const std::vector<StateFragment>& fragments) {
  std::map<std::string, const CheckpointParameter*> by_name;
  for (const auto& p : contents.parameters) {
    by_name[p.name] = &p;
    if (p.split.ranks > 1 && (p.split.ranks != group.tensor_size() || p.split.rank != group.tensor_rank()))
      throw Error("checkpoint: parameter '" + p.name + "' is slice " + std::to_string(p.split.rank) + " of " +
                  std::to_string(p.split.ranks) + ", expected slice " + std::to_string(group.tensor_rank()) + " of " +
                  std::to_string(group.tensor_size()) + " (the tensor group saving it)");
  }
  std::vector<StateFragment> placed;
  for (const StateFragment& f : fragments) {
    auto p = by_name.find(f.parameter);
    const bool split = p != by_name.end() && p->second->split.ranks > 1;
    if (!split && group.tensor_rank() != 0) continue;
    placed.push_back(f);
    if (split) placed.back().begin += p->second->split.rank * layout_of(*p->second).slice_numel();
  }
  return placed;
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

void save_sharded_checkpoint(CheckpointGroup comm, const fs::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& given,
                             int keep_last, FileSystem& files) {
  if (!plain_tag(tag))
    throw ConfigError("checkpoint tag '" + tag + "': expected a plain name (not empty, 'latest', starting with '.', or "
                      "containing '/', '..' or a control character)");
  const int rank = comm.rank(), world = comm.world_size();
  const fs::path final_dir = dir / tag;
  const fs::path staging = dir / (".partial-" + tag);
  std::vector<StateFragment> fragments;
  try {
    on_every_rank(comm, "save (preparing '" + staging.string() + "')", [&] {
      fragments = placed_fragments(comm, contents, given);
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
  comm.all_reduce(wrote, ReduceOp::Sum, "checkpoint.save.files");
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

std::map<std::string, std::string> load_sharded_checkpoint(CheckpointGroup comm, const fs::path& dir,
                                                           const std::string& tag_in,
                                                           const std::vector<CheckpointParameter>& parameters,
                                                           std::vector<StateFragment>& fragments) {
  return load_sharded_checkpoint(comm, dir, tag_in, parameters, fragments, nullptr, {}).scalars;
}

LoadedCheckpoint load_sharded_checkpoint(CheckpointGroup comm, const fs::path& dir, const std::string& tag_in,
                                         const std::vector<CheckpointParameter>& parameters,
                                         std::vector<StateFragment>& fragments,
                                         const std::function<void(const LoadedCheckpoint&)>& check,
                                         const std::vector<CheckpointParameter>& frozen) {
  LoadedCheckpoint loaded;
  on_every_rank(comm, "load", [&] { loaded = load_fragments(dir, tag_in, parameters, fragments, check, frozen); });
  return loaded;
}

namespace {


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
  // The slices this rank holds now: a fragment's elements count within its parameter's slice.
  std::map<std::string, std::pair<SliceLayout, int64_t>> current;
  for (const auto& p : parameters) current[p.name] = {layout_of(p), p.split.rank};
  at::Tensor buffer;  // one read buffer of at most a chunk for the whole load
  for (StateFragment& f : fragments)
    for (const std::string& role : role_names(f)) {
      if (role == "frozen" && !checkpoint.has_frozen) continue;
      const auto held = current.find(f.parameter);
      const SliceLayout wanted = held != current.end() ? held->second.first : SliceLayout{};  // frozen: whole
      const int64_t slice = held != current.end() ? held->second.second : 0;
      if (auto tensor = f.roles.find(role); tensor != f.roles.end()) {
        const at::Tensor& t = tensor->second;
        const bool direct = t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == f.numel;
        at::Tensor into = direct ? t : at::empty({f.numel}, at::kFloat);
        checkpoint.read_slice(role, f.parameter, wanted, slice, f.begin, f.numel, into.data_ptr<float>(), buffer);
        if (!direct) t.view({-1}).copy_(into);
      } else if (auto sink = f.sinks.find(role); sink != f.sinks.end()) {
        const SliceLayout& saved = checkpoint.layouts.at(f.parameter);
        if (saved.same_slices(wanted)) {
          const int64_t first = (wanted.whole() ? 0 : slice * saved.slice_numel()) + f.begin;
          checkpoint.read_range(role, f.parameter, first, f.numel, sink->second, buffer);
          continue;
        }
        // Cut otherwise when saved: this fragment gathered first (one parameter's at a time), then
        // handed on in order, a chunk at a time.
        at::Tensor staged = at::empty({f.numel}, at::kFloat);
        checkpoint.read_slice(role, f.parameter, wanted, slice, f.begin, f.numel, staged.data_ptr<float>(), buffer);
        const int64_t chunk = checkpoint_chunk_bytes() / int64_t(sizeof(float));
        for (int64_t done = 0; done < f.numel; done += chunk)
          sink->second(done, std::min(chunk, f.numel - done), staged.data_ptr<float>() + done);
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
bool CheckpointModel::frozen(const std::string& name) const {
  auto role = state_->role.find(name);
  if (role == state_->role.end()) throw DataError(state_->open.where + ": no tensor '" + name + "' in the checkpoint");
  return role->second == "frozen";
}

at::Tensor CheckpointModel::read(const std::string& name) {
  State& s = *state_;
  auto role = s.role.find(name);
  if (role == s.role.end()) throw DataError(s.open.where + ": no tensor '" + name + "' in the checkpoint");
  const int64_t numel = s.open.numels.at(name);
  at::Tensor full = at::empty({numel}, at::kFloat);
  s.open.read_slice(role->second, name, SliceLayout{}, 0, 0, numel, full.data_ptr<float>(), s.buffer);
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
