#include "zerotrain/zero/engine.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>

#include "comm/node_groups.h"
#include "common/check.h"
#include "zero/engine_impl.h"
#include "zero/start_agreement.h"
#include "zero/step_monitor.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/error.h"

// The engine's autograd glue and the order of one training step over its parts; Engine's members
// (docs/architecture.md "zero", docs/zero.md). The state, and the files that build and
// checkpoint it, are in zero/engine_impl.h.

namespace zt {
namespace {
torch::ScalarType working_dtype_of(Precision precision) {
  switch (precision) {
    case Precision::BF16: return torch::kBFloat16;
    case Precision::FP16: return torch::kHalf;
    case Precision::FP32: break;
  }
  return torch::kFloat32;
}

class PreHook : public torch::autograd::FunctionPreHook {
 public:
  explicit PreHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace
Engine::Impl::Impl(std::shared_ptr<torch::nn::Module> m, const TrainConfig& c, std::shared_ptr<Communicator> cm,
                   std::vector<ParameterGroup> g)
    : model(std::move(m)), config(c), comm(std::move(cm)), schedule(c.scheduler, c.optimizer.lr),
      scaler(c.fp16), parameter_groups(std::move(g)) {
  shard_parameters = c.zero.shard_parameters;
  world = comm->world_size();
  rank = comm->rank();
  // Before any collective whose shape follows the configuration or the model.
  check_ranks_agree(*comm, configuration_agreement_lines(c), "configuration");
  check_ranks_agree(*comm, model_agreement_lines(*model), "model");
  working_dtype = working_dtype_of(c.precision);
  separate_master = working_dtype != torch::kFloat32;
  if (c.zero.shard_optimizer_states) {
    shard_world = world;
    shard_rank = rank;
  }
  node_groups = make_node_groups(comm);
  build();
  if (gatherer) gatherer->install();
  liveness->impl = this;
}

Engine::Impl::~Impl() { liveness->impl = nullptr; }

// ---------------------------------------------------------------- backward
// The reducer learns of each gradient from its parameter's accumulator (and stage 3's gatherer,
// through the reducer, when a block's gradients are complete).
void Engine::Impl::install_hooks(std::vector<torch::Tensor>& trainable) {
  for (int i = 0; i < int(layout.placements.size()); ++i) {
    const ParameterPlacement& placement = layout.placements[i];
    torch::Tensor& param = trainable[placement.index];
    reducer->attach(i, param);
    auto accumulator = torch::autograd::impl::grad_accumulator(param);
    // The accumulators outlive the engine in any graph built before it was destroyed; a backward
    // through such a graph then accumulates as plain autograd does (stage 3: the gatherer
    // refuses it). The pre-hook also keeps another loss's backward (a second engine's, whose
    // graph runs through this model) out of this engine's gradients.
    accumulator->add_pre_hook(std::make_unique<PreHook>([engine = liveness, i] {
      if (Impl* self = engine->impl.load()) self->reducer->before_gradient(i);
    }));
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [engine = liveness, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (Impl* self = engine->impl.load()) self->after_gradient(i);
          return outputs;
        }));
    grad_accumulators.push_back(std::move(accumulator));
  }
}

bool Engine::Impl::boundary_next() const {
  return window_ends_early || micro_step + 1 >= config.gradient_accumulation_steps;
}

// A backward after the window's last one and before step(): DeepSpeed counts a window by step()
// calls, so this backward ends the window again. What it does with the gradients already there
// follows DeepSpeed's stages: stage 0 (and 3) adds to them, stage 1 keeps this backward's only,
// stage 2 cannot (its gradient partition is full) and is refused here.
void Engine::Impl::reopen_window() {
  const ZeroConfig& z = config.zero;
  if (z.shard_gradients && !z.shard_parameters)
    throw Error("backward() called again before step(): at ZeRO stage 2 a window of gradient_accumulation_steps " +
                std::to_string(config.gradient_accumulation_steps) + " backward() calls ends with step() (DeepSpeed " +
                "refuses a second backward too: its gradient partition is full); call step() after the window's " +
                "last backward(), or add both losses and call backward() once");
  reducer->reopen_window(/*keep=*/!(z.shard_optimizer_states && !z.shard_gradients));
  micro_step = config.gradient_accumulation_steps - 1;
}

void Engine::Impl::backward(const torch::Tensor& loss, LossDivision division) {
  ZT_CHECK_STATE(!in_backward, "backward() re-entered");
  if (micro_step >= config.gradient_accumulation_steps) reopen_window();
  reducer->begin_backward(boundary_next());
  if (gatherer) gatherer->begin_backward();
  in_backward = true;
  const bool ends_early = window_ends_early;
  window_ends_early = false;
  try {
    // DeepSpeed's order: the division (a scalar division, as DeepSpeed's loss / steps), then fp16's
    // loss scale, so that a loss divided by the caller differentiates to the same bits.
    torch::Tensor scaled = division == LossDivision::ByAccumulationSteps && config.gradient_accumulation_steps != 1
                               ? loss / double(config.gradient_accumulation_steps)
                               : loss;
    if (scaler.scale() != 1.0) scaled = scaled * scaler.scale();
    scaled.backward();
  } catch (...) {
    in_backward = false;
    reducer->abort_backward();
    if (gatherer) gatherer->end_backward(/*release=*/false);
    throw;
  }
  in_backward = false;
  reducer->end_backward();
  // A block some of whose parameters got no gradient is still gathered: release it.
  if (gatherer) gatherer->end_backward();
  ++micro_step;
  if (ends_early) micro_step = config.gradient_accumulation_steps;  // the next step() applies the window
}

void Engine::Impl::after_gradient(int i) {
  if (reducer->after_gradient(i) && gatherer) gatherer->gradient_arrived(layout.placements[i].bucket);
}

// ---------------------------------------------------------------- step

StepResult Engine::Impl::step() {
  StepResult result;
  if (micro_step < config.gradient_accumulation_steps) return result;
  result.boundary = true;
  micro_step = 0;
  reducer->finish_window();

  // Gradients hold the sum over ranks of loss_scale × the mean micro-batch gradient, divided
  // by the reducer's pre-division; post_divisor() turns that into the mean over ranks.
  const GradientReducer::SquareSums owned = reducer->owned_square_sums();
  double square_sum = owned.split + owned.replicated;
  if (shard_world > 1 && !tensor_group) {
    torch::Tensor total = torch::full({1}, square_sum, torch::kFloat64);
    comm->all_reduce(total, ReduceOp::Sum, "grads.norm").wait();
    square_sum = total.item<double>();
  } else if (tensor_group) {
    // Each rank of the tensor group holds other slices and the same replicated gradients: the
    // slices' squares add over the group, the replicated ones count once. The sums are the same
    // on every rank of the grid, so an overflow skips the step everywhere.
    torch::Tensor totals = torch::tensor({owned.split, owned.replicated}, torch::kFloat64);
    if (shard_world > 1) comm->all_reduce(totals, ReduceOp::Sum, "grads.norm").wait();
    tensor_group->all_reduce(totals, ReduceOp::Sum, "grads.norm.tensor").wait();
    square_sum = totals[0].item<double>() + totals[1].item<double>() / double(tensor_group->world_size());
  }
  const double unscale = 1.0 / (reducer->post_divisor() * scaler.scale());
  const double norm = std::sqrt(square_sum) * unscale;
  result.grad_norm = norm;
  result.loss_scale = scaler.scale();
  // As DeepSpeed, a step skipped for overflow does not advance the schedule (its scheduler
  // steps only with the optimizer), while global_step counts it.
  result.lr = client_rates ? client_rates->front() : schedule.lr_at(global_step - skipped);
  // OneCycle's momentum: DeepSpeed cycles only optimizers with betas (not SGD).
  const std::optional<Betas> betas =
      config.optimizer.type == "SGD" ? std::nullopt : schedule.betas_at(global_step - skipped);
  ++global_step;
  const bool overflow = !std::isfinite(norm);
  scaler.update(overflow);
  // A delayed update in flight was computed from the step before, whose gradients were finite:
  // it is installed now whether or not this step is skipped (else the next forward would run on
  // weights two steps stale).
  apply_pending_update();
  if (client_rates) optimizer->set_group_rates(*client_rates);
  if (overflow) {
    // The norm is the same on every rank (one all-reduce, or identical all-reduced gradients),
    // so every rank skips together.
    ++skipped;
    result.skipped = true;
    reducer->clear();
    return result;
  }
  double scale = unscale;
  if (config.gradient_clipping > 0 && norm > config.gradient_clipping)
    scale *= config.gradient_clipping / (norm + 1e-6);
  const int64_t optimizer_step = global_step - skipped - moments_from;
  // The delayed parameter update (docs/offload.md "Delayed parameter update"): after the first
  // delayed_update_after steps, this step's update is computed while the next forward and
  // backward run on the weights of the step before; it is installed at the next step.
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  if (oo.delayed_update && global_step > oo.delayed_update_after) {
    optimizer->launch_step(result.lr, optimizer_step, float(scale), *reducer, betas);
    result.delayed = true;
  } else {
    release_read_ahead();
    optimizer->step(result.lr, optimizer_step, float(scale), *reducer, betas);
    publish_parameters();
  }
  reducer->clear();
  result.stepped = true;
  return result;
}

// Completes a delayed step in flight: its working values replace the working parameters and
// reach every rank. A collective when one is in flight (on every rank alike: the delay depends
// only on the step count).
void Engine::Impl::apply_pending_update() {
  if (!optimizer->step_in_flight()) return;
  // Shard buffers read ahead hold the old values.
  release_read_ahead();
  optimizer->finish_step();
  publish_parameters();
}

std::string Engine::Impl::fmt_double(double v) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

ModelStateBytes Engine::Impl::model_state_bytes() const {
  ModelStateBytes bytes;
  if (shard_parameters)
    bytes.parameters = param_partition.memory_bytes() + gatherer->persistent_bytes() + gatherer->secondary_bytes();
  else bytes.parameters = int64_t(flat_params.nbytes());
  bytes.gradients = reducer->gradient_bytes();
  bytes.optimizer_states = optimizer->memory_bytes();
  return bytes;
}

int64_t Engine::Impl::buffer_bytes() const {
  return reducer->buffer_bytes() + optimizer->buffer_bytes() + (parameter_tier ? parameter_tier->buffer_bytes() : 0);
}

EngineStepState Engine::Impl::step_state() const { return {global_step, skipped, layout.parameter_numel}; }

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
               std::shared_ptr<Communicator> comm)
    : Engine(std::move(model), config, std::move(comm), {}) {}
Engine::Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config, std::shared_ptr<Communicator> comm,
               std::vector<ParameterGroup> groups)
    // The monitor first: the comms logger it may attach counts the engine's own collectives.
    : monitor_(std::make_unique<StepMonitor>(config, *comm, c10::Device(c10::kCPU))) {
  impl_ = std::make_unique<Impl>(std::move(model), config, std::move(comm), std::move(groups));
  // The device plan's, not a parameter's: a block built sharded for a GPU has no data on it yet.
  monitor_->set_device(impl_->devices.compute);
  monitor_->arm(impl_->step_state());
}
Engine::~Engine() = default;
void Engine::backward(const at::Tensor& loss, LossDivision division) {
  // The loss's value only when a report needs it: reading it waits for the device.
  monitor_->before_backward(monitor_->wants_loss() ? loss.detach().item<double>() : std::nan(""));
  {
    RECORD_USER_SCOPE("zerotrain::backward");
    impl_->backward(loss, division);
  }
  monitor_->after_backward();
}
StepResult Engine::step() {
  monitor_->before_step();
  StepResult result;
  {
    RECORD_USER_SCOPE("zerotrain::step");
    result = impl_->step();
  }
  monitor_->after_step(result, impl_->step_state());
  if (result.boundary) monitor_->arm(impl_->step_state());
  return result;
}
void Engine::note_forward_start() { monitor_->forward_started(); }
void Engine::note_forward_end() { monitor_->forward_ended(); }
void Engine::set_report_sink(std::function<void(const std::string&)> sink) { monitor_->set_sink(std::move(sink)); }
void Engine::disable_reports() { monitor_->disable(); }
PhaseTimes Engine::phase_times() const { return monitor_->phase_times(); }
const FlopsReport* Engine::flops_report() const { return monitor_->flops_report(); }
std::shared_ptr<CommsLogger> Engine::comms_logger() const { return impl_->comm->comms_logger(); }
std::string Engine::comms_summary() const {
  const auto logger = comms_logger();
  return logger ? logger->table() : std::string();
}
void Engine::apply_pending_update() { impl_->apply_pending_update(); }
bool Engine::next_backward_is_boundary() const { return impl_->boundary_next(); }

void Engine::set_gradient_accumulation_boundary(bool is_boundary) {
  Impl& d = *impl_;
  ZT_CHECK_STATE(!d.in_backward, "set_gradient_accumulation_boundary() inside backward()");
  const int64_t n = d.config.gradient_accumulation_steps;
  if (!is_boundary && d.micro_step + 1 >= n)
    throw Error("set_gradient_accumulation_boundary(false) on micro-step " + std::to_string(d.micro_step % n + 1) +
                " of a window of gradient_accumulation_steps " + std::to_string(n) +
                ": the window ends with this backward(); a window never grows past the count");
  d.window_ends_early = is_boundary && d.micro_step + 1 < n;
}
int64_t Engine::global_step() const { return impl_->global_step; }
int64_t Engine::skipped_steps() const { return impl_->skipped; }
double Engine::learning_rate() const {
  if (impl_->client_rates) return impl_->client_rates->front();
  return impl_->schedule.lr_at(impl_->global_step - impl_->skipped);
}
void Engine::set_learning_rates(const std::vector<double>& rates) {
  const size_t groups = impl_->parameter_groups.size() + 1;
  if (rates.size() != groups)
    throw ConfigError("engine.set_learning_rates: expected " + std::to_string(groups) +
                      " rate(s) (the parameters in no group, then one per parameter group), found " +
                      std::to_string(rates.size()));
  for (size_t i = 0; i < rates.size(); ++i)
    if (!(std::isfinite(rates[i]) && rates[i] >= 0))
      throw ConfigError("engine.set_learning_rates: expected rates >= 0, found " + Impl::fmt_double(rates[i]) +
                        " for group " + std::to_string(i));
  impl_->client_rates = rates;
}
double Engine::loss_scale() const { return impl_->scaler.scale(); }
void Engine::save_checkpoint(const std::string& dir, const std::string& tag,
                             const std::map<std::string, std::string>& client_state, int keep_last) {
  impl_->save_checkpoint(dir, tag, client_state, keep_last);
}
std::map<std::string, std::string> Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  return load_checkpoint(dir, tag, LoadOptions{});
}
std::map<std::string, std::string> Engine::load_checkpoint(const std::string& dir, const std::string& tag,
                                                           const LoadOptions& options) {
  auto client = impl_->load_checkpoint(dir, tag, options);
  monitor_->arm(impl_->step_state());  // the step count changed: the profiled step may be next
  return client;
}
void Engine::load_weights(WeightReader& reader) { impl_->load_weights(reader); }
at::Tensor Engine::master_parameter(const std::string& name) { return impl_->master_parameter(name); }
void Engine::set_master_parameter(const std::string& name, const at::Tensor& value) {
  impl_->set_master_parameters({{name, value}});
}
void Engine::set_master_parameters(const std::map<std::string, at::Tensor>& values) {
  impl_->set_master_parameters(values);
}
void Engine::hold_blocks(const std::vector<const torch::nn::Module*>& modules) {
  if (impl_->micro_step != 0)
    throw Error("hold_blocks: expected a call between optimizer steps, found micro-step " +
                std::to_string(impl_->micro_step));
  if (impl_->gatherer) impl_->gatherer->hold(modules);
}
void Engine::release_held_blocks() {
  if (impl_->gatherer) impl_->gatherer->release_held();
}
Communicator& Engine::communicator() const { return *impl_->comm; }
const TrainConfig& Engine::config() const { return impl_->config; }
ModelStateBytes Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
int64_t Engine::buffer_bytes() const { return impl_->buffer_bytes(); }
int64_t Engine::trainable_parameters() const { return impl_->layout.parameter_numel; }
const FlatLayout& Engine::layout() const { return impl_->layout; }
EngineDiagnostics Engine::diagnostics() const {
  EngineDiagnostics d;
  if (const auto& gatherer = impl_->gatherer) {
    d.peak_gathered_parameter_bytes = gatherer->peak_gathered_bytes();
    d.prefetched_blocks = gatherer->prefetched_blocks();
    d.block_gathers = gatherer->block_gathers();
    d.secondary_block_gathers = gatherer->secondary_gathers();
  }
  return d;
}
const NodeGroups& Engine::node_groups() const { return impl_->node_groups; }
OffloadReport Engine::offload_report() const { return impl_->offload_report(); }

}  // namespace zt
