#include <torch/torch.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "zero/engine_impl.h"
#include "zerotrain/error.h"

// The engine's checkpoints (docs/checkpoint.md): saving and loading this rank's pieces of the
// state by parameter name, load_weights, and one parameter's masters. Every load stages what it
// reads and changes nothing until every rank has succeeded.

namespace zt {
namespace {

void commit_frozen(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& staged) {
  torch::NoGradGuard no_grad;
  for (const auto& [target, values] : staged) target.detach().copy_(values);
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Adam and AdamW keep the same state; the type names compare case-insensitively.
std::string optimizer_family(std::string type) {
  for (char& c : type) c = char(std::tolower(static_cast<unsigned char>(c)));
  return type == "adamw" ? "adam" : type;
}

// Serves load_weights: the named parameters from `values`, every other value as it is now, so
// that only those change.
struct SomeParametersReader : WeightReader {
  std::map<std::string, torch::Tensor> values;  // fp32, contiguous, flat
  std::vector<StateFragment> current;
  std::map<std::string, torch::Tensor> frozen;
  void read(const std::string& n, const std::vector<int64_t>& shape, int64_t begin, int64_t count,
            float* out) override {
    if (auto it = values.find(n); it != values.end()) {
      std::memcpy(out, it->second.data_ptr<float>() + begin, size_t(count) * sizeof(float));
      return;
    }
    if (auto it = frozen.find(n); it != frozen.end()) {
      torch::Tensor v = it->second.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
      std::memcpy(out, v.data_ptr<float>() + begin, size_t(count) * sizeof(float));
      return;
    }
    for (StateFragment& f : current) {
      if (f.parameter != n || begin < f.begin || begin + count > f.begin + f.numel) continue;
      if (auto t = f.roles.find("master"); t != f.roles.end()) {
        torch::Tensor v = t->second.reshape({-1}).narrow(0, begin - f.begin, count).to(torch::kCPU).contiguous();
        std::memcpy(out, v.data_ptr<float>(), size_t(count) * sizeof(float));
      } else {
        f.sources.at("master")(begin - f.begin, count, out);
      }
      return;
    }
    throw Error("set_master_parameters: no state of '" + n + "' elements [" + std::to_string(begin) + ", " +
                std::to_string(begin + count) + ") on this rank");
  }
};

}  // namespace

// This rank's pieces of the optimizer state by parameter name and element range. Without
// sharded optimizer states every rank holds all of it; rank 0 saves it.
std::vector<StateFragment> Engine::Impl::owned_state(bool saving, bool with_moments) {
  if (saving && rank >= shard_world) return {};
  return optimizer->fragments(with_moments,
                              [this](int placement) { return specs[layout.placements[placement].index].name; });
}

void Engine::Impl::save_checkpoint(const std::string& dir, const std::string& tag,
                                   const std::map<std::string, std::string>& client_state, int keep_last) {
  if (micro_step != 0)
    throw Error("save_checkpoint: expected a call between optimizer steps, found micro-step " +
                std::to_string(micro_step) + " of an accumulation window of " +
                std::to_string(config.gradient_accumulation_steps));
  // A checkpoint holds every update so far; the running engine continues from the same state a
  // resumed one starts from, so resuming is exact with the delayed update too.
  apply_pending_update();
  CheckpointContents contents;
  contents.parameters = checkpointed;
  const LossScaler::State s = scaler.state();
  contents.scalars = {{"global_step", std::to_string(global_step)},
                      {"skipped_steps", std::to_string(skipped)},
                      {"optimizer", config.optimizer.type},
                      {"optimizer.moments_from", std::to_string(moments_from)},
                      {"loss_scale", fmt_double(s.scale)},
                      {"loss_scale.hysteresis_left", std::to_string(s.hysteresis_left)},
                      {"loss_scale.iteration", std::to_string(s.iteration)},
                      {"loss_scale.last_overflow_iteration", std::to_string(s.last_overflow_iteration)}};
  for (const auto& [key, value] : client_state) contents.scalars["client." + key] = value;
  contents.configuration = config.resolved;
  std::vector<StateFragment> fragments = owned_state(true, true);
  for (const auto& [name, value] : frozen_values()) {
    contents.frozen.push_back({name, value.sizes().vec()});
    // Every rank holds them whole; rank 0 saves them.
    if (rank == 0) {
      StateFragment f;
      f.parameter = name;
      f.numel = value.numel();
      f.roles["frozen"] = value.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32);
      fragments.push_back(std::move(f));
    }
  }
  save_sharded_checkpoint(checkpoint_group(), dir, tag, contents, fragments, keep_last);
}

CheckpointGroup Engine::Impl::checkpoint_group() const {
  return tensor_group ? CheckpointGroup(*comm, *tensor_group) : CheckpointGroup(*comm);
}

// The model's values outside the layout, by name: frozen parameters and floating-point buffers
// (with 16-bit training, in the working dtype; saved as fp32, exactly). Buffers of other dtypes
// are left out, said once.
std::vector<std::pair<std::string, torch::Tensor>> Engine::Impl::frozen_values() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& named : model->named_parameters(/*recurse=*/true)) {
    if (named.value().requires_grad()) continue;
    // Saved and loaded whole from tensor rank 0: a frozen slice would be taken for the tensor.
    if (tensor_split_of(named.value()))
      throw ConfigError("checkpoint: frozen parameter '" + named.key() + "' is a tensor-parallel slice; expected "
                        "frozen values replicated over the tensor group (train the slice, or freeze it unsplit)");
    out.emplace_back(named.key(), named.value());
  }
  for (const auto& named : model->named_buffers(/*recurse=*/true)) {
    if (named.value().is_floating_point()) {
      out.emplace_back(named.key(), named.value());
    } else if (!noted_integer_buffers && rank == 0) {
      std::fprintf(stderr, "zerotrain: note: buffer '%s' (%s) and any other non-floating-point buffer are not kept in "
                   "checkpoints or read by load_weights\n", named.key().c_str(), c10::toString(named.value().scalar_type()));
      noted_integer_buffers = true;
    }
  }
  return out;
}

// Staging for the frozen values a load fills: fp32 tensors, copied into the model only when
// every rank succeeded.
std::vector<std::pair<torch::Tensor, torch::Tensor>> Engine::Impl::stage_frozen(
    std::vector<CheckpointParameter>* list) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> staged;
  for (const auto& [name, value] : frozen_values()) {
    if (list) list->push_back({name, value.sizes().vec()});
    staged.emplace_back(value, torch::empty(value.sizes(), torch::kFloat32));
  }
  return staged;
}

void Engine::Impl::load_weights(WeightReader& reader) {
  if (micro_step != 0)
    throw Error("load_weights: expected a call between optimizer steps, found micro-step " + std::to_string(micro_step));
  apply_pending_update();
  preflight_load_staging(/*with_moments=*/false);
  OptimizerPartition::Staged staged = optimizer->staged_fragments(
      false, [this](int placement) { return specs[layout.placements[placement].index].name; });
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : registered) shapes[p.name] = p.shape;
  std::vector<std::pair<std::string, torch::Tensor>> frozen = frozen_values();
  auto staged_frozen = stage_frozen(nullptr);
  std::exception_ptr error;
  try {
    std::vector<float> piece;
    for (StateFragment& f : staged.fragments) {
      const std::vector<int64_t>& shape = shapes.at(f.parameter);
      if (auto t = f.roles.find("master"); t != f.roles.end()) {
        reader.read(f.parameter, shape, f.begin, f.numel, t->second.data_ptr<float>());
        continue;
      }
      // A master partition on NVMe: through its staging file, a chunk at a time.
      const FragmentSink& sink = f.sinks.at("master");
      const int64_t chunk = checkpoint_chunk_bytes() / int64_t(sizeof(float));
      piece.resize(size_t(std::min(chunk, f.numel)));
      for (int64_t done = 0; done < f.numel;) {
        const int64_t n = std::min(chunk, f.numel - done);
        reader.read(f.parameter, shape, f.begin + done, n, piece.data());
        sink(done, n, piece.data());
        done += n;
      }
    }
    for (size_t i = 0; i < frozen.size(); ++i)
      reader.read(frozen[i].first, frozen[i].second.sizes().vec(), 0, frozen[i].second.numel(),
                  staged_frozen[i].second.data_ptr<float>());
  } catch (...) {
    error = std::current_exception();
  }
  // Every rank learns whether all succeeded before anything changes.
  torch::Tensor failed = torch::full({1}, error ? double(rank + 1) : 0.0, torch::kFloat64);
  comm->all_reduce(failed, ReduceOp::Max, "engine.load_weights").wait();
  if (error) std::rethrow_exception(error);
  if (failed.item<double>() > 0)
    throw Error("load_weights: reading failed on rank " + std::to_string(int(failed.item<double>()) - 1) +
                " (its error names the problem)");
  torch::NoGradGuard no_grad;
  release_read_ahead();
  optimizer->commit_fragments(staged);
  optimizer->refresh_working_from_masters();
  publish_parameters();
  reducer->clear();
  commit_frozen(staged_frozen);
}

const CheckpointParameter& Engine::Impl::trainable_named(const std::string& name, const char* what) const {
  for (const CheckpointParameter& p : registered)
    if (p.name == name) return p;
  throw ConfigError(std::string(what) + ": expected the name of a trainable parameter of the model, found '" + name + "'");
}

// Every rank adds what it keeps of the masters into zeros; the owners' ranges do not overlap, so
// the sum is the whole tensor, bit for bit.
torch::Tensor Engine::Impl::master_parameter(const std::string& name) {
  const CheckpointParameter& p = trainable_named(name, "master_parameter");
  if (micro_step != 0)
    throw Error("master_parameter: expected a call between optimizer steps, found micro-step " + std::to_string(micro_step));
  apply_pending_update();
  torch::Tensor full = torch::zeros({numel_of(p.shape)}, torch::kFloat32);
  for (StateFragment& f : owned_state(/*saving=*/true, /*with_moments=*/false)) {
    if (f.parameter != name) continue;
    if (auto t = f.roles.find("master"); t != f.roles.end())
      full.narrow(0, f.begin, f.numel).copy_(t->second.reshape({-1}));
    else
      f.sources.at("master")(0, f.numel, full.data_ptr<float>() + f.begin);
  }
  torch::Tensor on_device = full.to(devices.compute);
  comm->all_reduce(on_device, ReduceOp::Sum, "engine.master_parameter").wait();
  return on_device.to(torch::kCPU).view(p.shape);
}

void Engine::Impl::set_master_parameters(const std::map<std::string, torch::Tensor>& values) {
  SomeParametersReader reader;
  for (const auto& [name, value] : values) {
    const CheckpointParameter& p = trainable_named(name, "set_master_parameters");
    if (value.numel() != numel_of(p.shape))
      throw ConfigError("set_master_parameters: the value for '" + name + "' has " + std::to_string(value.numel()) +
                        " elements, expected " + std::to_string(numel_of(p.shape)));
    reader.values[name] = value.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32).contiguous();
  }
  if (micro_step != 0)
    throw Error("set_master_parameters: expected a call between optimizer steps, found micro-step " +
                std::to_string(micro_step));
  apply_pending_update();
  reader.current = owned_state(/*saving=*/false, /*with_moments=*/false);
  for (const auto& [n, v] : frozen_values()) reader.frozen[n] = v;
  load_weights(reader);
}

// A checkpoint's scalars, read and checked on every rank before anything of it is loaded (the
// check of load_sharded_checkpoint).
Engine::Impl::SavedState Engine::Impl::read_saved_state(const LoadedCheckpoint& saved,
                                                         const LoadOptions& options) const {
  SavedState state;
  // The counters, parsed before anything is read: a malformed one is a DataError on every rank.
  auto number = [&](const std::string& key, double lo, double hi, bool integer) {
    auto it = saved.scalars.find(key);
    if (it == saved.scalars.end()) throw DataError(saved.manifest + ": no '" + key + "' in its scalars");
    size_t used = 0;
    double v = std::nan("");
    try {
      v = std::stod(it->second, &used);
    } catch (const std::exception&) {
    }
    if (used != it->second.size() || !(v >= lo && v <= hi) || (integer && v != std::floor(v)))
      throw DataError(saved.manifest + ": scalar '" + key + "' is '" + it->second + "', expected " +
                      (integer ? "an integer" : "a number") + " in [" + fmt_double(lo) + ", " + fmt_double(hi) + "]");
    return v;
  };
  constexpr double kMaxCount = 9007199254740992.0;  // 2^53: exact in a double
  state.scaler.scale = number("loss_scale", 0, std::numeric_limits<double>::max(), false);
  state.scaler.hysteresis_left = int(number("loss_scale.hysteresis_left", 0, std::numeric_limits<int>::max(), true));
  state.scaler.iteration = int64_t(number("loss_scale.iteration", 0, kMaxCount, true));
  state.scaler.last_overflow_iteration = int64_t(number("loss_scale.last_overflow_iteration", -1, kMaxCount, true));
  state.step = int64_t(number("global_step", 0, kMaxCount, true));
  state.skipped_steps = int64_t(number("skipped_steps", 0, double(state.step), true));
  // Absent from checkpoints saved before the option existed: the moments started with the run.
  state.moments_from =
      saved.scalars.count("optimizer.moments_from")
          ? int64_t(number("optimizer.moments_from", 0, double(state.step - state.skipped_steps), true))
          : 0;
  auto it = saved.scalars.find("optimizer");
  if (it == saved.scalars.end()) throw DataError(saved.manifest + ": no 'optimizer' in its scalars");
  if (!options.reset_optimizer && optimizer_family(it->second) != optimizer_family(config.optimizer.type))
    throw DataError(saved.manifest + ": saved with optimizer " + it->second + ", this run uses " +
                    config.optimizer.type + "; its optimizer state does not apply (load with reset_optimizer, "
                    "--reset-optimizer, to load the weights only)");
  // Hyper-parameters may change between runs; each change is reported.
  auto tracked = [](const std::string& key) {
    return key.rfind("optimizer.", 0) == 0 || key.rfind("scheduler.", 0) == 0 || key == "gradient_clipping";
  };
  std::set<std::string> keys;
  for (const auto& [key, value] : saved.configuration) if (tracked(key)) keys.insert(key);
  for (const auto& [key, value] : config.resolved) if (tracked(key)) keys.insert(key);
  for (const std::string& key : keys) {
    const auto before = saved.configuration.find(key);
    const auto after = config.resolved.find(key);
    const std::string old_value = before == saved.configuration.end() ? "(unset)" : before->second;
    const std::string new_value = after == config.resolved.end() ? "(unset)" : after->second;
    if (old_value != new_value) state.changes.push_back(key + ": " + old_value + " -> " + new_value);
  }
  return state;
}

std::map<std::string, std::string> Engine::Impl::load_checkpoint(const std::string& dir, const std::string& tag,
                                                                 const LoadOptions& options) {
  if (micro_step != 0)
    throw Error("load_checkpoint: expected a call between optimizer steps, found micro-step " +
                std::to_string(micro_step));
  apply_pending_update();
  // Read into staging first (host tensors for what is in memory, staging swap files for what is
  // on NVMe), so that a failure leaves this engine as it was. Resetting the optimizer reads the
  // masters only.
  preflight_load_staging(/*with_moments=*/!options.reset_optimizer);
  OptimizerPartition::Staged staged = optimizer->staged_fragments(
      !options.reset_optimizer, [this](int placement) { return specs[layout.placements[placement].index].name; });
  SavedState saved_state;
  const auto check = [&](const LoadedCheckpoint& saved) { saved_state = read_saved_state(saved, options); };
  // The frozen values, whole on every rank, staged as the rest.
  std::vector<CheckpointParameter> frozen_list;
  auto staged_frozen = stage_frozen(&frozen_list);
  for (size_t i = 0; i < staged_frozen.size(); ++i) {
    StateFragment f;
    f.parameter = frozen_list[i].name;
    f.numel = staged_frozen[i].second.numel();
    f.roles["frozen"] = staged_frozen[i].second.view({-1});
    staged.fragments.push_back(std::move(f));
  }
  const LoadedCheckpoint loaded =
      load_sharded_checkpoint(checkpoint_group(), dir, tag, checkpointed, staged.fragments, check, frozen_list);
  const auto& scalars = loaded.scalars;
  const LossScaler::State s = saved_state.scaler;
  torch::NoGradGuard no_grad;
  release_read_ahead();
  optimizer->commit_fragments(staged);
  optimizer->refresh_working_from_masters();  // the working copy of the owned region (16-bit)
  publish_parameters();
  if (options.reset_optimizer) optimizer->zero_moments();
  reducer->clear();
  if (loaded.has_frozen) commit_frozen(staged_frozen);
  global_step = saved_state.step;
  skipped = saved_state.skipped_steps;
  moments_from = options.reset_optimizer ? saved_state.step - saved_state.skipped_steps : saved_state.moments_from;
  scaler.restore(s);
  if (rank == 0)
    for (const std::string& line : saved_state.changes) {
      if (options.log) options.log(line);
      else std::printf("checkpoint: %s\n", line.c_str());
    }
  if (rank == 0 && !options.log) std::fflush(stdout);
  std::map<std::string, std::string> client;
  for (const auto& [key, value] : scalars)
    if (key.rfind("client.", 0) == 0) client[key.substr(7)] = value;
  return client;
}

}  // namespace zt
