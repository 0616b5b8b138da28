// Sharded checkpoints: state by parameter name and global element range, never by bucket or
// rank, so that a checkpoint saved by N ranks at any stage loads on M ranks at any stage
// (docs/checkpoint.md). Internal; the engine's save_checkpoint/load_checkpoint use it.
//
// Contract
// - Both functions are collectives: every rank calls them with the same dir and tag.
// - save: ranks with fragments write them (their own file, in parallel, streaming roles given as
//   sources piece by piece) into a temporary
//   directory; rank 0 adds the manifest, makes everything durable and renames the directory to
//   dir/tag, then replaces dir/latest; only then does any rank return. A failure on any rank throws
//   on every rank and leaves the previous checkpoints and `latest` untouched.
// - load: each rank reads only the saved fragments that overlap the ranges it owns now, verifying
//   checksums, and fails with zt::DataError naming the file and the problem for a missing
//   `latest` target, a missing or damaged file, a checkpoint of another model, or a range no file
//   holds. A saved piece is read whole (so that its checksum is verified), in reads of at most
//   checkpoint_chunk_bytes(); a sink may have received data of a piece whose checksum then fails.
//   Every part of a checkpoint is validated before it is used, whatever the files hold
//   (docs/checkpoint.md "Hostile files"): a manifest's file names must be its own rank file
//   names, so no name leads outside the checkpoint's directory.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zt {

class Communicator;
class FileSystem;
enum class ReduceOp;

// How a parameter is split over a tensor group (zerotrain/zero/blocks.h TensorSplit): this rank holds
// slice `rank` of `ranks` (ranks = 1: the whole tensor). A checkpoint keeps the split parameter's
// slices in rank order and loads them into any other split, or the whole tensor.
struct CheckpointSplit {
  int dim = 0;
  int parts = 1;
  int ranks = 1;
  int rank = 0;
};

struct CheckpointParameter {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's, split or not
  CheckpointSplit split;

  CheckpointParameter() = default;
  CheckpointParameter(std::string name_, std::vector<int64_t> shape_, CheckpointSplit split_ = {})
      : name(std::move(name_)), shape(std::move(shape_)), split(split_) {}
};

// The ranks that save or load one checkpoint together: one communicator, or the data-parallel
// group and the tensor group of a 2-D grid (zerotrain/comm/comm.h make_process_grid), whose ranks
// count as data rank × T + tensor rank. The ranks of a tensor group must share their data rank
// (the engine checks it). Holds the communicators by reference: they outlive it.
class CheckpointGroup {
 public:
  CheckpointGroup(Communicator& comm);  // NOLINT(google-explicit-constructor): any communicator is a group
  CheckpointGroup(Communicator& data, Communicator& tensor);
  int rank() const;
  int world_size() const;
  int tensor_rank() const;
  int tensor_size() const;
  // Collectives over every rank of the group: the data-parallel group's, then the tensor group's.
  void all_reduce(at::Tensor& tensor, ReduceOp op, const std::string& what);
  void broadcast(at::Tensor& tensor, int source, const std::string& what);

 private:
  Communicator* data_;
  Communicator* tensor_ = nullptr;
};

// Elements [offset, offset + count) of one role of a fragment, counted from the fragment's
// `begin`, as fp32: produced into `out` when saving (a role that is not in memory, e.g. on NVMe,
// read piece by piece), consumed from `values` when loading.
using FragmentSource = std::function<void(int64_t offset, int64_t count, float* out)>;
using FragmentSink = std::function<void(int64_t offset, int64_t count, const float* values)>;

// A contiguous range of one parameter's flattened elements with its state per role ("master",
// "exp_avg", "exp_avg_sq"). Each role is given one way:
// - roles: an fp32 tensor of `numel` elements, the source when saving (written as is, no copy)
//   and the destination when loading;
// - sources (saving): called for consecutive pieces of at most checkpoint_chunk_bytes(), in
//   order, each into one reused buffer, so a role that lives on disk is never whole in memory;
// - sinks (loading): called with consecutive pieces of at most checkpoint_chunk_bytes(), in
//   increasing offset order, each element once. What a sink received is verified only when the
//   load returns: a sink must write to staging that a failed load discards.
// The file holds the same tensors whichever way a role was given.
struct StateFragment {
  std::string parameter;
  int64_t begin = 0;
  int64_t numel = 0;
  std::map<std::string, at::Tensor> roles;
  std::map<std::string, FragmentSource> sources;
  std::map<std::string, FragmentSink> sinks;
};

// The bytes of state a checkpoint moves at a time: the pieces of sources and sinks and the read
// buffer, so that the host memory a save or load uses for state beyond the roles given as
// tensors is a small multiple of it. 64 MiB, or the environment variable
// ZT_CHECKPOINT_CHUNK_BYTES (a multiple of 4096 from 4096 to 1 GiB; zt::ConfigError otherwise).
int64_t checkpoint_chunk_bytes();

// Runs `work` on this rank; every rank learns whether all succeeded, and all throw if one failed
// (so that no rank waits in a later collective for one that gave up), with the failing rank's
// message and error type (ConfigError, DataError or Error). `what` labels the collective.
void on_every_rank(CheckpointGroup group, const std::string& what, const std::function<void()>& work);

struct CheckpointContents {
  std::vector<CheckpointParameter> parameters;     // every trainable parameter: the model's identity
  // The model's other values: frozen parameters and floating-point buffers, whole, saved by the
  // fragments of role "frozen" (rank 0's). Listed in the manifest as "frozen"; a checkpoint saved
  // before that list existed has none.
  std::vector<CheckpointParameter> frozen;
  std::map<std::string, std::string> scalars;      // counters, loss scaler, the caller's own state
  std::map<std::string, std::string> configuration;  // the resolved configuration it was saved with
};

// Keeps the newest `keep_last` checkpoints of dir (0: all); the one `latest` names is never removed.
void save_sharded_checkpoint(CheckpointGroup group, const std::filesystem::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last);

// The same, with every file operation of the save through `files` (checkpoint/file_system.h):
// each rank may pass its own.
void save_sharded_checkpoint(CheckpointGroup group, const std::filesystem::path& dir, const std::string& tag,
                             const CheckpointContents& contents, const std::vector<StateFragment>& fragments,
                             int keep_last, FileSystem& files);

// tag empty: the one dir/latest names (a tag given must be a plain name: zt::ConfigError if not).
// Checks `parameters` against the checkpoint's, fills every role of every fragment (tensors and
// sinks), and returns the saved scalars. `frozen` (when given) is checked against the
// checkpoint's frozen list the same way, unless the checkpoint has none.
std::map<std::string, std::string> load_sharded_checkpoint(CheckpointGroup group, const std::filesystem::path& dir,
                                                           const std::string& tag,
                                                           const std::vector<CheckpointParameter>& parameters,
                                                           std::vector<StateFragment>& fragments);

struct LoadedCheckpoint {
  // Whether the checkpoint lists frozen values: without the list (saved before it existed),
  // fragments of role "frozen" are left unfilled.
  bool has_frozen = false;
  std::map<std::string, std::string> scalars;
  std::map<std::string, std::string> configuration;  // as saved
  std::string manifest;  // the manifest's path in quotes, for messages
};

// The same, returning the saved configuration too; `check` (if set) runs on every rank after the
// manifest and every file header are validated and before any tensor is read, and what it throws
// fails the load on every rank (the engine refuses another optimizer's state there).
LoadedCheckpoint load_sharded_checkpoint(CheckpointGroup group, const std::filesystem::path& dir, const std::string& tag,
                                         const std::vector<CheckpointParameter>& parameters,
                                         std::vector<StateFragment>& fragments,
                                         const std::function<void(const LoadedCheckpoint&)>& check,
                                         const std::vector<CheckpointParameter>& frozen = {});

// Writes the model's weights from the checkpoint dir/tag (tag empty: dir/latest) as one
// safetensors file `out` with one tensor per trainable parameter, named as in the model, in
// `dtype` (fp32, or bf16 rounded to nearest even), followed by the frozen parameters and
// floating-point buffers the checkpoint lists. Streams parameter by parameter: memory stays
// near the largest parameter, never the model. Writes `out` atomically (a temporary file renamed
// when complete) and refuses to write a tensor whose elements are not all in the checkpoint.
// Returns the bytes written.
int64_t export_checkpoint(const std::filesystem::path& dir, const std::string& tag, const std::filesystem::path& out,
                          at::ScalarType dtype);

// A checkpoint's model, tensor by tensor, for the exports: every trainable parameter (assembled
// from the master pieces of all rank files) and every frozen value, in that order. Validates the
// whole checkpoint and that every tensor is fully covered when opened (zt::DataError otherwise).
class CheckpointModel {
 public:
  CheckpointModel(const std::filesystem::path& dir, const std::string& tag);
  ~CheckpointModel();
  const std::vector<CheckpointParameter>& tensors() const;
  const std::map<std::string, std::string>& configuration() const;  // the resolved configuration saved
  const std::map<std::string, std::string>& scalars() const;
  std::string root() const;   // the checkpoint directory
  std::string where() const;  // the manifest's path in quotes, for messages
  // Whether `name` is a frozen value (a parameter without gradient, or a buffer) rather than a
  // trained parameter.
  bool frozen(const std::string& name) const;
  // The whole tensor, fp32, in its shape.
  at::Tensor read(const std::string& name);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace zt
