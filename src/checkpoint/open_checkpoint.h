// The reading side of a sharded checkpoint (docs/checkpoint.md): its names, its manifest and an
// opened checkpoint whose every part is validated before any tensor is read. Internal to the
// checkpoint layer (checkpoint.cpp's load and export use it). Not thread-safe: one reader.
#pragma once
#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_slices.h"

namespace zt::checkpoint_files {

constexpr const char* kFormat = "zerotrain-checkpoint";
// Version 2: some parameter is saved as tensor-parallel slices (its manifest entry has "split");
// readers of version 1 refuse it rather than misread the slices as the whole tensor.
constexpr int kVersion = 1, kSlicedVersion = 2;
constexpr const char* kZeroChecksum = "00000000";
constexpr int kMaxWorldSize = 99'999;  // the rank file names have 5 digits
// "frozen": the whole value of a frozen parameter or floating-point buffer (rank 0 saves it).
inline constexpr const char* kRoles[] = {"master", "exp_avg", "exp_avg_sq", "frozen"};

std::string rank_file_name(int rank, int world);
// Tensor names inside a rank file: "<role>:<parameter>:<first element>".
std::string fragment_name(const std::string& role, const std::string& parameter, int64_t begin);
// "<digits>" as a non-negative int64, or -1.
int64_t parse_count(std::string_view text);
// A checkpoint tag: a plain directory name (it is joined to the checkpoint directory).
bool plain_tag(const std::string& tag);
// dir/tag, or with tag empty the checkpoint dir/latest names (zt::DataError when there is none).
std::filesystem::path resolve_tag(const std::filesystem::path& dir, const std::string& tag);
// The layout of `p` on this rank (zt::Error for a split that does not fit its shape: the
// caller's model is inconsistent).
SliceLayout layout_of(const CheckpointParameter& p);

// A checkpoint's manifest and files, every part validated before any tensor is read: the
// manifest's structure, its file names (plain rank file names of its world size: a name never
// leads outside the checkpoint's directory), the parameters (valid names, shapes whose element
// count does not overflow, splits that fit the shapes), every file's header, and the saved
// pieces (known roles, fp32, inside their parameter, no two overlapping).
struct OpenCheckpoint {
  struct Piece {
    size_t file;
    std::string tensor;
    int64_t begin, numel;
  };
  std::filesystem::path root;
  nlohmann::json manifest;
  std::string where;  // the manifest's path, for messages
  std::vector<CheckpointParameter> parameters;  // in saved order, whole shapes
  std::vector<CheckpointParameter> frozen;      // frozen parameters and buffers, in saved order
  bool has_frozen = false;                      // the manifest lists them (saved since the list exists)
  std::map<std::string, int64_t> numels;        // of both lists
  std::map<std::string, SliceLayout> layouts;   // as saved: the slices of a split parameter, in rank order
  std::map<std::string, std::string> scalars, configuration;
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::pair<std::string, std::string>, std::vector<Piece>> pieces;  // (role, parameter) -> pieces by begin

  explicit OpenCheckpoint(const std::filesystem::path& checkpoint);

  // Elements of [begin, begin + numel) of `role` of `parameter` in the saved pieces (in the saved
  // layout), from the headers alone.
  int64_t covered(const std::string& role, const std::string& parameter, int64_t begin, int64_t numel) const;

  // Hands saved elements [begin, begin + numel) of `role` of `parameter` to consume(offset from
  // begin, count, values) in increasing order, each once, reading whole saved pieces in reads of
  // at most a chunk (checksums verified after each piece); all must be found. `buffer` is the
  // read buffer, allocated on first use.
  void read_range(const std::string& role, const std::string& parameter, int64_t begin, int64_t numel,
                  const FragmentSink& consume, at::Tensor& buffer);

  // Elements [begin, begin + numel) of slice `rank` of `parameter` cut as `wanted` (whole: the
  // tensor), into `out`, whatever slices it was saved as.
  void read_slice(const std::string& role, const std::string& parameter, const SliceLayout& wanted, int64_t rank,
                  int64_t begin, int64_t numel, float* out, at::Tensor& buffer);

 private:
  std::vector<std::string> read_file_names() const;
  void read_parameter_list(const char* list, std::vector<CheckpointParameter>& into);
  SliceLayout read_split(const nlohmann::json& entry, CheckpointParameter& parameter, const std::string& quoted,
                         bool may_split) const;
  void index_pieces(const std::string& name);
  void read_resliced(const std::string& role, const std::string& parameter, const SliceLayout& wanted, int64_t rank,
                     int64_t begin, int64_t numel, float* out, at::Tensor& buffer);
};

}  // namespace zt::checkpoint_files
