// The NVMe tiers' bytes before they exist (zero/nvme_footprint.h).
#include "zero/nvme_footprint.h"

namespace zt {

NvmeFootprint nvme_footprint(const NvmeTierPlan& plan) {
  NvmeFootprint f;
  const int64_t state = TieredArray::file_bytes(plan.groups, plan.optimizer_on_disk, 4);  // fp32 roles
  const int64_t working = TieredArray::file_bytes(plan.groups, plan.parameters_on_disk, plan.working_element_bytes);
  f.masters = plan.fp32_masters ? state : 0;
  f.moments = int64_t(plan.moments) * state;
  f.gradients = TieredArray::file_bytes(plan.groups, plan.gradients_on_disk, plan.working_element_bytes);
  f.parameters = working;
  f.next_parameters = plan.next_working_copy ? working : 0;
  f.load_staging_optimizer = f.masters + f.moments;
  f.load_staging_parameters = plan.fp32_masters ? 0 : working;
  return f;
}

}  // namespace zt
