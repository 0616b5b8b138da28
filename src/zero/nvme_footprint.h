// The bytes one rank's NVMe tiers put on disk, by role and by directory, computed from the
// sub-group plan before anything is created: what the pre-flight disk check holds against the
// free space, what the tiers then create (the same TieredArray::file_bytes per array), and what
// a checkpoint load writes beside the live files before it replaces them (docs/offload.md).
// Internal to src/zero; plain data and a pure function.
#pragma once
#include <cstdint>
#include <vector>

#include "zero/partition_store.h"

namespace zt {

struct NvmeTierPlan {
  std::vector<SubGroup> groups;
  std::vector<char> optimizer_on_disk;   // per sub-group: masters and moments in swap files
  std::vector<char> gradients_on_disk;   // nvme_gradients (empty: none)
  std::vector<char> parameters_on_disk;  // stage-3 working shards (empty: none)
  bool fp32_masters = false;             // keeps_fp32_masters(): a masters file of its own
  int moments = 2;                       // optimizer moment arrays: Adam/AdamW/LAMB 2, SGD 1 or 0
  int64_t working_element_bytes = 4;     // the working parameters' and gradients' dtype
  bool next_working_copy = false;        // the delayed update's params.next beside the parameters
};

struct NvmeFootprint {
  int64_t masters = 0, moments = 0, gradients = 0;  // files in offload_optimizer.nvme_path
  int64_t parameters = 0, next_parameters = 0;      // files in offload_param.nvme_path
  // A checkpoint load's staging copies, beside the live files until it commits: of the masters
  // (or, without a masters file, of the working parameters that hold them) and of the moments.
  int64_t load_staging_optimizer = 0, load_staging_parameters = 0;
  int64_t optimizer_directory() const { return masters + moments + gradients; }
  int64_t parameter_directory() const { return parameters + next_parameters; }
  int64_t total() const { return optimizer_directory() + parameter_directory(); }
};

NvmeFootprint nvme_footprint(const NvmeTierPlan& plan);

}  // namespace zt
