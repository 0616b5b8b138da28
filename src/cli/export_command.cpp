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
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "memory/estimate_report.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/memory/step_time.h"
#include "zerotrain/launch/launch.h"
#include "zerotrain/memory/memory_fit.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/train/train.h"
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

// The text of DIR/config.json ("" when `dir` is "" or it has none): the Llama export keeps its
// other keys (token ids, ...).
std::string source_config_text(const std::string& dir) {
  if (dir.empty()) return "";
  const std::filesystem::path path = std::filesystem::path(dir) / "config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec) || std::filesystem::file_size(path, ec) > (1 << 20)) return "";
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A Llama export in the Hugging Face layout, with the tokenizer files of the directory the model
// came from (`source_dir`, "" for none) beside it. `carried`: the text of that directory's
// config.json as a checkpoint carries it ("" to read the directory's own).
int64_t write_llama_export(const std::vector<zt::HfTensor>& tensors, const zt::LlamaConfig& llama,
                           const std::string& source_dir, const std::string& carried, const ExportArgs& args,
                           at::ScalarType dtype, int64_t max_shard) {
  const int64_t bytes = zt::write_hf_llama_model(tensors, llama, args.out, dtype, max_shard,
                                                 carried.empty() ? source_config_text(source_dir) : carried);
  if (source_dir.empty()) return bytes;
  if (!std::filesystem::is_directory(source_dir)) {
    // The weights and config.json are whole without it; only the tokenizer files are missing.
    std::cerr << fmt::format("zerotrain: note: '{}' is gone: its tokenizer files are not copied beside the export\n",
                             source_dir);
    return bytes;
  }
  const auto copied = zt::copy_hf_tokenizer_files(source_dir, args.out);
  if (!copied.empty()) std::cout << fmt::format("copied {} from '{}'\n", fmt::join(copied, ", "), source_dir);
  return bytes;
}

// What one export wrote: its bytes, where the weights came from and what kind of file it is.
struct ExportDone {
  int64_t bytes = 0;
  std::string source;
  std::string kind;
};

std::string hf_kind(const std::string& type) {
  return type == "bert" ? "Hugging Face BERT directory"
         : type == "llama" ? "Hugging Face Llama-family directory"
                           : "Hugging Face GPT-2 directory";
}

// export --init: the model built as the trainer builds it, with its model.init_from's weights.
ExportDone export_init(const ExportArgs& args, bool hf, at::ScalarType dtype, int64_t max_shard) {
  const zt::TrainConfig config = load_init_config(args);
  for (const std::string& note : config.notes) std::cerr << "zerotrain: note: " << note << "\n";
  const std::string& type = config.model.type;
  const bool bert = type == "bert", llama = type == "llama";
  ExportDone done;
  done.kind = hf ? hf_kind(type) : "safetensors";
  // As the trainer: the seed right before construction (rank 0's values are every rank's).
  zt::GPTConfig gpt;
  zt::BertConfig bert_config;
  zt::LlamaConfig llama_config;
  std::shared_ptr<torch::nn::Module> model;
  if (bert) {
    bert_config = zt::bert_config_of(config);
    torch::manual_seed(config.train.seed);
    model = zt::Bert(bert_config).ptr();
  } else if (llama) {
    llama_config = zt::llama_config_of(config);
    torch::manual_seed(config.train.seed);
    model = zt::Llama(llama_config).ptr();
  } else {
    gpt = zt::gpt_config_of(config);
    torch::manual_seed(config.train.seed);
    model = zt::GPT(gpt).ptr();
  }
  torch::NoGradGuard no_grad;
  if (!config.model.init_from.empty()) {
    zt::HfModelReader reader = llama ? zt::HfModelReader(config.model.init_from, llama_config)
                                     : zt::HfModelReader(config.model.init_from, gpt);
    for (auto& named : model->named_parameters(/*recurse=*/true)) {
      torch::Tensor values = torch::empty(named.value().sizes(), torch::kFloat32);
      reader.read(named.key(), named.value().sizes().vec(), 0, values.numel(), values.data_ptr<float>());
      named.value().copy_(values);
    }
    done.source = fmt::format("the weights of model.init_from '{}'", config.model.init_from);
  } else if (llama && !config.model.config_from.empty()) {
    done.source = fmt::format("the initial weights of model.config_from '{}' with train.seed {}",
                              config.model.config_from, config.train.seed);
  } else {
    done.source = fmt::format("the initial weights of preset '{}' with train.seed {}", config.model.preset,
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
  const std::string source_dir = !config.model.init_from.empty() ? config.model.init_from : config.model.config_from;
  done.bytes = hf && llama ? write_llama_export(tensors, llama_config, source_dir, "", args, dtype, max_shard)
               : hf && bert ? zt::write_hf_bert_model(tensors, bert_config, args.out, dtype, max_shard)
               : hf         ? zt::write_hf_model(tensors, gpt, args.out, dtype, max_shard)
                            : zt::write_safetensors_model(tensors, args.out, dtype,
                                                          {{"format", "pt"}, {"zerotrain.init", args.init_config}});
  return done;
}

// A checkpoint in the Hugging Face layout of the model type it was trained with.
ExportDone export_hf_checkpoint(const ExportArgs& args, at::ScalarType dtype, int64_t max_shard) {
  zt::CheckpointModel checkpoint(args.checkpoint, args.tag);
  const auto& resolved = checkpoint.configuration();
  const std::string type = zt::model_type_from_resolved(resolved, checkpoint.where());
  std::vector<zt::HfTensor> tensors;
  for (const auto& p : checkpoint.tensors())
    tensors.push_back({p.name, p.shape, [&checkpoint, name = p.name] { return checkpoint.read(name); }});
  ExportDone done;
  done.kind = hf_kind(type);
  done.source = "checkpoint " + checkpoint.root();
  if (type == "llama") {
    std::string source_dir;
    const std::string carried = zt::carried_hf_config(checkpoint.scalars());
    const zt::LlamaConfig llama = zt::llama_config_from_resolved(resolved, checkpoint.where(), source_dir, carried);
    done.bytes = write_llama_export(tensors, llama, source_dir, carried, args, dtype, max_shard);
  } else if (type == "bert") {
    done.bytes = zt::write_hf_bert_model(tensors, zt::bert_config_from_resolved(resolved, checkpoint.where()),
                                         args.out, dtype, max_shard);
  } else {
    done.bytes = zt::write_hf_model(tensors, zt::gpt_config_from_resolved(resolved, checkpoint.where()), args.out,
                                    dtype, max_shard);
  }
  return done;
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
  ExportDone done;
  if (!args.init_config.empty()) {
    done = export_init(args, hf, dtype, max_shard);
  } else if (hf) {
    done = export_hf_checkpoint(args, dtype, max_shard);
  } else {
    done = {zt::export_checkpoint(args.checkpoint, args.tag, args.out, dtype), "checkpoint " + args.checkpoint,
            "safetensors"};
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << fmt::format("wrote {} ({}, {:.1f} MB, {}) from {} in {:.2f} s; peak RSS {:.0f} MiB\n", args.out,
                           done.kind, done.bytes / 1e6, args.dtype, done.source, seconds,
                           zt::peak_rss_bytes() / 1048576.0);
  return 0;
}

CLI::App* add_export_command(CLI::App& app, ExportArgs& args) {
  auto* export_cmd = app.add_subcommand(
      "export", "write a checkpoint's model weights (or a configuration's initial ones, --init) as safetensors or as "
                "a Hugging Face directory (GPT-2, BERT, Llama/Qwen2; streamed, tensor by tensor)");
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
                         "from_pretrained loads: GPT2LMHeadModel, BertFor*, LlamaForCausalLM or Qwen2ForCausalLM)")
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
