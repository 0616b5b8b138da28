// Activation checkpointing: recomputation in backward (docs/activation_checkpointing.md).
#include <ATen/core/Generator.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include "common/autograd_node.h"
#include "common/check.h"
#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"
#include "zerotrain/models/tensor_parallel.h"

namespace zt {

std::vector<char> checkpointed_blocks(int64_t blocks, int64_t number, const char* what) {
  if (number < 0 || number > blocks)
    throw ConfigError("activation_checkpointing.number_checkpoints: expected 0 (every " + std::string(what) + ") to " +
                      std::to_string(blocks) + ", found " + std::to_string(number));
  const int64_t n = number == 0 ? blocks : number;
  std::vector<char> chosen(size_t(blocks), 0);
  for (int64_t i = 0; i < blocks; ++i) chosen[size_t(i)] = ((i + 1) * n) / blocks > (i * n) / blocks ? 1 : 0;
  return chosen;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The default generators a function may draw from: the CPU's, and those of the devices its
// inputs live on. Their states are taken before the first run and put back for the
// recomputation; the states current at backward are restored after it, so that recomputing
// changes no random number drawn later.
struct GeneratorStates {
  std::vector<at::Generator> generators;
  std::vector<at::Tensor> states;
  TensorParallelRngStates tensor_parallel;  // the split region's (zerotrain/models/tensor_parallel.h)

  static GeneratorStates capture(const std::vector<at::Tensor>& inputs) {
    GeneratorStates s;
    s.generators.push_back(at::detail::getDefaultCPUGenerator());
    for (const auto& t : inputs)
      if (t.defined() && !t.device().is_cpu()) {
        at::Generator g = at::globalContext().defaultGenerator(t.device());
        if (std::none_of(s.generators.begin(), s.generators.end(), [&](const auto& h) { return h == g; }))
          s.generators.push_back(g);
      }
    s.read_states();
    return s;
  }
  // The same generators' states now.
  GeneratorStates current() const {
    GeneratorStates s;
    s.generators = generators;
    s.read_states();
    return s;
  }
  void read_states() {
    for (auto& g : generators) {
      std::lock_guard lock(g.mutex());
      states.push_back(g.get_state());
    }
    tensor_parallel = tensor_parallel_rng_states();
  }
  void restore() const {
    for (size_t i = 0; i < generators.size(); ++i) {
      at::Generator g = generators[i];
      std::lock_guard lock(g.mutex());
      g.set_state(states[i]);
    }
    set_tensor_parallel_rng_states(tensor_parallel);
  }
};

void synchronize_devices(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (t.defined() && !t.device().is_cpu()) {
      c10::impl::VirtualGuardImpl guard(t.device().type());
      guard.synchronizeDevice(t.device().index());
    }
}

struct KeptInput {
  at::Tensor value;               // detached; in host memory with keep_inputs_on_host
  std::shared_ptr<void> slot;     // the arena slot holding it, if any
  at::Device device = at::kCPU;   // where the recomputation needs it
  bool requires_grad = false;
  // Partitioned (CheckpointOptions::partition_group): `value` is this rank's piece of the input's
  // flattened elements, whose whole shape this is.
  bool partitioned = false;
  std::vector<int64_t> whole_sizes;
};

bool partitions(const CheckpointOptions& options) {
  return options.partition_group && options.partition_group->world_size() > 1;
}

// This rank's 1/G of x's elements, padded to the same length on every rank for the all-gather.
at::Tensor piece_of(const at::Tensor& x, const Communicator& group) {
  const int64_t G = group.world_size(), n = x.numel(), piece = (n + G - 1) / G;
  at::Tensor mine = at::zeros({piece}, x.options());
  const int64_t begin = std::min(n, piece * group.rank()), count = std::min(piece, n - begin);
  if (count > 0) mine.narrow(0, 0, count).copy_(x.reshape({-1}).narrow(0, begin, count));
  return mine;
}

at::Tensor whole_from_pieces(const at::Tensor& mine, const std::vector<int64_t>& sizes, Communicator& group) {
  at::Tensor all = at::empty({mine.numel() * group.world_size()}, mine.options());
  group.all_gather(mine.contiguous(), all, "checkpoint.partitioned_input").wait();
  const int64_t n = c10::multiply_integers(sizes);
  return all.narrow(0, 0, n).view(sizes);
}

struct CheckpointBackward : torch::autograd::Node {
  CheckpointFunction fn;
  std::vector<KeptInput> kept;
  GeneratorStates generators;
  CheckpointOptions options;
  bool consumed = false;

  std::string name() const override { return "zt::CheckpointBackward"; }

  void release_variables() override {
    kept.clear();
    fn = nullptr;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (consumed)
      throw Error("activation checkpointing: backward ran a second time through a checkpointed function; its "
                  "kept inputs were freed by the first (retain_graph is not supported with checkpointing)");
    consumed = true;
    const auto start = Clock::now();
    std::vector<at::Tensor> inputs;
    inputs.reserve(kept.size());
    for (const KeptInput& k : kept) {
      at::Tensor t = k.value;
      // From an arena slot the copy is synchronous: the slot is handed out again (and written by
      // the CPU) as soon as this recomputation is enqueued, which may be before a queued copy ran.
      if (t.defined() && t.device() != k.device) t = t.to(k.device, /*non_blocking=*/k.slot == nullptr);
      if (k.partitioned) t = whole_from_pieces(t, k.whole_sizes, *options.partition_group);
      inputs.push_back(t.defined() ? t.detach().requires_grad_(k.requires_grad) : t);
    }
    if (options.synchronize_boundary) synchronize_devices(inputs);
    at::Tensor output;
    {
      const GeneratorStates now = generators.current();
      generators.restore();
      try {
        at::AutoGradMode grad_mode(true);
        output = fn(inputs);
      } catch (...) {
        now.restore();
        throw;
      }
      now.restore();
    }
    torch::autograd::variable_list input_grads(kept.size());
    // The arena slots and host copies are no longer needed once the recomputation has run.
    kept.clear();
    if (output.defined() && output.requires_grad() && grads[0].defined()) {
      // Reentrant backward: the parameters' gradients reach their accumulators (and the engine's
      // hooks) here, once; the inputs' gradients are collected from the detached leaves.
      torch::autograd::backward({output}, {grads[0]});
      for (size_t i = 0; i < inputs.size(); ++i)
        if (inputs[i].defined() && inputs[i].requires_grad()) input_grads[i] = inputs[i].grad();
    }
    if (options.synchronize_boundary) synchronize_devices(inputs);
    if (options.timings) {
      options.timings->recomputations += 1;
      options.timings->recompute_seconds += seconds_since(start);
    }
    fn = nullptr;
    return input_grads;
  }
};

// A device tensor's copy in page-locked host memory. `read_on_host`: the host reads the copy next
// (the arena copies it into a slot with the CPU), so the copy must have landed when this returns;
// otherwise it is asynchronous, and what reads it later (the copy back to the device before the
// recomputation) is ordered after it on the same stream.
at::Tensor keep_on_host(const at::Tensor& x, bool read_on_host) {
  if (x.device().is_cpu()) return x;  // host memory already
  at::Tensor host = at::empty(x.sizes(), x.options().device(at::kCPU).pinned_memory(true));
  host.copy_(x, /*non_blocking=*/!read_on_host);
  return host;
}

// Frees and refills a storage for recompute_in_backward.
struct Rematerialization : torch::CustomClassHolder {
  c10::Storage storage;
  size_t nbytes = 0;
  c10::TensorOptions options;
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;
  std::function<void(at::Tensor&)> recompute;
};

struct Rematerialize : public torch::autograd::Function<Rematerialize> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            const c10::intrusive_ptr<Rematerialization>& state) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return y.view_as(y);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<Rematerialization>(ctx->saved_data["state"].toCapsule());
    c10::StorageImpl* impl = state->storage.unsafeGetStorageImpl();
    if (impl->nbytes() == 0 && state->recompute) {
      impl->set_data_ptr_noswap(impl->allocator()->allocate(state->nbytes));
      impl->set_nbytes(state->nbytes);
      // A tensor of its own on the storage: writing through it leaves the version counter of
      // the saved tensor alone (the values are the ones it was saved with).
      at::Tensor into = at::empty({0}, state->options);
      into.set_(state->storage, state->storage_offset, state->sizes, state->strides);
      at::NoGradGuard no_grad;
      state->recompute(into);
    }
    // The saved tensors that read the values hold the storage from here on and free it when
    // their nodes have run; this node lives until the whole graph is freed and must not keep
    // it (a chunked loss would otherwise hold every chunk's log-softmax to the end of backward).
    state->recompute = nullptr;
    state->storage = c10::Storage();
    ctx->saved_data.erase("state");
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor checkpoint(CheckpointFunction fn, const std::vector<at::Tensor>& inputs, const CheckpointOptions& options,
                      const std::vector<at::Tensor>& parameters) {
  if (!fn) throw ConfigError("checkpoint: expected a function, found an empty one");
  const auto needs_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  const bool differentiable = torch::GradMode::is_enabled() &&
                              (std::any_of(inputs.begin(), inputs.end(), needs_grad) ||
                               std::any_of(parameters.begin(), parameters.end(), needs_grad));
  if (!differentiable) return fn(inputs);

  const auto start = Clock::now();
  auto node = make_autograd_node<CheckpointBackward>();
  node->generators = GeneratorStates::capture(inputs);
  if (options.synchronize_boundary) synchronize_devices(inputs);
  std::vector<at::Tensor> detached;
  detached.reserve(inputs.size());
  for (const auto& t : inputs) detached.push_back(t.defined() ? t.detach() : t);
  at::Tensor output;
  {
    at::NoGradGuard no_grad;
    output = fn(detached);
    if (!output.defined()) throw Error("checkpoint: the function returned an undefined tensor");
    // The output gets the checkpoint's history: it must be a tensor of its own, not a view of an
    // input or an alias of one.
    const bool aliases = output.is_view() || std::any_of(detached.begin(), detached.end(), [&](const at::Tensor& t) {
                           return t.defined() && t.has_storage() && output.has_storage() &&
                                  t.storage().is_alias_of(output.storage());
                         });
    if (aliases) output = output.clone();
  }
  if (!torch::autograd::isDifferentiableType(output.scalar_type()))
    throw Error(std::string("checkpoint: the function's output must be floating point to carry gradients, found ") +
                c10::toString(output.scalar_type()));
  node->fn = std::move(fn);
  node->options = options;
  for (size_t i = 0; i < detached.size(); ++i) {
    const at::Tensor& t = detached[i];
    KeptInput k;
    k.requires_grad = needs_grad(inputs[i]);
    if (t.defined()) {
      k.device = t.device();
      at::Tensor kept_value = t;
      if (partitions(options) && t.numel() > 0) {
        k.partitioned = true;
        k.whole_sizes = t.sizes().vec();
        kept_value = piece_of(t, *options.partition_group);
      }
      k.value = options.keep_inputs_on_host ? keep_on_host(kept_value, /*read_on_host=*/options.arena != nullptr)
                                            : kept_value;
      if (options.arena) {
        auto [stored, slot] = options.arena->store(k.value);
        k.value = std::move(stored);
        k.slot = std::move(slot);
      }
    }
    node->kept.push_back(std::move(k));
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(output, node);
  if (options.synchronize_boundary) synchronize_devices({output});
  if (options.timings) {
    options.timings->forward_calls += 1;
    options.timings->forward_seconds += seconds_since(start);
  }
  return output;
}

at::Tensor run_checkpointed_block(torch::nn::Module& module, const at::Tensor& x, BlockFunction fn,
                                  const CheckpointOptions& options) {
  std::vector<at::Tensor> parameters = module.parameters(/*recurse=*/true);
  auto checkpointed = [fn = std::move(fn), options, parameters = std::move(parameters)](const at::Tensor& in) {
    return checkpoint([fn](const std::vector<at::Tensor>& v) { return fn(v[0]); }, {in}, options, parameters);
  };
  return run_block(module, x, checkpointed);
}

at::Tensor recompute_in_backward(const at::Tensor& output, const at::Tensor& discard,
                                 std::function<void(at::Tensor& into)> recompute) {
  if (!recompute) throw ConfigError("recompute_in_backward: expected a function, found an empty one");
  if (!torch::GradMode::is_enabled() || !output.requires_grad() || !discard.defined() || !discard.has_storage())
    return output;
  c10::StorageImpl* impl = discard.storage().unsafeGetStorageImpl();
  const size_t nbytes = impl->nbytes();
  // Only a tensor that owns its storage alone, from a resizable allocation, is freed: anything
  // else may be read by someone who does not expect it to vanish.
  if (!impl->resizable() || impl->allocator() == nullptr || nbytes == 0 || discard.storage_offset() != 0 ||
      size_t(discard.numel()) * discard.element_size() != nbytes || !discard.is_contiguous())
    return output;
  auto state = c10::make_intrusive<Rematerialization>();
  state->storage = discard.storage();
  state->nbytes = nbytes;
  state->options = discard.options();
  state->sizes = discard.sizes().vec();
  state->strides = discard.strides().vec();
  state->storage_offset = discard.storage_offset();
  state->recompute = std::move(recompute);
  at::Tensor y = Rematerialize::apply(output, state);
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, discard.device()));
  impl->set_nbytes(0);
  return y;
}

// ---- CheckpointArena ------------------------------------------------------------------------

struct CheckpointArena::State {
  std::mutex mutex;
  at::Tensor buffer;                // bytes, slots × slot_bytes
  std::vector<char> in_use;
  Stats stats;
};

CheckpointArena::CheckpointArena(int slots) : state_(std::make_shared<State>()) {
  if (slots < 1) throw ConfigError("CheckpointArena: expected at least one slot, found " + std::to_string(slots));
  state_->in_use.assign(size_t(slots), 0);
  state_->stats.slots = slots;
}

CheckpointArena::~CheckpointArena() = default;

CheckpointArena::Stats CheckpointArena::stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->stats;
}

std::pair<at::Tensor, std::shared_ptr<void>> CheckpointArena::store(const at::Tensor& x) {
  constexpr int64_t kAlignment = 64;
  const int64_t bytes = (int64_t(x.numel()) * int64_t(x.element_size()) + kAlignment - 1) / kAlignment * kAlignment;
  std::unique_lock lock(state_->mutex);
  State& s = *state_;
  const bool none_in_use = std::none_of(s.in_use.begin(), s.in_use.end(), [](char c) { return c != 0; });
  const bool fits = s.buffer.defined() && bytes <= s.stats.slot_bytes && s.buffer.device() == x.device();
  if (!fits && none_in_use && bytes > 0 && x.is_contiguous()) {
    // Sized (or grown) while no slot is held: the first step allocates, later ones reuse.
    s.buffer = at::Tensor();
    at::TensorOptions options = at::TensorOptions().dtype(at::kByte).device(x.device());
    if (x.device().is_cpu() && x.is_pinned()) options = options.pinned_memory(true);
    s.buffer = at::empty({int64_t(s.in_use.size()) * std::max(bytes, s.stats.slot_bytes)}, options);
    s.stats.slot_bytes = std::max(bytes, s.stats.slot_bytes);
    s.stats.buffer_allocations += 1;
  }
  const auto free_slot = std::find(s.in_use.begin(), s.in_use.end(), 0);
  if (!x.is_contiguous() || !s.buffer.defined() || bytes > s.stats.slot_bytes || s.buffer.device() != x.device() ||
      free_slot == s.in_use.end()) {
    s.stats.overflows += 1;
    return {x, nullptr};
  }
  const int64_t slot = free_slot - s.in_use.begin();
  s.in_use[size_t(slot)] = 1;
  s.stats.stores += 1;
  at::Tensor view = s.buffer.narrow(0, slot * s.stats.slot_bytes, int64_t(x.numel()) * int64_t(x.element_size()))
                        .view(x.scalar_type())
                        .view(x.sizes());
  lock.unlock();
  view.copy_(x, /*non_blocking=*/true);
  std::shared_ptr<void> handle(state_.get(), [state = state_, slot](void*) {
    std::lock_guard guard(state->mutex);
    state->in_use[size_t(slot)] = 0;
  });
  return {view, handle};
}

}  // namespace zt
