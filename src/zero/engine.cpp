#include "zerotrain/engine.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <cmath>

#include "common/check.h"
#include "optim/cpu_kernels.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/lr_schedule.h"

// Stage 0 (plain data parallel) engine. Parameters and gradients live in two flat fp32 arenas;
// parameters are laid out in reverse registration order so that gradient buckets fill in the
// order backward produces them (design §7, Megatron). Each bucket is all-reduced as soon as its
// last gradient has been accumulated on the boundary micro-step, overlapping the rest of backward.
// Rationale and data flow: docs/architecture.md.

namespace zt {
namespace {

struct ParamSlot {
  torch::Tensor param;
  int64_t offset = 0;  // element offset in the flat arenas
  int64_t numel = 0;
  int bucket = 0;
};

struct Bucket {
  int64_t offset = 0;
  int64_t numel = 0;
  int pending = 0;         // gradients not yet accumulated on this boundary micro-step
  int total = 0;
  bool launched = false;
  std::optional<CollectiveHandle> handle;
};

}  // namespace

struct Engine::Impl {
  std::shared_ptr<torch::nn::Module> model;
  TrainConfig config;
  std::shared_ptr<Communicator> comm;
  LrSchedule schedule;
  // Optimizer (design §3 item 4): fused kernels from optim/cpu_kernels.h over the flat arenas.
  // exp_avg doubles as SGD's momentum buffer; LAMB's per-tensor norms use the slots' ranges.
  enum class OptimizerKind { Adam, Lamb, Sgd } kind = OptimizerKind::Adam;
  optim::AdamHyperparameters adam;
  optim::LambHyperparameters lamb;
  optim::SgdHyperparameters sgd;
  std::vector<int64_t> tensor_bounds;  // LAMB: [0, end of slot 0, end of slot 1, ...]

  std::vector<ParamSlot> slots;
  std::vector<Bucket> buckets;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators;  // keep hooks alive
  torch::Tensor flat_params, flat_grads, exp_avg, exp_avg_sq;
  int64_t numel = 0;

  int64_t micro_step = 0;   // micro-steps done in the current accumulation window
  int64_t global_step = 0;  // optimizer steps taken
  int64_t skipped = 0;
  bool reducing = false;    // true during the boundary micro-step's backward

  Impl(std::shared_ptr<torch::nn::Module> m, const TrainConfig& c, std::shared_ptr<Communicator> cm)
      : model(std::move(m)), config(c), comm(std::move(cm)),
        schedule(c.scheduler, c.optimizer.lr) {
    const OptimizerConfig& o = c.optimizer;
    kind = o.type == "Lamb" ? OptimizerKind::Lamb : o.type == "SGD" ? OptimizerKind::Sgd : OptimizerKind::Adam;
    adam = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.adam_w_mode, o.bias_correction};
    lamb = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.bias_correction, o.min_coeff, o.max_coeff};
    sgd = {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
    build_arenas();
  }

  void build_arenas() {
    std::vector<torch::Tensor> trainable;
    for (auto& p : model->parameters(/*recurse=*/true))
      if (p.requires_grad()) trainable.push_back(p);
    if (trainable.empty()) throw ConfigError("engine: the model has no trainable parameters (every parameter has requires_grad false)");
    for (auto& p : trainable)
      if (p.scalar_type() != torch::kFloat32 || !p.device().is_cpu())
        throw ConfigError("engine: expected fp32 CPU parameters for this configuration, found " +
                          std::string(c10::toString(p.scalar_type())) + " on " + p.device().str());
    // Reverse registration order: the last layers' gradients arrive first in backward.
    std::reverse(trainable.begin(), trainable.end());
    const int64_t bucket_limit = std::max<int64_t>(1, config.zero.reduce_bucket_size);
    int64_t offset = 0;
    for (auto& p : trainable) {
      ParamSlot slot{p, offset, p.numel(), 0};
      if (buckets.empty() || (buckets.back().numel > 0 && buckets.back().numel + slot.numel > bucket_limit))
        buckets.emplace_back().offset = offset;
      slot.bucket = int(buckets.size()) - 1;
      buckets.back().numel += slot.numel;
      buckets.back().total += 1;
      offset += slot.numel;
      slots.push_back(slot);
    }
    numel = offset;
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    flat_params = torch::empty({numel}, opts);
    flat_grads = torch::zeros({numel}, opts);
    // Only the state the chosen optimizer keeps (SGD without momentum keeps none).
    const bool first_moment = kind != OptimizerKind::Sgd || sgd.momentum != 0.0;
    exp_avg = torch::zeros({first_moment ? numel : 0}, opts);
    exp_avg_sq = torch::zeros({kind == OptimizerKind::Sgd ? 0 : numel}, opts);
    tensor_bounds = {0};
    for (auto& slot : slots) tensor_bounds.push_back(slot.offset + slot.numel);
    torch::NoGradGuard no_grad;
    for (auto& slot : slots) {
      auto view = flat_params.narrow(0, slot.offset, slot.numel).view(slot.param.sizes());
      view.copy_(slot.param.detach());
      // set_data keeps the parameter's autograd identity (and version counter) intact.
      slot.param.set_data(view);
      slot.param.mutable_grad() = flat_grads.narrow(0, slot.offset, slot.numel).view(slot.param.sizes());
    }
    comm->broadcast(flat_params, 0, "engine.init.params").wait();
    for (size_t i = 0; i < slots.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(slots[i].param);
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_gradient_ready(i);
            return outputs;
          }));
      grad_accumulators.push_back(std::move(accumulator));
    }
  }

  void on_gradient_ready(size_t slot_index) {
    if (!reducing) return;
    auto& bucket = buckets[slots[slot_index].bucket];
    ZT_CHECK_STATE(bucket.pending > 0, "gradient of a parameter arrived twice in one backward");
    if (--bucket.pending == 0) launch(bucket, slots[slot_index].bucket);
  }

  void launch(Bucket& bucket, int index) {
    bucket.launched = true;
    bucket.handle = comm->all_reduce(flat_grads.narrow(0, bucket.offset, bucket.numel), ReduceOp::Sum,
                                     "grads.bucket" + std::to_string(index));
  }

  bool boundary_next() const { return micro_step + 1 == config.gradient_accumulation_steps; }

  void backward(const torch::Tensor& loss) {
    reducing = boundary_next() && comm->world_size() > 1;
    if (reducing)
      for (auto& b : buckets) { b.pending = b.total; b.launched = false; b.handle.reset(); }
    (loss / double(config.gradient_accumulation_steps)).backward();
    ++micro_step;
  }

  void apply_optimizer(double lr, int64_t step, float grad_scale) {
    optim::StepOptions options;
    options.grad_scale = grad_scale;
    float* p = flat_params.data_ptr<float>();
    const float* g = flat_grads.data_ptr<float>();
    switch (kind) {
      case OptimizerKind::Adam:
        adam.lr = lr;
        optim::adam_step(p, g, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), numel, adam, step, options);
        break;
      case OptimizerKind::Sgd:
        sgd.lr = lr;
        optim::sgd_step(p, g, exp_avg.numel() ? exp_avg.data_ptr<float>() : nullptr, numel, sgd, step, options);
        break;
      case OptimizerKind::Lamb: {
        // Stage 0 holds every tensor whole, so the partial sums are already the totals; sharded
        // stages all-reduce them per tensor between the two phases.
        lamb.lr = lr;
        const int segments = int(tensor_bounds.size()) - 1;
        std::vector<double> w_sq(segments), u_sq(segments);
        float* m = exp_avg.data_ptr<float>();
        float* v = exp_avg_sq.data_ptr<float>();
        optim::lamb_partial_norms(p, g, m, v, numel, tensor_bounds.data(), segments, lamb, options, w_sq.data(),
                                  u_sq.data());
        optim::lamb_apply(p, m, v, numel, tensor_bounds.data(), segments, w_sq.data(), u_sq.data(), lamb, step,
                          options);
        break;
      }
    }
  }

  StepResult step() {
    StepResult result;
    if (micro_step < config.gradient_accumulation_steps) return result;
    result.boundary = true;
    micro_step = 0;
    if (reducing) {
      // Buckets whose parameters received no gradient this step (unused in forward) are still
      // reduced, in bucket order, so every rank issues the same collectives.
      for (size_t i = 0; i < buckets.size(); ++i)
        if (!buckets[i].launched) launch(buckets[i], int(i));
      for (auto& b : buckets) b.handle->wait();
      reducing = false;
    }
    const float inv_world = 1.0f / float(comm->world_size());
    // Global norm of the averaged gradient; one pass over the arena.
    const double norm = flat_grads.norm().item<double>() * inv_world;
    result.grad_norm = norm;
    result.lr = schedule.lr_at(global_step);
    ++global_step;
    if (!std::isfinite(norm)) {
      // Every rank sees the same all-reduced gradients, so every rank skips together.
      ++skipped;
      result.skipped = true;
      flat_grads.zero_();
      return result;
    }
    float scale = inv_world;
    if (config.gradient_clipping > 0 && norm > config.gradient_clipping)
      scale *= float(config.gradient_clipping / (norm + 1e-6));
    apply_optimizer(result.lr, global_step - skipped, scale);
    flat_grads.zero_();
    result.stepped = true;
    return result;
  }
};

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
               std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(std::move(model), config, std::move(comm))) {}
Engine::~Engine() = default;

void Engine::backward(const at::Tensor& loss) { impl_->backward(loss); }
StepResult Engine::step() { return impl_->step(); }
bool Engine::next_backward_is_boundary() const { return impl_->boundary_next(); }
int64_t Engine::global_step() const { return impl_->global_step; }
int64_t Engine::skipped_steps() const { return impl_->skipped; }
double Engine::learning_rate() const { return impl_->schedule.lr_at(impl_->global_step); }
Communicator& Engine::communicator() const { return *impl_->comm; }
const TrainConfig& Engine::config() const { return impl_->config; }

ModelStateBytes Engine::model_state_bytes() const {
  ModelStateBytes bytes;
  bytes.parameters = impl_->flat_params.nbytes();
  bytes.gradients = impl_->flat_grads.nbytes();
  bytes.optimizer_states = impl_->exp_avg.nbytes() + impl_->exp_avg_sq.nbytes();
  return bytes;
}

}  // namespace zt
