// What the parity tests compare of a training run (losses, gradient norms, final weights), and
// the bit-for-bit comparison that says two ways of computing a step are the same computation.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace zt::testing {

struct TrainingTrace {
  std::vector<double> losses, grad_norms;  // per optimizer step
  at::Tensor final_parameters;             // the trainable parameters, flat fp32 on the host (undefined: not compared)
};

// Every loss and gradient norm equal, and the final parameters equal where the reference has them;
// failures name `what` and the step.
void expect_bitwise_equal(const TrainingTrace& reference, const TrainingTrace& run, const std::string& what);

}  // namespace zt::testing
