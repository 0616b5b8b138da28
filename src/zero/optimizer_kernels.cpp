#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "optim/cpu_kernels.h"
#include "optim/device_kernels.h"
#include "zero/optimizer_stream.h"
#include "zerotrain/comm/comm.h"

// The optimizer step's kernel dispatch (docs/optim.md): Adam/AdamW, SGD and LAMB's two phases, on
// the CPU kernels or the device kernels, each parameter group with its own hyperparameters, over
// the passes of zero/optimizer_stream.h.

namespace zt {
namespace {

optim::DeviceGradType device_grad_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return optim::DeviceGradType::BF16;
    case at::kHalf: return optim::DeviceGradType::F16;
    default: return optim::DeviceGradType::F32;
  }
}

// The current stream of `device` (a cudaStream_t for CUDA): the device kernels run in order with
// the rest of the compute stream's work.
void* current_stream_handle(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

}  // namespace

template <typename Hyper>
Hyper OptimizerPartition::for_group(Hyper hyper, int group) const {
  if (group <= 0 || size_t(group) >= options_.groups.size()) return hyper;
  const Options::Group& g = options_.groups[size_t(group)];
  if (g.lr) hyper.lr = *g.lr;
  if (g.weight_decay) hyper.weight_decay = *g.weight_decay;
  return hyper;
}

void OptimizerPartition::set_group_rates(const std::vector<double>& rates) {
  ZT_CHECK_STATE(!step_in_flight(), "the groups' learning rates changed while a delayed step reads them");
  if (options_.groups.size() < rates.size()) options_.groups.resize(rates.size());
  for (size_t g = 1; g < rates.size(); ++g) options_.groups[g].lr = rates[g];
}

void OptimizerPartition::step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
                              std::optional<Betas> betas) {
  ZT_CHECK_STATE(!in_flight_, "a synchronous step while a delayed one is in flight");
  if (staged_) {
    snapshot_gradients(gradients);
    // The partition on the host (parameter offload): nothing reads it now, so it is written in place.
    if (options_.devices.parameters_on_host) {
      run_step(lr, betas, step, grad_scale, PassTarget{nullptr, false}, 0);
      return;
    }
    run_step(lr, betas, step, grad_scale, PassTarget{nullptr, true}, 0);
    install_next_working();
    return;
  }
  run_step(lr, betas, step, grad_scale, PassTarget{&gradients, false}, 0);
}

void OptimizerPartition::run_step(double lr, std::optional<Betas> betas, int64_t step, float grad_scale,
                                  PassTarget target, int threads) {
  optim::StepOptions options;
  options.grad_scale = grad_scale;
  options.threads = threads;
  if (options_.working_dtype != at::kFloat)
    options.half = options_.working_dtype == at::kBFloat16 ? optim::HalfType::BF16 : optim::HalfType::FP16;
  adam_.lr = lr;
  sgd_.lr = lr;
  lamb_.lr = lr;
  const Betas b = betas.value_or(Betas{options_.optimizer.beta1, options_.optimizer.beta2});
  adam_.beta1 = lamb_.beta1 = b.beta1;
  adam_.beta2 = lamb_.beta2 = b.beta2;
  auto with_half = [&](uint16_t* h) {
    optim::StepOptions o = options;
    o.half_out = h;
    return o;
  };
  // State on a device: the device kernels, on the compute stream, gradients in the working dtype.
  const bool on_device = options_.devices.device_step();
  optim::DeviceStepOptions device_options;
  if (on_device) {
    device_options.grad_scale = grad_scale;
    device_options.grad_type = device_grad_type(options_.working_dtype);
    device_options.half = options.half;
    device_options.stream = current_stream_handle(options_.devices.state);
  }
  auto device_with_half = [&](uint16_t* h) {
    optim::DeviceStepOptions o = device_options;
    o.half_out = h;
    return o;
  };
  switch (kind_) {
    case Kind::Adam:
      for_each_chunk(target, true, true,
                     [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t* h) {
                       const auto hyper = for_group(adam_, c.group);
                       if (on_device)
                         optim::adam_step_device(p, g, m, v, c.numel, hyper, step, device_with_half(h));
                       else
                         optim::adam_step(p, static_cast<const float*>(g), m, v, c.numel, hyper, step, with_half(h));
                     });
      break;
    case Kind::Sgd:
      for_each_chunk(target, true, true,
                     [&](const Chunk& c, float* p, const void* g, float* m, float*, uint16_t* h) {
                       const auto hyper = for_group(sgd_, c.group);
                       if (on_device)
                         optim::sgd_step_device(p, g, m, c.numel, hyper, step, device_with_half(h));
                       else
                         optim::sgd_step(p, static_cast<const float*>(g), m, c.numel, hyper, step, with_half(h));
                     });
      break;
    case Kind::Lamb:
      if (on_device) lamb_on_device(target, step, device_options);
      else lamb_on_host(target, step, options);
      break;
  }
}

void OptimizerPartition::sum_tensor_norms(at::Tensor& sums) const {
  if (options_.shard_world > 1) comm_.all_reduce(sums, ReduceOp::Sum, "lamb.tensor_norms").wait();
  if (!options_.tensor_group || options_.tensor_group->world_size() == 1) return;
  // A replicated tensor's sums are the same on every rank of the group: the group's sum is T of them.
  options_.tensor_group->all_reduce(sums, ReduceOp::Sum, "lamb.tensor_norms.tensor").wait();
  const int tensors = int(layout_.placements.size());
  std::vector<double> factor(size_t(tensors), 1.0 / double(options_.tensor_group->world_size()));
  for (int i = 0; i < tensors; ++i)
    if (options_.tensor_split[size_t(i)]) factor[size_t(i)] = 1.0;
  const at::Tensor per_tensor = torch::tensor(factor, torch::kFloat64).to(sums.device());
  sums.view({2, tensors}).mul_(per_tensor);
}

void OptimizerPartition::lamb_on_host(PassTarget target, int64_t step, const optim::StepOptions& options) {
  const int tensors = int(layout_.placements.size());
  // [w_sq of each tensor..., u_sq of each tensor...], summed over this rank's pieces.
  torch::Tensor sums = torch::zeros({2 * tensors}, torch::kFloat64);
  double* s = sums.data_ptr<double>();
  for_each_chunk(target, false, true, [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t*) {
    const int pieces = int(c.placements.size());
    std::vector<double> w_sq(pieces), u_sq(pieces);
    optim::lamb_partial_norms(p, static_cast<const float*>(g), m, v, c.numel, c.bounds.data(), pieces,
                              for_group(lamb_, c.group), options, w_sq.data(), u_sq.data());
    for (int k = 0; k < pieces; ++k)
      if (c.placements[k] >= 0) {
        s[c.placements[k]] += w_sq[k];
        s[tensors + c.placements[k]] += u_sq[k];
      }
  });
  sum_tensor_norms(sums);
  for_each_chunk(target, true, false, [&](const Chunk& c, float* p, const void*, float* m, float* v, uint16_t* h) {
    const int pieces = int(c.placements.size());
    std::vector<double> w_sq(pieces, 0.0), u_sq(pieces, 0.0);  // padding: ratio 1, update 0
    for (int k = 0; k < pieces; ++k)
      if (c.placements[k] >= 0) {
        w_sq[k] = s[c.placements[k]];
        u_sq[k] = s[tensors + c.placements[k]];
      }
    optim::StepOptions o = options;
    o.half_out = h;
    optim::lamb_apply(p, m, v, c.numel, c.bounds.data(), pieces, w_sq.data(), u_sq.data(), for_group(lamb_, c.group),
                      step, o);
  });
}

// The same two phases with the sums on the device: per chunk the kernel writes each piece's sums,
// which are added into the per-tensor totals (index_add_), all-reduced there (NCCL), and handed
// back per piece to the second kernel; nothing waits on the host.
void OptimizerPartition::lamb_on_device(PassTarget target, int64_t step, const optim::DeviceStepOptions& options) {
  const int tensors = int(layout_.placements.size());
  const auto device = torch::TensorOptions().device(options_.devices.state);
  torch::Tensor sums = torch::zeros({2 * tensors}, device.dtype(torch::kFloat64));
  // Per chunk: the pieces that belong to a tensor (not padding) and their tensors.
  auto piece_indices = [&](const Chunk& c) {
    std::vector<int64_t> pieces, owners;
    for (int k = 0; k < int(c.placements.size()); ++k)
      if (c.placements[k] >= 0) {
        pieces.push_back(k);
        owners.push_back(c.placements[k]);
      }
    auto to_device = [&](const std::vector<int64_t>& v) {
      return torch::tensor(v, torch::kLong).to(options_.devices.state, /*non_blocking=*/false);
    };
    return std::pair{to_device(pieces), to_device(owners)};
  };
  for_each_chunk(target, false, true, [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t*) {
    const int pieces = int(c.placements.size());
    torch::Tensor piece_sums = torch::zeros({2, pieces}, device.dtype(torch::kFloat64));
    optim::lamb_partial_norms_device(p, g, m, v, c.numel, c.bounds.data(), pieces, for_group(lamb_, c.group), options,
                                     piece_sums[0].data_ptr<double>(), piece_sums[1].data_ptr<double>());
    auto [kept, owners] = piece_indices(c);
    if (kept.numel() == 0) return;
    sums.narrow(0, 0, tensors).index_add_(0, owners, piece_sums[0].index_select(0, kept));
    sums.narrow(0, tensors, tensors).index_add_(0, owners, piece_sums[1].index_select(0, kept));
  });
  sum_tensor_norms(sums);
  for_each_chunk(target, true, false, [&](const Chunk& c, float* p, const void*, float* m, float* v, uint16_t* h) {
    const int pieces = int(c.placements.size());
    torch::Tensor totals = torch::zeros({2, pieces}, device.dtype(torch::kFloat64));  // padding: ratio 1, update 0
    auto [kept, owners] = piece_indices(c);
    if (kept.numel() > 0) {
      totals[0].index_copy_(0, kept, sums.narrow(0, 0, tensors).index_select(0, owners));
      totals[1].index_copy_(0, kept, sums.narrow(0, tensors, tensors).index_select(0, owners));
    }
    optim::DeviceStepOptions o = options;
    o.half_out = h;
    optim::lamb_apply_device(p, m, v, c.numel, c.bounds.data(), pieces, totals[0].data_ptr<double>(),
                             totals[1].data_ptr<double>(), for_group(lamb_, c.group), step, o);
  });
}

}  // namespace zt
