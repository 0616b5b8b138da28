// `zerotrain export`: a checkpoint's or a configuration's initial weights as safetensors or in the
// Hugging Face layout.
#include "cli/cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "memory/estimate_report.h"
#include "zerotrain/comm.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/estimate.h"
#include "zerotrain/step_time.h"
#include "zerotrain/launch.h"
#include "zerotrain/memory_fit.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/train.h"
#include "zerotrain/version.h"

namespace zt::cli {

namespace {

// The configuration of `export --init`, resolved for the world size its batch keys imply: the
// initial weights do not depend on it (rank 0's values are every rank's), but an explicit batch
// triple only resolves for one world size.
zt::TrainConfig load_init_config(const ExportArgs& args) {
  try {
    return zt::load_config(args.init_config, args.overrides, 1);
  } catch (const zt::ConfigError& first) {
    for (int world = 2; world <= kMaxLocalRanks; ++world) {
      try {
        return zt::load_config(args.init_config, args.overrides, world);
      } catch (const zt::ConfigError&) {
      }
    }
    throw;
  }
}

// One source of weights: a checkpoint or --init CONFIG, with the flags that apply to it.
void check_export_source(const ExportArgs& args) {
  if (args.checkpoint.empty() == args.init_config.empty())
    throw zt::ConfigError("export: expected a checkpoint directory or --init CONFIG (one of them)");
  if (!args.overrides.empty() && args.init_config.empty())
    throw zt::ConfigError("export: --set applies to --init CONFIG only");
  if (!args.tag.empty() && !args.init_config.empty()) throw zt::ConfigError("export: --tag applies to a checkpoint only");
}

}  // namespace

// `zerotrain export`: a checkpoint's weights (streamed from its rank files) or, with --init, the
// weights a training configuration starts from (built in memory as the trainer builds them).
int run_export(const ExportArgs& args) {
  check_export_source(args);
  const bool hf = args.format == "hf";
  if (!args.max_shard_size.empty() && !hf) throw zt::ConfigError("--max-shard-size: applies to --format hf only");
  const int64_t max_shard = args.max_shard_size.empty() ? zt::hf_default_max_shard_bytes()
                                                         : zt::parse_shard_size(args.max_shard_size);
  if (hf) check_output_dir(args.out, "--out");
  else check_output_file(args.out, "--out");
  const at::ScalarType dtype = args.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const auto started = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  bool bert = false;  // the model is the reference BERT (else the GPT)
  std::string source;
  if (!args.init_config.empty()) {
    const zt::TrainConfig config = load_init_config(args);
    for (const std::string& note : config.notes) std::cerr << "zerotrain: note: " << note << "\n";
    bert = config.model.type == "bert";
    // As the trainer: the seed right before construction (rank 0's values are every rank's).
    zt::GPTConfig gpt;
    zt::BertConfig bert_config;
    std::shared_ptr<torch::nn::Module> model;
    if (bert) {
      bert_config = zt::bert_config_of(config);
      torch::manual_seed(config.train.seed);
      model = zt::Bert(bert_config).ptr();
    } else {
      gpt = zt::gpt_config_of(config);
      torch::manual_seed(config.train.seed);
      model = zt::GPT(gpt).ptr();
    }
    torch::NoGradGuard no_grad;
    if (!config.model.init_from.empty()) {
      zt::HfModelReader reader(config.model.init_from, gpt);
      for (auto& named : model->named_parameters(/*recurse=*/true)) {
        torch::Tensor values = torch::empty(named.value().sizes(), torch::kFloat32);
        reader.read(named.key(), named.value().sizes().vec(), 0, values.numel(), values.data_ptr<float>());
        named.value().copy_(values);
      }
      source = fmt::format("the weights of model.init_from '{}'", config.model.init_from);
    } else {
      source = fmt::format("the initial weights of preset '{}' with train.seed {}", config.model.preset,
                           config.train.seed);
    }
    std::vector<zt::HfTensor> tensors;
    for (const auto& named : model->named_parameters(/*recurse=*/true)) {
      torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach().to(torch::kFloat32); }});
    }
    for (const auto& named : model->named_buffers(/*recurse=*/true)) {
      if (!named.value().is_floating_point()) continue;
      torch::Tensor value = named.value();
      tensors.push_back({named.key(), value.sizes().vec(), [value] { return value.detach().to(torch::kFloat32); }});
    }
    bytes = hf && bert ? zt::write_hf_bert_model(tensors, bert_config, args.out, dtype, max_shard)
            : hf       ? zt::write_hf_model(tensors, gpt, args.out, dtype, max_shard)
               : zt::write_safetensors_model(tensors, args.out, dtype,
                                             {{"format", "pt"}, {"zerotrain.init", args.init_config}});
  } else if (hf) {
    zt::CheckpointModel checkpoint(args.checkpoint, args.tag);
    bert = zt::model_type_from_resolved(checkpoint.configuration(), checkpoint.where()) == "bert";
    std::vector<zt::HfTensor> tensors;
    for (const auto& p : checkpoint.tensors())
      tensors.push_back({p.name, p.shape, [&checkpoint, name = p.name] { return checkpoint.read(name); }});
    bytes = bert ? zt::write_hf_bert_model(tensors, zt::bert_config_from_resolved(checkpoint.configuration(),
                                                                                   checkpoint.where()),
                                           args.out, dtype, max_shard)
                 : zt::write_hf_model(tensors, zt::gpt_config_from_resolved(checkpoint.configuration(),
                                                                            checkpoint.where()),
                                      args.out, dtype, max_shard);
    source = "checkpoint " + checkpoint.root();
  } else {
    bytes = zt::export_checkpoint(args.checkpoint, args.tag, args.out, dtype);
    source = "checkpoint " + args.checkpoint;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << fmt::format("wrote {} ({}, {:.1f} MB, {}) from {} in {:.2f} s; peak RSS {:.0f} MiB\n", args.out,
                           !hf ? "safetensors" : bert ? "Hugging Face BERT directory" : "Hugging Face GPT-2 directory", bytes / 1e6, args.dtype, source,
                           seconds, zt::peak_rss_bytes() / 1048576.0);
  return 0;
}

CLI::App* add_export_command(CLI::App& app, ExportArgs& args) {
  auto* export_cmd = app.add_subcommand(
      "export", "write a checkpoint's model weights (or a configuration's initial ones, --init) as safetensors or as "
                "a Hugging Face GPT-2 directory (streamed, tensor by tensor)");
  auto* export_checkpoint_option =
      export_cmd->add_option("checkpoint", args.checkpoint, "checkpoint directory (the --save-dir of a run)");
  auto* export_init_option = export_cmd->add_option(
      "--init", args.init_config,
      "instead of a checkpoint: the weights this training configuration starts from (its seed, or its model.init_from)");
  export_checkpoint_option->excludes(export_init_option);
  export_cmd->add_option("--set", args.overrides, "with --init: override a configuration value: key.path=value")
      ->take_all()->allow_extra_args(false);
  export_cmd->add_option("--out", args.out,
                         "the safetensors file (--format safetensors) or directory (--format hf) to write")
      ->required();
  export_cmd->add_option("--format", args.format,
                         "safetensors (default: one file, zerotrain's names) or hf (a directory transformers' "
                         "GPT2LMHeadModel.from_pretrained loads)")
      ->check(CLI::IsMember({"safetensors", "hf"}));
  export_cmd->add_option("--max-shard-size", args.max_shard_size,
                         "--format hf: shard the weights above this size (bytes, or 50GB, 500MB: transformers' units; "
                         "default 50GB as its save_pretrained)");
  export_cmd->add_option("--tag", args.tag, "which checkpoint (default: the one 'latest' names)");
  export_cmd->add_option("--dtype", args.dtype, "fp32 or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  return export_cmd;
}

}  // namespace zt::cli
