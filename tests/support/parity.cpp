#include "support/parity.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace zt::testing {

void expect_bitwise_equal(const TrainingTrace& reference, const TrainingTrace& run, const std::string& what) {
  ASSERT_EQ(reference.losses.size(), run.losses.size()) << what;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    EXPECT_EQ(run.losses[i], reference.losses[i]) << what << " step " << i;
    EXPECT_EQ(run.grad_norms[i], reference.grad_norms[i]) << what << " step " << i;
  }
  if (reference.final_parameters.defined())
    EXPECT_TRUE(run.final_parameters.defined() && torch::equal(run.final_parameters, reference.final_parameters))
        << what;
}

}  // namespace zt::testing
