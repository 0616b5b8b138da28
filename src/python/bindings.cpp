// zerotrain._C: the C++ engine for Python (python/zerotrain). Python hands over a module's
// tensors and calls the engine; everything the engine does stays in C++.
//
// - A Python torch.nn.Module becomes a LibTorch module "shell" whose parameters and buffers are
//   the very tensors of the Python module (the same TensorImpl, registered under the same dotted
//   names, one child module per name component). The engine's set_data moves them into its flat
//   arenas in place, so the Python module keeps working as a module on the engine's storage.
// - Calls that run autograd or collectives release the GIL: backward may reach Python autograd
//   functions (checkpointed Python code, hooks) on the engine's threads, and they take the GIL.
// - zt::ConfigError and zt::DataError surface as zerotrain.ConfigError / zerotrain.DataError
//   (both ValueError), zt::CommError as zerotrain.CommError and other zt::Error as
//   zerotrain.EngineError (both RuntimeError).
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "memory/cpu_block_cache.h"
#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/layout/layout.h"
#include "zerotrain/models/gpt.h"
#include "train/runtime.h"
#include "zero/sharded_blocks.h"

namespace py = pybind11;

namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// A parameter group from Python: (names, lr or None, weight_decay or None).
using GroupTuple = std::tuple<std::vector<std::string>, std::optional<double>, std::optional<double>>;

std::vector<std::string> split_name(const std::string& name) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (true) {
    const size_t dot = name.find('.', begin);
    parts.push_back(name.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  for (const std::string& part : parts)
    if (part.empty()) throw zt::ConfigError("module shell: expected a dotted name without empty parts, found '" + name + "'");
  return parts;
}

// The child of `parent` named `part`, created when missing.
torch::nn::Module& child(torch::nn::Module& parent, const std::string& part) {
  for (const auto& item : parent.named_children())
    if (item.key() == part) return *item.value();
  return *parent.register_module(part, std::make_shared<torch::nn::Module>());
}

// Parameters in the Python module's order (named_parameters, duplicates removed: a tied weight is
// one parameter), then buffers. The registration order is the Python order, which the engine's
// layout (reverse registration order) and the checkpoints' names follow.
// `prebuilt`: shells already made for some submodules (units built sharded under the Python
// zero.Init, holding the same parameter tensors), placed at their paths as they are.
std::shared_ptr<torch::nn::Module> make_module_shell(
    const NamedTensors& parameters, const NamedTensors& buffers,
    const std::map<std::string, std::shared_ptr<torch::nn::Module>>& prebuilt) {
  auto root = std::make_shared<torch::nn::Module>();
  for (const auto& [path, module] : prebuilt) {
    std::vector<std::string> parts = split_name(path);
    torch::nn::Module* m = root.get();
    for (size_t i = 0; i + 1 < parts.size(); ++i) m = &child(*m, parts[i]);
    m->register_module(parts.back(), module);
  }
  auto place = [&](const std::string& name) -> std::pair<torch::nn::Module*, std::string> {
    std::vector<std::string> parts = split_name(name);
    torch::nn::Module* m = root.get();
    for (size_t i = 0; i + 1 < parts.size(); ++i) m = &child(*m, parts[i]);
    return {m, parts.back()};
  };
  for (const auto& [name, tensor] : parameters) {
    auto [m, leaf] = place(name);
    if (m->named_parameters(/*recurse=*/false).contains(leaf)) {
      // In a prebuilt shell: it must be the very same tensor.
      if (!m->named_parameters(false)[leaf].is_same(tensor))
        throw zt::ConfigError("module shell: parameter '" + name + "' is not the tensor its prebuilt unit holds");
      continue;
    }
    m->register_parameter(leaf, tensor, tensor.requires_grad());
  }
  for (const auto& [name, tensor] : buffers) {
    auto [m, leaf] = place(name);
    m->register_buffer(leaf, tensor);
  }
  return root;
}

std::shared_ptr<torch::nn::Module> submodule(const std::shared_ptr<torch::nn::Module>& shell, const std::string& path) {
  for (const auto& item : shell->named_modules(/*name_prefix=*/"", /*include_self=*/false))
    if (item.key() == path) return item.value();
  throw zt::ConfigError("module shell: expected a submodule named '" + path + "', found none");
}

// Stage 3's units: each named shell submodule becomes a block (zerotrain/zero/blocks.h), gathered and
// released as a whole; must precede the engine's construction.
void mark_units(const std::shared_ptr<torch::nn::Module>& shell, const std::vector<std::string>& paths) {
  for (const std::string& path : paths) zt::mark_block(submodule(shell, path));
}

// Runs fn() (a Python callable returning a list of tensors: a unit's forward, flattened) with the
// unit's parameters gathered; returns the outputs, those that require a gradient through the
// identity that gathers them again for backward.
std::vector<at::Tensor> run_unit(const std::shared_ptr<torch::nn::Module>& unit, const py::function& fn) {
  return zt::run_block_outputs(*unit, [&]() { return fn().cast<std::vector<at::Tensor>>(); });
}

// A Python callable held by C++ code that may drop it on a thread without the GIL.
std::shared_ptr<py::function> hold(py::function fn) {
  return std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
}

at::Tensor checkpoint_python(py::function fn, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& parameters) {
  std::shared_ptr<py::function> held = hold(std::move(fn));
  zt::CheckpointFunction run = [held](const std::vector<at::Tensor>& in) -> at::Tensor {
    py::gil_scoped_acquire gil;
    py::tuple args(in.size());
    for (size_t i = 0; i < in.size(); ++i) args[i] = py::cast(in[i]);
    py::object out = (*held)(*args);
    if (!THPVariable_Check(out.ptr()))
      throw zt::ConfigError(std::string("zerotrain.checkpointing.checkpoint: expected the function to return one tensor, found ") +
                            std::string(py::str(py::type::of(out).attr("__name__"))));
    return THPVariable_Unpack(out.ptr());
  };
  py::gil_scoped_release release;
  return zt::checkpoint(std::move(run), inputs, {}, parameters);
}

// Lines the engine reported (Engine::set_report_sink), until Python takes them.
struct ReportLines {
  std::mutex mutex;
  std::vector<std::string> pending;
};

struct PyStepResult {
  bool boundary, stepped, skipped, delayed;
  double grad_norm, lr, loss_scale;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerotrain's C++ engine (ZeRO stages 0-3, offload) for Python; use the zerotrain package";

  static py::exception<zt::Error> engine_error(m, "EngineError", PyExc_RuntimeError);
  static py::exception<zt::CommError> comm_error(m, "CommError", engine_error.ptr());
  static py::exception<zt::ConfigError> config_error(m, "ConfigError", PyExc_ValueError);
  static py::exception<zt::DataError> data_error(m, "DataError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const zt::ConfigError& e) {
      py::set_error(config_error, e.what());
    } catch (const zt::DataError& e) {
      py::set_error(data_error, e.what());
    } catch (const zt::CommError& e) {
      py::set_error(comm_error, e.what());
    } catch (const zt::Error& e) {
      py::set_error(engine_error, e.what());
    }
  });

  py::class_<zt::Communicator, std::shared_ptr<zt::Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &zt::Communicator::rank)
      // comms_logger's table of this communicator's collectives so far ("" without a logger).
      .def("comms_summary", [](const zt::Communicator& c) {
        const auto logger = c.comms_logger();
        return logger ? logger->table() : std::string();
      })
      .def_property_readonly("world_size", &zt::Communicator::world_size)
      .def("barrier", [](zt::Communicator& c, const std::string& label) {
        py::gil_scoped_release release;
        c.barrier(label);
      }, py::arg("label") = "python.barrier")
      .def("all_reduce", [](zt::Communicator& c, at::Tensor t, const std::string& op, const std::string& label) {
        zt::ReduceOp reduce;
        if (op == "sum") reduce = zt::ReduceOp::Sum;
        else if (op == "max") reduce = zt::ReduceOp::Max;
        else if (op == "avg") reduce = zt::ReduceOp::Avg;
        else throw zt::ConfigError("all_reduce: expected op sum, avg or max, found '" + op + "'");
        if (!t.is_contiguous()) throw zt::ConfigError("all_reduce: expected a contiguous tensor");
        py::gil_scoped_release release;
        c.all_reduce(t, reduce, label).wait();
      }, py::arg("tensor"), py::arg("op") = "sum", py::arg("label") = "python.all_reduce");

  // Whether the engine was compiled with its CUDA path (-DZT_CUDA=ON): the Python front end then
  // takes modules on a GPU (zerotrain.engine.TRAINING_DEVICE_TYPES).
  m.def("built_with_cuda", [] {
#ifdef ZT_CUDA
    return true;
#else
    return false;
#endif
  });

  // clients_only: every rank joins an existing store at MASTER_ADDR:MASTER_PORT as a client (the
  // one torch.distributed's env:// initialisation or torchrun's agent already serves).
  m.def("make_communicator", [](bool clients_only, std::optional<double> timeout_seconds) {
    zt::RendezvousInfo info = zt::rendezvous_from_environment();
    if (clients_only) info.agent_store = true;
    zt::CommOptions options = zt::comm_options_from_environment(timeout_seconds);
    py::gil_scoped_release release;
    return zt::make_communicator(info, options);
  }, py::arg("clients_only") = false, py::arg("timeout_seconds") = std::nullopt);

  m.def("rendezvous_from_environment", [] {
    zt::RendezvousInfo info = zt::rendezvous_from_environment();
    return py::dict(py::arg("rank") = info.rank, py::arg("world_size") = info.world_size,
                    py::arg("local_rank") = info.local_rank, py::arg("local_world_size") = info.local_world_size,
                    py::arg("master_addr") = info.master_addr, py::arg("master_port") = info.master_port,
                    py::arg("source") = info.source, py::arg("agent_store") = info.agent_store);
  });

  // The configuration as the command line reads it (the same checks), for `world_size` ranks.
  m.def("check_config", [](const std::string& json_text, const std::vector<std::string>& overrides, int world_size) {
    zt::TrainConfig config = zt::parse_config(json_text, overrides, world_size);
    return py::dict(py::arg("train_batch_size") = config.train_batch_size,
                    py::arg("train_micro_batch_size_per_gpu") = config.train_micro_batch_size_per_gpu,
                    py::arg("gradient_accumulation_steps") = config.gradient_accumulation_steps,
                    py::arg("warnings") = config.warnings, py::arg("resolved") = config.resolved);
  });

  // The reference GPT (src/models/gpt.cpp), built as the command line builds it from a
  // configuration: seeded with train.seed, sharded as it is built when the stage shards parameters.
  m.def("build_gpt", [](const std::string& json_text, int rank, int world_size) {
    zt::TrainConfig config = zt::parse_config(json_text, {}, world_size);
    if (config.model.type != "gpt")
      throw zt::ConfigError("zerotrain.models.GPT: expected model.type \"gpt\", found \"" + config.model.type + "\"");
    torch::manual_seed(config.train.seed);
    std::optional<zt::ShardedConstruction> sharded;
    if (config.zero.shard_parameters) sharded.emplace(rank, world_size);
    zt::GPT model(zt::gpt_config_of(config));
    sharded.reset();
    return std::static_pointer_cast<torch::nn::Module>(model.ptr());
  }, py::arg("config_json"), py::arg("rank"), py::arg("world_size"));
  m.def("gpt_loss", [](const std::shared_ptr<torch::nn::Module>& module, const at::Tensor& idx, const at::Tensor& targets) {
    auto gpt = std::dynamic_pointer_cast<zt::GPTImpl>(module);
    if (!gpt) throw zt::ConfigError("gpt_loss: expected a module made by build_gpt");
    // The forward is all C++: the script's other threads (a data loader) run beside it.
    py::gil_scoped_release release;
    return gpt->loss(idx, targets);
  });
  m.def("module_named_parameters", [](const std::shared_ptr<torch::nn::Module>& module) {
    NamedTensors out;
    for (const auto& item : module->named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
    return out;
  });
  m.def("module_train", [](const std::shared_ptr<torch::nn::Module>& module, bool on) { module->train(on); });

  // train.retain_freed_memory as the command line applies it (docs/memory.md "The heap policy"):
  // "bounded" installs the block cache as LibTorch's CPU allocator. Once per process.
  m.def("apply_heap_policy", [](const std::string& retain_freed_memory, bool shard_parameters) {
    static bool applied = false;
    if (applied) return;
    zt::apply_heap_policy(zt::heap_policy_of(retain_freed_memory, shard_parameters));
    applied = true;
  });
  m.def("block_cache_installed", [] { return zt::installed_cpu_block_cache() != nullptr; });
  // The installed cache's counters (docs/memory.md "The heap policy"); None without one.
  m.def("block_cache_stats", []() -> py::object {
    const zt::CpuBlockCache* cache = zt::installed_cpu_block_cache();
    if (cache == nullptr) return py::none();
    const zt::CpuBlockCacheStats s = cache->stats();
    py::dict d;
    d["large_allocations"] = s.large_allocations;
    d["reused"] = s.reused;
    d["split"] = s.split;
    d["composed"] = s.composed;
    d["moved_bytes"] = s.moved_bytes;
    d["mapped"] = s.mapped;
    d["mapped_bytes"] = s.mapped_bytes;
    d["unmapped"] = s.unmapped;
    d["live_bytes"] = s.live_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["high_water_bytes"] = s.high_water_bytes;
    return d;
  });
  // As the command line does once set-up is done: the bound follows the steps' peak, not the
  // construction's (docs/memory.md "The heap policy").
  m.def("heap_setup_done", [] {
    if (zt::CpuBlockCache* cache = zt::installed_cpu_block_cache()) cache->reset_high_water();
  });

  m.def("make_module_shell", &make_module_shell, py::arg("parameters"), py::arg("buffers"),
        py::arg("prebuilt") = std::map<std::string, std::shared_ptr<torch::nn::Module>>{});
  m.def("mark_block", &zt::mark_block, py::arg("module"));
  m.def("gather_pending", [](const std::shared_ptr<torch::nn::Module>& module, zt::Communicator& comm) {
    py::gil_scoped_release release;
    zt::gather_pending_block(*module, comm);
  }, py::arg("module"), py::arg("communicator"));
  // A block built sharded: (this rank's shard, the elements of all its parameters, rank, world), or
  // None once adopted. The shard is the block's own tensor: writes to it are the block's.
  m.def("pending_shard", [](const std::shared_ptr<torch::nn::Module>& module) -> py::object {
    std::optional<zt::ShardedBlock> block = zt::pending_sharded_block(*module);
    if (!block) return py::none();
    return py::make_tuple(block->shard, block->total_numel, block->rank, block->world_size);
  }, py::arg("module"));
  m.def("reshard_pending", [](const std::shared_ptr<torch::nn::Module>& module) { zt::reshard_pending_block(*module); },
        py::arg("module"));
  py::class_<zt::ShardedConstruction, std::unique_ptr<zt::ShardedConstruction>>(m, "ShardedConstruction")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("world_size"))
      .def_property_readonly("blocks_sharded", &zt::ShardedConstruction::blocks_sharded)
      .def_property_readonly("shard_bytes", &zt::ShardedConstruction::shard_bytes);
  m.def("shell_submodule", &submodule, py::arg("shell"), py::arg("path"));
  m.def("mark_units", &mark_units, py::arg("shell"), py::arg("paths"));
  m.def("run_unit", &run_unit, py::arg("unit"), py::arg("function"));

  py::class_<ReportLines, std::shared_ptr<ReportLines>>(m, "ReportLines")
      .def("take", [](ReportLines& r) {
        std::lock_guard<std::mutex> lock(r.mutex);
        std::vector<std::string> lines;
        lines.swap(r.pending);
        return lines;
      });
  py::class_<PyStepResult>(m, "StepResult")
      .def_readonly("boundary", &PyStepResult::boundary)
      .def_readonly("stepped", &PyStepResult::stepped)
      .def_readonly("skipped", &PyStepResult::skipped)
      .def_readonly("delayed", &PyStepResult::delayed)
      .def_readonly("grad_norm", &PyStepResult::grad_norm)
      .def_readonly("lr", &PyStepResult::lr)
      .def_readonly("loss_scale", &PyStepResult::loss_scale);

  py::class_<zt::Engine, std::shared_ptr<zt::Engine>>(m, "Engine")
      .def(py::init([](std::shared_ptr<torch::nn::Module> shell, const std::string& json_text,
                       const std::vector<std::string>& overrides, std::shared_ptr<zt::Communicator> comm,
                       const std::vector<GroupTuple>& group_tuples) {
             zt::TrainConfig config = zt::parse_config(json_text, overrides, comm->world_size());
             std::vector<zt::ParameterGroup> groups;
             for (const auto& [names, lr, weight_decay] : group_tuples) groups.push_back({names, lr, weight_decay});
             py::gil_scoped_release release;
             return std::make_shared<zt::Engine>(std::move(shell), config, std::move(comm), std::move(groups));
           }),
           py::arg("shell"), py::arg("config_json"), py::arg("overrides"), py::arg("communicator"),
           py::arg("groups") = std::vector<GroupTuple>{})
      .def(
          "backward",
          [](zt::Engine& e, const at::Tensor& loss, bool divide_by_accumulation) {
            py::gil_scoped_release release;
            e.backward(loss, divide_by_accumulation ? zt::LossDivision::ByAccumulationSteps
                                                    : zt::LossDivision::AlreadyDivided);
          },
          py::arg("loss"), py::arg("divide_by_accumulation") = true)
      .def("step", [](zt::Engine& e) {
        zt::StepResult r;
        {
          py::gil_scoped_release release;
          r = e.step();
        }
        return PyStepResult{r.boundary, r.stepped, r.skipped, r.delayed, r.grad_norm, r.lr, r.loss_scale};
      })
      .def("apply_pending_update", [](zt::Engine& e) {
        py::gil_scoped_release release;
        e.apply_pending_update();
      })
      .def_property_readonly("next_backward_is_boundary", &zt::Engine::next_backward_is_boundary)
      .def("set_gradient_accumulation_boundary", &zt::Engine::set_gradient_accumulation_boundary,
           py::arg("is_boundary"))
      .def("note_forward_start", &zt::Engine::note_forward_start)
      .def("note_forward_end", &zt::Engine::note_forward_end)
      // The engine's report lines are kept for Python to print after each call (through sys.stdout,
      // so that they interleave with the script's own output), never printed from C++.
      .def("collect_report_lines", [](zt::Engine& e) {
        auto lines = std::make_shared<ReportLines>();
        e.set_report_sink([lines](const std::string& line) {
          std::lock_guard<std::mutex> lock(lines->mutex);
          lines->pending.push_back(line);
        });
        return lines;
      })
      .def("comms_summary", &zt::Engine::comms_summary)
      .def_property_readonly("flops_report", [](const zt::Engine& e) -> py::object {
        const zt::FlopsReport* r = e.flops_report();
        if (r == nullptr) return py::none();
        py::dict d;
        d["step"] = r->step;
        d["forward_flops"] = r->forward_flops;
        d["backward_flops"] = r->backward_flops;
        d["step_flops"] = r->step_flops;
        d["forward_seconds"] = r->forward_seconds;
        d["backward_seconds"] = r->backward_seconds;
        d["step_seconds"] = r->step_seconds;
        d["total_seconds"] = r->total_seconds;
        d["peak_flops_per_second"] = r->peak_flops_per_second;
        d["peak_source"] = r->peak_source;
        d["achieved_flops_per_second"] = r->achieved_flops_per_second;
        d["mfu"] = r->mfu;
        d["operators"] = r->operators;
        d["text"] = r->text;
        return d;
      })
      .def_property_readonly("global_step", &zt::Engine::global_step)
      .def_property_readonly("skipped_steps", &zt::Engine::skipped_steps)
      .def_property_readonly("learning_rate", &zt::Engine::learning_rate)
      .def("set_learning_rates", &zt::Engine::set_learning_rates, py::arg("rates"))
      .def_property_readonly("loss_scale", &zt::Engine::loss_scale)
      .def_property_readonly("trainable_parameters", &zt::Engine::trainable_parameters)
      .def("diagnostics",
           [](const zt::Engine& e) {
             const zt::EngineDiagnostics d = e.diagnostics();
             py::dict out;
             out["peak_gathered_parameter_bytes"] = d.peak_gathered_parameter_bytes;
             out["prefetched_blocks"] = d.prefetched_blocks;
             out["block_gathers"] = d.block_gathers;
             out["secondary_block_gathers"] = d.secondary_block_gathers;
             return out;
           })
      .def_property_readonly("config_json", [](const zt::Engine& e) { return e.config().resolved; })
      .def_property_readonly("gradient_accumulation_steps",
                             [](const zt::Engine& e) { return e.config().gradient_accumulation_steps; })
      .def_property_readonly("train_micro_batch_size_per_gpu",
                             [](const zt::Engine& e) { return e.config().train_micro_batch_size_per_gpu; })
      .def_property_readonly("train_batch_size", [](const zt::Engine& e) { return e.config().train_batch_size; })
      .def_property_readonly("model_state_bytes", [](const zt::Engine& e) {
        zt::ModelStateBytes b = e.model_state_bytes();
        return py::dict(py::arg("parameters") = b.parameters, py::arg("gradients") = b.gradients,
                        py::arg("optimizer_states") = b.optimizer_states, py::arg("total") = b.total());
      })
      .def("master_parameter", [](zt::Engine& e, const std::string& name) {
        py::gil_scoped_release release;
        return e.master_parameter(name);
      })
      .def("set_master_parameter", [](zt::Engine& e, const std::string& name, const at::Tensor& value) {
        py::gil_scoped_release release;
        e.set_master_parameter(name, value);
      })
      .def("set_master_parameters", [](zt::Engine& e, const std::map<std::string, at::Tensor>& values) {
        py::gil_scoped_release release;
        e.set_master_parameters(values);
      })
      .def("hold_blocks", [](zt::Engine& e, const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
        std::vector<const torch::nn::Module*> raw;
        for (const auto& m : modules) raw.push_back(m.get());
        py::gil_scoped_release release;
        e.hold_blocks(raw);
      })
      .def("release_held_blocks", [](zt::Engine& e) {
        py::gil_scoped_release release;
        e.release_held_blocks();
      })
      .def("save_checkpoint", [](zt::Engine& e, const std::string& dir, const std::string& tag,
                                 const std::map<std::string, std::string>& client_state, int keep_last) {
        py::gil_scoped_release release;
        e.save_checkpoint(dir, tag, client_state, keep_last);
      }, py::arg("dir"), py::arg("tag"), py::arg("client_state"), py::arg("keep_last") = 0)
      .def("load_checkpoint", [](zt::Engine& e, const std::string& dir, const std::string& tag, bool reset_optimizer) {
        zt::LoadOptions options;
        options.reset_optimizer = reset_optimizer;
        py::gil_scoped_release release;
        return e.load_checkpoint(dir, tag, options);
      }, py::arg("dir"), py::arg("tag"), py::arg("reset_optimizer") = false);

  // A saved checkpoint's model, tensor by tensor (zerotrain.utils.zero_to_fp32).
  py::class_<zt::CheckpointModel>(m, "CheckpointModel")
      .def(py::init([](const std::string& dir, const std::string& tag) {
             return std::make_unique<zt::CheckpointModel>(dir, tag);
           }),
           py::arg("dir"), py::arg("tag") = "")
      .def("names",
           [](const zt::CheckpointModel& c) {
             std::vector<std::string> names;
             for (const auto& t : c.tensors()) names.push_back(t.name);
             return names;
           })
      .def("frozen", &zt::CheckpointModel::frozen, py::arg("name"))
      .def("read", &zt::CheckpointModel::read, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("root", &zt::CheckpointModel::root);
  m.def("checkpoint", &checkpoint_python, py::arg("function"), py::arg("inputs"), py::arg("parameters"),
        "Runs function(*inputs) keeping only the inputs; backward recomputes it with the same random "
        "numbers (zerotrain/models/activation_checkpointing.h checkpoint)");
}
