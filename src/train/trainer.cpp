#include "zerotrain/train.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <unistd.h>

#ifdef ZT_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "checkpoint/hf.h"
#include "common/check.h"
#include "memory/estimate_report.h"
#include "train/runtime.h"
#include "zero/step_monitor.h"
#include "zerotrain/cpu_block_cache.h"
#include "zerotrain/comm.h"
#include "zerotrain/comms_logger.h"
#include "zerotrain/config.h"
#include "zerotrain/blocks.h"
#include "zerotrain/data.h"
#include "zerotrain/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/lr_schedule.h"
#include "zerotrain/estimate.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/bert_data.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/gpt_flops.h"

namespace zt {
namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("data.path: cannot open text file '{}'", path));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Splits {
  TokenDataset train, val;
};

Splits load_data(const TrainConfig& config, int64_t vocab_size) {
  const auto& d = config.data;
  ByteTokenizer tokenizer;
  std::optional<TokenDataset> all;
  if (d.source == "embedded") all = TokenDataset::from_text(embedded_corpus(), tokenizer);
  else if (d.source == "text") all = TokenDataset::from_text(read_text_file(d.path), tokenizer);
  else if (d.source == "bin") {
    auto train = TokenDataset::from_bin_file(d.path);
    if (!d.val_path.empty()) {
      Splits s{std::move(train), TokenDataset::from_bin_file(d.val_path)};
      s.train.validate(vocab_size);
      s.val.validate(vocab_size);
      return s;
    }
    all = std::move(train);
  } else {
    throw ConfigError(fmt::format("data.source: expected \"embedded\", \"text\" or \"bin\", found \"{}\"", d.source));
  }
  all->validate(vocab_size);
  auto [train, val] = all->split(d.val_fraction);
  return Splits{std::move(train), std::move(val)};
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<long long>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string human_rate(double per_second) {
  if (per_second >= 1e6) return fmt::format("{:.2f}M", per_second / 1e6);
  if (per_second >= 1e3) return fmt::format("{:.1f}k", per_second / 1e3);
  return fmt::format("{:.0f}", per_second);
}

// The device this rank trains on (TrainRunOptions::device) and what the run reports of it.
struct RankDevice {
  torch::Device device{torch::kCPU};
  std::string name;          // the GPU's name; "" on the CPU
  int64_t total_memory = 0;  // the GPU's memory in bytes; 0 on the CPU
  int visible = 0;           // GPUs this process sees
  bool cuda() const { return device.is_cuda(); }
};

// "cpu", or "cuda": cuda:(local_rank % visible GPUs), made this thread's current device so that
// NCCL and the caching allocator use it.
RankDevice select_device(const std::string& requested, int local_rank) {
  RankDevice d;
  if (requested == "cpu") return d;
  if (requested != "cuda")
    throw ConfigError(fmt::format("device: expected \"cpu\" or \"cuda\", found \"{}\"", requested));
#ifdef ZT_CUDA
  const int count = c10::cuda::device_count();
  if (count <= 0)
    throw ConfigError("--device cuda: no CUDA device is visible (see nvidia-smi and CUDA_VISIBLE_DEVICES)");
  const auto index = static_cast<c10::DeviceIndex>(local_rank % count);
  c10::cuda::set_device(index);
  d.device = torch::Device(torch::kCUDA, index);
  const cudaDeviceProp* properties = at::cuda::getDeviceProperties(index);
  d.name = properties->name;
  d.total_memory = static_cast<int64_t>(properties->totalGlobalMem);
  d.visible = count;
  return d;
#else
  (void)local_rank;
  throw ConfigError("--device cuda: this zerotrain was built without CUDA (configure with -DZT_CUDA=ON)");
#endif
}

// Waits for the work queued on this rank's GPU (nothing on the CPU, whose kernels are synchronous):
// timers read after it measure the work, not its launch.
void synchronize(const RankDevice& d) {
#ifdef ZT_CUDA
  if (d.cuda()) c10::cuda::device_synchronize();
#else
  (void)d;
#endif
}

// Peak bytes of the CUDA caching allocator on this rank's GPU: handed to tensors, and reserved
// from the driver (what nvidia-smi shows, less the context). Zero on the CPU.
struct DevicePeak {
  int64_t allocated = 0, reserved = 0;
};
DevicePeak device_peak(const RankDevice& d) {
#ifdef ZT_CUDA
  if (d.cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.device.index());
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    return {stats.allocated_bytes[all].peak, stats.reserved_bytes[all].peak};
  }
#else
  (void)d;
#endif
  return {};
}

int64_t physical_memory_bytes() { return int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGE_SIZE)); }

// The peak RSS of set-up (the model's construction, loading weights or a checkpoint) and, once
// the kernel's peak was restarted after it, of the steps alone.
struct PeakRss {
  int64_t setup = -1;  // -1 while set-up runs
  bool split = false;  // the kernel's peak was restarted after set-up
  // The steps' peak; -1 before, or where the kernel does not allow the restart.
  int64_t steps() const { return setup >= 0 && split ? int64_t(peak_rss_bytes()) : -1; }
  int64_t run() const { return std::max<int64_t>(setup, peak_rss_bytes()); }
};

// Per-rank figures gathered onto every rank: peak RSS and model-state bytes by role.
struct RankStats {
  int64_t peak_rss = 0;  // the run's
  int64_t baseline_rss = 0;
  ModelStateBytes state;
  int64_t buffers = 0;
  int64_t setup_peak_rss = -1, steps_peak_rss = -1;  // PeakRss
};

std::vector<RankStats> gather_rank_stats(Communicator& comm, const Engine& engine, int64_t baseline_rss,
                                         const PeakRss& peak) {
  const int world = comm.world_size();
  constexpr int kFields = 8;
  auto local = torch::zeros({kFields}, torch::kInt64);
  local[0] = peak.run();
  local[1] = baseline_rss;
  const auto b = engine.model_state_bytes();
  local[2] = b.parameters;
  local[3] = b.gradients;
  local[4] = b.optimizer_states;
  local[5] = engine.buffer_bytes();
  local[6] = peak.setup;
  local[7] = peak.steps();
  auto all = torch::zeros({kFields * world}, torch::kInt64);
  comm.all_gather(local, all, "stats.gather").wait();
  std::vector<RankStats> stats(world);
  auto a = all.accessor<int64_t, 1>();
  for (int r = 0; r < world; ++r) {
    const int64_t* f = &a[kFields * r];
    stats[r] = RankStats{f[0], f[1], ModelStateBytes{f[2], f[3], f[4]}, f[5], f[6], f[7]};
  }
  return stats;
}

// Mean of `value` over all ranks.
double mean_over_ranks(Communicator& comm, double value, const char* label) {
  auto t = torch::full({1}, value, torch::kFloat64);
  comm.all_reduce(t, ReduceOp::Sum, label).wait();
  return t.item<double>() / comm.world_size();
}

// Largest `value` over all ranks.
int64_t max_over_ranks(Communicator& comm, int64_t value, const char* label) {
  auto t = torch::full({1}, value, torch::kInt64);
  comm.all_reduce(t, ReduceOp::Max, label).wait();
  return t.item<int64_t>();
}

at::ScalarType working_dtype_of(Precision precision) {
  switch (precision) {
    case Precision::BF16: return at::kBFloat16;
    case Precision::FP16: return at::kHalf;
    case Precision::FP32: break;
  }
  return at::kFloat;
}

}  // namespace

namespace {

// data.sequence_length (0: the model's context) against the model's context; the length used.
int64_t check_sequence_length(int64_t configured, int64_t context) {
  const int64_t seq_len = configured > 0 ? configured : context;
  if (seq_len > context)
    throw ConfigError(fmt::format("data.sequence_length: expected at most the model's context length {}, found {}",
                                  context, seq_len));
  return seq_len;
}

}  // namespace

void check_training_inputs(const TrainConfig& config) {
  // comms_logger.prof_ops names operations: an unknown one is refused before any rank starts.
  if (config.comms_logger.enabled) CommsLogger(config.comms_logger, 0, 1);
  const auto& d = config.data;
  auto check_file = [](const std::string& key, const std::string& path, bool token_file) {
    if (path.empty()) throw DataError(fmt::format("{}: expected a file path, found an empty value", key));
    std::error_code ec;
    auto status = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::is_regular_file(status))
      throw DataError(fmt::format("{}: expected a readable file, found no file at '{}'", key, path));
    std::ifstream probe(path, std::ios::binary);
    if (!probe) throw DataError(fmt::format("{}: cannot open '{}' for reading", key, path));
    const auto size = std::filesystem::file_size(path, ec);
    if (token_file && (size == 0 || size % 2 != 0))
      throw DataError(fmt::format("{}: expected a non-empty file of uint16 tokens (even byte count), found {} bytes in '{}'",
                                  key, size, path));
  };
  if (d.source == "bin") {
    check_file("data.path", d.path, true);
    if (!d.val_path.empty()) check_file("data.val_path", d.val_path, true);
  } else if (d.source == "text") {
    check_file("data.path", d.path, false);
  }
  // What every rank would refuse as it starts is refused once, before any starts: the model's
  // shape (a preset, the head count dividing the width), the sequence against the context, and
  // the schedule's parameters.
  int64_t context = 0;
  if (config.model.type == "bert") {
    const BertConfig bert = bert_config_of(config);
    bert.validate();
    context = bert.max_positions;
  } else {
    const GPTConfig gpt = gpt_config_of(config);
    gpt.validate();
    context = gpt.context_length;
  }
  check_sequence_length(config.data.sequence_length, context);
  LrSchedule(config.scheduler, config.optimizer.lr);
  // A directory of another shape, or not a GPT-2 directory, fails before any rank starts.
  if (!config.model.init_from.empty()) HfModelReader(config.model.init_from, gpt_config_of(config));
}

int run_training_rank(const TrainConfig& config_in, const TrainRunOptions& options) {
  auto rendezvous = rendezvous_from_environment();
  const std::string& retain = config_in.train.retain_freed_memory;
  RuntimeSettings runtime =
      apply_runtime_settings(config_in.train.threads, rendezvous.local_world_size,
                             heap_policy_of(retain, config_in.zero.shard_parameters));
  TrainConfig config = config_in;
  if (config.world_size != rendezvous.world_size)
    throw ConfigError(fmt::format("world size: the configuration was resolved for {} ranks but this run has {} "
                                  "(WORLD_SIZE from {})",
                                  config.world_size, rendezvous.world_size, rendezvous.source));
  // The configured timeout wins only when someone set it; else ZT_COMM_TIMEOUT_SECONDS, else 5 min.
  std::optional<double> timeout;
  if (auto it = config.sources.find("comm.timeout_seconds"); it != config.sources.end() && it->second != ValueSource::Default)
    timeout = config.comm.timeout_seconds;
  CommOptions comm_options = comm_options_from_environment(timeout);
  // comms_logger: made before the communicator so that the first collective is counted too.
  std::shared_ptr<CommsLogger> comms_logger;
  if (config.comms_logger.enabled)
    comms_logger = std::make_shared<CommsLogger>(config.comms_logger, rendezvous.rank, rendezvous.world_size);
  comm_options.comms_logger = comms_logger;
  // The GPU first: NCCL's communicator and the caching allocator use the current device.
  const RankDevice device = select_device(options.device, rendezvous.local_rank);
  // bf16/fp16 on a CPU without 16-bit units: fp32, unless train.cpu_half_precision says otherwise.
  // Decided before anything reads the precision (the estimate, the engine, the flops profiler).
  const Precision configured_precision = config.precision;
  std::string precision_note;
  if (!device.cuda()) {
    PrecisionChoice choice = cpu_training_precision(config.precision, config.train.cpu_half_precision);
    config.precision = choice.precision;
    precision_note = std::move(choice.note);
  }
  auto comm = make_communicator(rendezvous, comm_options);
  const int rank = comm->rank();
  const int world = comm->world_size();
  const bool leader = rank == 0 && !options.quiet;

  // model.type "bert": the encoder of docs/bert.md, trained on masked sentence pairs; the GPT's
  // figures below stay at their defaults and are not read.
  const bool is_bert = config.model.type == "bert";
  const GPTConfig gpt_config = is_bert ? GPTConfig{} : gpt_config_of(config);
  const BertConfig bert_config = is_bert ? bert_config_of(config) : BertConfig{};
  // BERT's content vocabulary: its ids, then [CLS], [SEP], [MASK], [PAD] (bert_data.h).
  const BertSpecialTokens bert_specials{bert_config.vocab_size - 4};
  const int64_t context = is_bert ? bert_config.max_positions : gpt_config.context_length;
  const int64_t seq_len = check_sequence_length(config.data.sequence_length, context);
  Splits data = load_data(config, is_bert ? bert_specials.content_vocab : gpt_config.vocab_size);
  const int64_t n_layer = is_bert ? bert_config.n_layer : gpt_config.n_layer;

  // activation_checkpointing.policy "auto": the cheapest recomputation whose estimated peak fits
  // this machine's memory shared by its ranks (docs/activation_checkpointing.md).
  std::string policy_note;
  if (config.activation_checkpointing.policy == "auto" && !is_bert) {
    ClusterSpec machine;
    machine.device = DeviceKind::Cpu;
    machine.devices_per_node = rendezvous.local_world_size;
    machine.nodes = world / std::max(1, rendezvous.local_world_size);
    machine.device_memory = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGE_SIZE)) /
                            std::max(1, rendezvous.local_world_size);
    if (device.cuda()) {
      // Each GPU's memory, shared by the local ranks placed on it; the host's memory per node.
      const int per_gpu = (rendezvous.local_world_size + device.visible - 1) / std::max(1, device.visible);
      machine.device = DeviceKind::Cuda;
      machine.device_memory = device.total_memory / std::max(1, per_gpu);
      machine.host_memory = physical_memory_bytes();
    }
    const ModelFigures figures = gpt_model_figures(gpt_config, seq_len, config.zero.stage3_param_persistence_threshold);
    Recompute chosen = Recompute::Full;
    int64_t need = 0;
    for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      EstimateOptions o;
      o.recompute = r;
      const MemoryEstimate e = estimate_memory(figures, machine, config, o);
      need = e.per_device.total();
      chosen = r;
      if (e.fits_device) break;
    }
    config.activation_checkpointing.policy = to_string(chosen);
    policy_note = fmt::format("activation_checkpointing.policy \"auto\" chose \"{}\": estimated peak {} per rank of {} "
                              "({} over {} local rank(s), keeping {:.0f}% free){}",
                              to_string(chosen), human_bytes(need), human_bytes(machine.device_memory),
                              device.cuda() ? "the GPUs' memory" : "this machine's memory",
                              rendezvous.local_world_size, 100 * machine.headroom,
                              need > int64_t(double(machine.device_memory) * (1 - machine.headroom))
                                  ? "; even full recomputation does not fit, the run may run out of memory"
                                  : "");
  }

  if (leader) {
    fmt::print("zerotrain: {} rank(s), {} intra-op thread(s) per rank, rendezvous from {}\n", world,
               runtime.intra_op_threads, rendezvous.source);
    if (device.cuda())
      fmt::print("device: {} ({}, {:.1f} GiB); {} GPU(s) visible, rank r on cuda:(LOCAL_RANK % {})\n", device.device.str(),
                 device.name, device.total_memory / 1073741824.0, device.visible, device.visible);
    else
      fmt::print("device: cpu\n");
    if (!precision_note.empty()) fmt::print("{}\n", precision_note);
    fmt::print("resolved configuration:\n{}", describe(config));
  }

  // What the process holds before the model exists (LibTorch, communicator, data): the memory
  // estimate (zerotrain/estimate.h) is compared with the peak above it.
  const int64_t baseline_rss = current_rss_bytes();
  torch::manual_seed(config.train.seed);
  // With sharded parameters the model is built already sharded: no rank ever holds all of it.
  // On a GPU the model is built whole on the CPU and moved before the engine takes it (sharded
  // construction is CPU-only).
  std::optional<ShardedConstruction> sharded;
  if (config.zero.shard_parameters && !device.cuda()) sharded.emplace(rank, world);
  GPT model{nullptr};
  Bert bert{nullptr};
  std::shared_ptr<torch::nn::Module> module;
  if (is_bert) {
    bert = Bert(bert_config);
    module = bert.ptr();
  } else {
    model = GPT(gpt_config);
    module = model.ptr();
  }
  sharded.reset();
  if (device.cuda()) {
    if (leader && config.zero.shard_parameters)
      fmt::print("note: on {} each rank builds the whole model on the CPU and moves it to its GPU; sharded "
                 "construction is CPU-only\n",
                 device.device.str());
    module->to(device.device);
  }
  const int64_t n_params = is_bert ? bert_parameter_count(bert_config) : gpt_parameter_count(gpt_config);
  auto is_checkpointed = [&](int64_t i) { return is_bert ? bert->is_checkpointed(i) : model->is_checkpointed(i); };
  {
    const ActivationCheckpointingConfig& ac = config.activation_checkpointing;
    CheckpointingSettings settings;
    settings.recompute = recompute_of(config);
    settings.number_checkpoints = ac.number_checkpoints;
    settings.keep_inputs_on_host = ac.cpu_checkpointing;
    settings.contiguous_memory = ac.contiguous_memory_optimization;
    settings.synchronize_boundary = ac.synchronize_checkpoint_boundary;
    settings.profile = ac.profile;
    if (is_bert) bert->set_checkpointing(settings);
    else model->set_checkpointing(settings);
    if (leader && !policy_note.empty()) fmt::print("{}\n", policy_note);
    if (leader && settings.recompute != Recompute::None) {
      int64_t checkpointed = 0;
      for (int64_t i = 0; i < n_layer; ++i) checkpointed += is_checkpointed(i) ? 1 : 0;
      fmt::print("activation checkpointing: {} recomputation in {} of {} blocks{}{}\n", to_string(settings.recompute),
                 checkpointed, n_layer, ac.contiguous_memory_optimization ? ", inputs in one contiguous buffer" : "",
                 ac.profile ? ", profiled (summary: activation_checkpointing.blocks)" : "");
      if (ac.cpu_checkpointing || ac.synchronize_checkpoint_boundary)
        fmt::print("note: activation_checkpointing.cpu_checkpointing and synchronize_checkpoint_boundary act on CUDA "
                   "devices; on the CPU the kept inputs are in host memory already and every kernel is synchronous\n");
    }
  }
  Engine engine(module, config, comm);
  // This trainer prints its own progress line, CSV log and analytic flops profile.
  engine.disable_reports();
  // Resuming: the checkpoint holds the engine's state; the sampler position is the step (batches
  // are a function of seed, step and micro-step) and so are the dropout masks (reseeded every step
  // below), so nothing else is needed for an exact continuation.
  int64_t first_step = 0;
  // model.init_from: the Hugging Face weights replace the constructor's before the first step;
  // each rank reads only what it keeps (docs/checkpoint.md "model.init_from"). With --resume the
  // checkpoint's weights win and the directory is not read.
  nlohmann::json init_from_summary;
  if (!config.model.init_from.empty() && !options.resume_dir.empty()) {
    if (leader)
      fmt::print("note: model.init_from '{}' is not read: --resume loads the checkpoint's weights\n",
                 config.model.init_from);
  } else if (!config.model.init_from.empty()) {
    const auto init_start = std::chrono::steady_clock::now();
    HfModelReader reader(config.model.init_from, gpt_config);
    engine.load_weights(reader);
    // Every rank's bytes read, for the summary: what sharding saved.
    torch::Tensor mine = torch::zeros({world}, torch::kLong);
    mine[rank] = reader.bytes_read();
    comm->all_reduce(mine, ReduceOp::Sum, "init_from.bytes").wait();
    std::vector<int64_t> per_rank(mine.data_ptr<int64_t>(), mine.data_ptr<int64_t>() + world);
    init_from_summary = {{"path", config.model.init_from}, {"bytes_read_per_rank", per_rank},
                         {"tensor_bytes", reader.data_bytes()}};
    if (leader)
      fmt::print("model.init_from: loaded '{}' in {:.2f} s; bytes read per rank {} of {} in its files\n",
                 config.model.init_from,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - init_start).count(),
                 fmt::join(per_rank, "/"), reader.data_bytes());
  }
  if (!options.resume_dir.empty()) {
    const auto load_start = std::chrono::steady_clock::now();
    LoadOptions load_options;
    load_options.reset_optimizer = options.reset_optimizer;
    load_options.log = [](const std::string& line) { fmt::print("checkpoint: {} (changed since the checkpoint)\n", line); };
    const auto client = engine.load_checkpoint(options.resume_dir, "", load_options);
    const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    if (auto it = client.find("seed"); it != client.end() && it->second != std::to_string(config.train.seed) && leader)
      fmt::print("note: the checkpoint was saved with train.seed {}; this run uses {}\n", it->second, config.train.seed);
    first_step = engine.global_step();
    if (leader)
      fmt::print("resumed from {}: the latest checkpoint, at step {}, loaded in {:.2f} s{}\n", options.resume_dir,
                 first_step, load_seconds, options.reset_optimizer ? " (weights only: optimizer moments reset)" : "");
  }

  const int64_t micro = config.train_micro_batch_size_per_gpu;
  const int64_t accum = config.gradient_accumulation_steps;
  const FlopsProfilerConfig& fp = config.flops_profiler;
  if (leader && fp.enabled && !is_bert && (fp.profile_step <= first_step || fp.profile_step > config.train.steps))
    fmt::print("note: flops_profiler.profile_step {} is outside the steps this run takes ({} to {}): nothing is "
               "profiled\n",
               fp.profile_step, first_step + 1, config.train.steps);
  nlohmann::json flops_summary;
  std::optional<DistributedSampler> train_sampler, val_sampler;
  std::optional<BatchPrefetcher> prefetcher;
  // BERT: sentence pairs of seq_len tokens masked as BERT's pre-training data; a batch is a
  // function of (seed, step, micro-step) as the GPT's, so resuming needs only the step. The
  // held-out pairs are drawn only when the run evaluates (the split may be too short otherwise).
  std::optional<SentencePairSampler> train_pairs, val_pairs;
  std::optional<MlmMasker> masker;
  std::optional<Prefetcher<BertBatch>> bert_prefetcher;
  if (is_bert) {
    SentencePairOptions pair_options;
    pair_options.max_length = seq_len;
    pair_options.specials = bert_specials;
    // A .bin file's ids are another tokenizer's: the byte values of '.', '!', '?' and newline
    // mean nothing there, so its segments are cut at lengths only.
    if (config.data.source == "bin") {
      pair_options.sentence_ends.clear();
      pair_options.leading_skip.clear();
    }
    MlmOptions mlm_options;
    mlm_options.probability = config.data.mlm_probability;
    mlm_options.max_predictions = config.data.max_predictions;
    masker.emplace(mlm_options, bert_specials, config.train.seed);
    train_pairs.emplace(data.train, pair_options, micro, world, rank, config.train.seed);
    if (config.train.eval_interval > 0)
      val_pairs.emplace(data.val, pair_options, micro, world, rank, config.train.seed ^ 0x5eedULL);
    // Sentence pairs and their masking are built on the prefetch thread (the sampler and the masker
    // are immutable), beside the step on the batch before: on a GPU they otherwise leave it idle.
    bert_prefetcher.emplace(
        [&](int64_t i) {
          BertBatch batch = train_pairs->batch(i / accum, i % accum, *masker);
          if (device.cuda())
            for (at::Tensor* t : {&batch.input_ids, &batch.token_type_ids, &batch.attention_mask,
                                  &batch.masked_positions, &batch.masked_labels, &batch.nsp_labels})
              if (t->defined()) *t = t->pin_memory();
          return batch;
        },
        first_step * accum);
  } else {
    train_sampler.emplace(data.train, seq_len, micro, world, rank, config.train.seed);
    val_sampler.emplace(data.val, seq_len, micro, world, rank, config.train.seed ^ 0x5eedULL);
    // On a GPU the prefetch thread pins each batch, so that the copy to the device runs asynchronously.
    prefetcher.emplace(
        [&](int64_t i) {
          Batch batch = train_sampler->batch(i / accum, i % accum);
          if (device.cuda()) {
            batch.inputs = batch.inputs.pin_memory();
            batch.targets = batch.targets.pin_memory();
          }
          return batch;
        },
        first_step * accum);
  }
  auto to_device = [&](Batch batch) {
    if (device.cuda()) {
      batch.inputs = batch.inputs.to(device.device, /*non_blocking=*/true);
      batch.targets = batch.targets.to(device.device, /*non_blocking=*/true);
    }
    return batch;
  };
  auto bert_to_device = [&](BertBatch batch) {
    if (device.cuda())
      for (at::Tensor* t : {&batch.input_ids, &batch.token_type_ids, &batch.attention_mask, &batch.masked_positions,
                            &batch.masked_labels, &batch.nsp_labels})
        if (t->defined()) *t = t->to(device.device, /*non_blocking=*/t->is_pinned());
    return batch;
  };
  // The loss of this rank's micro-batch `a` of `step`.
  auto micro_loss = [&](int64_t step, int64_t a) {
    (void)step;
    (void)a;
    if (is_bert) return bert->mlm_loss(bert_to_device(bert_prefetcher->next()));
    Batch batch = to_device(prefetcher->next());
    return model->loss(batch.inputs, batch.targets);
  };

  if (leader && is_bert)
    fmt::print("model: bert preset '{}' ({} layers, {} heads, hidden {}, intermediate {}, vocab {} with 4 specials, "
               "{} positions, {}, {}), {:.2f}M parameters; data: {} train / {} held-out tokens; global batch {} x {} "
               "tokens, {:.0f}% of the content positions predicted{}\n",
               config.model.preset, bert_config.n_layer, bert_config.n_head, bert_config.hidden,
               bert_config.intermediate, bert_config.vocab_size, bert_config.max_positions,
               bert_config.pre_layer_norm ? "pre-LN" : "post-LN",
               bert_config.next_sentence ? "MLM + NSP loss" : "MLM loss", n_params / 1e6, data.train.size(),
               data.val.size(), config.train_batch_size, seq_len, 100 * config.data.mlm_probability,
               config.data.max_predictions > 0 ? fmt::format(" (at most {} per sequence)", config.data.max_predictions)
                                               : "");
  else if (leader)
    fmt::print("model: gpt preset '{}' ({} layers, {} heads, width {}, vocab {}, context {}), {:.2f}M parameters; "
               "data: {} train / {} held-out tokens; global batch {} x {} tokens\n",
               config.model.preset, gpt_config.n_layer, gpt_config.n_head, gpt_config.n_embd, gpt_config.vocab_size,
               gpt_config.context_length, n_params / 1e6, data.train.size(), data.val.size(),
               config.train_batch_size, seq_len);

  std::ofstream csv;
  if (rank == 0 && config.csv_monitor.enabled) {
    auto dir = std::filesystem::path(config.csv_monitor.output_path.empty() ? config.train.log_dir
                                                                            : config.csv_monitor.output_path);
    std::filesystem::create_directories(dir);
    auto path = dir / (config.csv_monitor.job_name + ".csv");
    // A resumed run continues the log of the run it resumes.
    const bool append = first_step > 0 && std::filesystem::exists(path);
    csv.open(path, append ? std::ios::app : std::ios::trunc);
    if (!csv) throw DataError(fmt::format("csv_monitor.output_path: cannot write '{}'", path.string()));
    // Every row holds its own step's figures (docs/memory.md "The per-step log"): tokens/s of
    // this step alone, and the largest peak RSS over all ranks so far.
    if (!append) csv << "step,loss,lr,grad_norm,skipped,tokens_per_second,elapsed_seconds,peak_rss_bytes_max,loss_scale\n";
  }

  auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    double sum = 0;
    module->eval();
    for (int64_t i = 0; i < config.train.eval_iters; ++i) {
      if (is_bert) {
        sum += bert->mlm_loss(bert_to_device(val_pairs->batch(i, 0, *masker))).item<double>();
        continue;
      }
      auto batch = to_device(val_sampler->eval_batch(i));
      sum += model->loss(batch.inputs, batch.targets).item<double>();
    }
    module->train();
    return mean_over_ranks(*comm, sum / double(std::max<int64_t>(1, config.train.eval_iters)), "eval.loss");
  };

  // Set-up's peak, kept apart from the steps' (the final memory line reports both).
  PeakRss peak;
  peak.setup = peak_rss_bytes();
  peak.split = reset_peak_rss();
  // The block cache's bound follows the steps from here, not construction's or loading's peak.
  if (CpuBlockCache* cache = installed_cpu_block_cache()) {
    cache->reset_high_water();
    cache->set_slack_fraction(CpuBlockCache::kDefaultSlackFraction);
  }

  const int64_t steps = config.train.steps;
  const double tokens_per_step = double(config.train_batch_size) * double(seq_len);
  std::vector<double> losses;
  std::vector<int> skipped_flags;  // 1 where the step was skipped (inf/NaN gradient)
  std::vector<std::pair<int64_t, double>> eval_losses;
  losses.reserve(steps);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto window_start = start;
  int64_t window_steps = 0;
  double last_rate = 0;
  // wall_clock_breakdown: seconds spent in forward, backward and step since the last print.
  struct {
    double forward = 0, backward = 0, step = 0;
    int64_t steps = 0;
  } breakdown;
  // NVMe tiers: this rank's disk traffic since the last print (docs/offload.md "Reading the figures").
  OffloadReport io_before = engine.offload_report();
  auto io_window_start = clock::now();

  for (int64_t step = first_step; step < steps; ++step) {
    // Dropout masks differ per rank (as with one process per device elsewhere) and depend only on
    // (seed, rank, step), so that a resumed run draws what the uninterrupted one would have.
    torch::manual_seed(config.train.seed + 1000003ull * (rank + 1) + 7919ull * uint64_t(step));
    const auto step_start = clock::now();
    double loss_sum = 0;
    // On a GPU the micro-steps' losses are added on the device (in double, as here) and read once
    // per step, so that the host can queue the next forward while the device still runs.
    torch::Tensor device_loss_sum;
    StepResult result;
    for (int64_t a = 0; a < accum; ++a) {
      const auto t0 = clock::now();
      auto loss = micro_loss(step, a);
      if (device.cuda()) {
        const torch::Tensor value = loss.detach().to(torch::kFloat64);
        device_loss_sum = device_loss_sum.defined() ? device_loss_sum + value : value;
      } else {
        loss_sum += loss.item<double>();
      }
      if (config.wall_clock_breakdown) synchronize(device);  // else the forward's GPU time counts as backward's
      const auto t1 = clock::now();
      engine.backward(loss);
      if (config.wall_clock_breakdown) synchronize(device);
      const auto t2 = clock::now();
      result = engine.step();
      if (config.wall_clock_breakdown) synchronize(device);
      const auto t3 = clock::now();
      breakdown.forward += std::chrono::duration<double>(t1 - t0).count();
      breakdown.backward += std::chrono::duration<double>(t2 - t1).count();
      breakdown.step += std::chrono::duration<double>(t3 - t2).count();
    }
    ++breakdown.steps;
    ZT_CHECK_STATE(result.boundary, "the last micro-step of a window must end it");
    if (device_loss_sum.defined()) loss_sum = device_loss_sum.item<double>();
    synchronize(device);  // the step's device work is part of the step's time
    const double loss = mean_over_ranks(*comm, loss_sum / double(accum), "train.loss");
    // This step's rate on this rank: its micro-steps and the loss's reduction, not the evaluation,
    // checkpoint or printing that may follow.
    const double step_seconds = std::chrono::duration<double>(clock::now() - step_start).count();
    const double step_rate = tokens_per_step / step_seconds;
    if (fp.enabled && !is_bert && step + 1 == fp.profile_step) {
      // Every rank measures its peak at once, as it shares the machine while training; the step
      // counts as long as its slowest rank took.
      std::string how;
      const double peak = mean_over_ranks(*comm, measure_matmul_peak(working_dtype_of(config.precision), 0.2, device.device, how),
                                          "flops.peak");
      auto slowest = torch::full({1}, step_seconds, torch::kFloat64);
      comm->all_reduce(slowest, ReduceOp::Max, "flops.step_time").wait();
      FlopsProfileInputs in;
      in.profile_step = fp.profile_step;
      in.world = world;
      in.micro_batch = micro;
      in.accumulation = accum;
      in.sequence = seq_len;
      in.recompute = model->checkpointing().recompute;
      for (int64_t i = 0; i < gpt_config.n_layer; ++i) in.checkpointed_blocks += model->is_checkpointed(i) ? 1 : 0;
      in.recompute_fwd_factor = fp.recompute_fwd_factor;
      in.step_seconds = slowest.item<double>();
      in.peak_flops = peak;
      in.peak_source = how + (world > 1 ? ", mean over ranks" : "");
      in.module_depth = fp.module_depth;
      in.top_modules = fp.top_modules;
      in.detailed = fp.detailed;
      const FlopsProfile profile = gpt_flops_profile(gpt_config, in);
      if (rank == 0 && (!options.quiet || !fp.output_file.empty()))
        emit_report(profile.text, fp.output_file, "flops_profiler.output_file");
      flops_summary = {{"step", fp.profile_step},
                       {"forward_flops_per_micro_batch", profile.micro_batch.forward},
                       {"recompute_flops_per_micro_batch", profile.micro_batch.recompute},
                       {"model_flops_per_step_per_rank", profile.model_flops},
                       {"executed_flops_per_step_per_rank", profile.executed_flops},
                       {"step_seconds", in.step_seconds},
                       {"achieved_flops_per_second_per_rank", profile.achieved_flops_per_second},
                       {"peak_flops_per_rank", peak},
                       {"peak_source", in.peak_source},
                       {"mfu", profile.mfu},
                       {"hfu", profile.hfu}};
    }
    losses.push_back(loss);
    skipped_flags.push_back(result.skipped ? 1 : 0);
    ++window_steps;
    const bool last = step + 1 == steps;
    const bool print = last || (config.steps_per_print > 0 && (step + 1) % config.steps_per_print == 0);
    const auto now = clock::now();
    const double elapsed = std::chrono::duration<double>(now - start).count();
    if (print) {
      const double window = std::chrono::duration<double>(now - window_start).count();
      last_rate = window > 0 ? tokens_per_step * window_steps / window : 0;
      window_start = now;
      window_steps = 0;
    }
    const bool eval_now = config.train.eval_interval > 0 &&
                          ((step + 1) % config.train.eval_interval == 0 || last);
    // The last step's update is installed before the final evaluation and save (delayed update).
    if (last) engine.apply_pending_update();
    double eval_loss = 0;
    if (eval_now) {
      eval_loss = evaluate();
      eval_losses.emplace_back(step + 1, eval_loss);
    }
    std::vector<RankStats> stats;
    if (print) stats = gather_rank_stats(*comm, engine, baseline_rss, peak);
    // The CSV's peak is every rank's, on every row: one 8-byte all-reduce per step, taken by all
    // ranks alike because the configuration (csv_monitor.enabled) is the same on all of them.
    if (config.csv_monitor.enabled) {
      const int64_t peak_max = max_over_ranks(*comm, peak.run(), "csv.peak_rss");
      if (csv.is_open())
        csv << fmt::format("{},{:.9g},{:.6g},{:.6g},{},{:.1f},{:.3f},{},{:g}\n", step + 1, loss, result.lr,
                           result.grad_norm, result.skipped ? 1 : 0, step_rate, elapsed, peak_max,
                           result.loss_scale);
    }
    if (!options.save_dir.empty() &&
        (last || (options.save_every > 0 && (step + 1) % options.save_every == 0))) {
      const auto save_start = clock::now();
      const std::string tag = fmt::format("step-{}", step + 1);
      engine.save_checkpoint(options.save_dir, tag, {{"seed", std::to_string(config.train.seed)}}, options.keep_last);
      const double seconds = std::chrono::duration<double>(clock::now() - save_start).count();
      if (leader) {
        int64_t bytes = 0;
        for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(options.save_dir) / tag))
          bytes += int64_t(f.file_size());
        fmt::print("saved checkpoint {}/{}: {:.2f} GB in {:.2f} s ({:.2f} GB/s)\n", options.save_dir, tag, bytes / 1e9,
                   seconds, seconds > 0 ? bytes / 1e9 / seconds : 0.0);
      }
    }
    if (print && !leader) breakdown = {};
    if (leader && print) {
      std::string peaks;
      for (auto& s : stats) peaks += fmt::format("{}{:.0f}", peaks.empty() ? "" : "/", s.peak_rss / 1048576.0);
      const double eta = elapsed / double(step + 1 - first_step) * double(steps - step - 1);
      std::string times;
      if (config.wall_clock_breakdown && breakdown.steps > 0)
        times = fmt::format(" | ms/step fwd {:.0f} bwd {:.0f} step {:.0f}", 1e3 * breakdown.forward / breakdown.steps,
                            1e3 * breakdown.backward / breakdown.steps, 1e3 * breakdown.step / breakdown.steps);
      std::string scaling;
      if (config.precision == Precision::FP16) scaling = fmt::format(" | loss scale {:g}", engine.loss_scale());
      if (engine.skipped_steps() > 0) scaling += fmt::format(" | skipped {}", engine.skipped_steps());
      const OffloadReport io_now = engine.offload_report();
      if (!io_now.backend.empty()) {
        const double window = std::chrono::duration<double>(clock::now() - io_window_start).count();
        const double read = double(io_now.bytes_read - io_before.bytes_read) / 1e9;
        const double written = double(io_now.bytes_written - io_before.bytes_written) / 1e9;
        const double stall = io_now.stall_seconds - io_before.stall_seconds;
        scaling += fmt::format(" | nvme read {:.2f} GB/s write {:.2f} GB/s, waited {:.0f}%",
                               io_now.read_seconds > io_before.read_seconds ? read / (io_now.read_seconds - io_before.read_seconds) : 0.0,
                               io_now.write_seconds > io_before.write_seconds ? written / (io_now.write_seconds - io_before.write_seconds) : 0.0,
                               window > 0 ? 100.0 * stall / window : 0.0);
        io_before = io_now;
        io_window_start = clock::now();
      }
      if (device.cuda()) scaling = fmt::format(" | GPU peak {:.0f} MiB", device_peak(device).allocated / 1048576.0) + scaling;
      fmt::print("step {:>{}}/{} | loss {:.4f} | lr {:.3e} | {} tok/s | left {} | peak RSS {} MiB{}{}{}\n", step + 1,
                 std::to_string(steps).size(), steps, loss, result.lr, human_rate(last_rate), human_duration(eta),
                 peaks, scaling, times, eval_now ? fmt::format(" | held-out loss {:.4f}", eval_loss) : "");
      std::fflush(stdout);
      breakdown = {};
    }
  }
  const double total_seconds = std::chrono::duration<double>(clock::now() - start).count();
  auto stats = gather_rank_stats(*comm, engine, baseline_rss, peak);
  // The estimate `zerotrain estimate` prints for this run, beside what the ranks measured.
  ClusterSpec cluster;
  cluster.device = DeviceKind::Cpu;
  cluster.devices_per_node = rendezvous.local_world_size;
  cluster.nodes = world / std::max(1, rendezvous.local_world_size);
  if (device.cuda()) {
    cluster.device = DeviceKind::Cuda;
    cluster.device_memory = device.total_memory;
    cluster.host_memory = physical_memory_bytes();
  }
  // The estimate models the GPT (gpt_model_figures): a BERT run reports what it measured only.
  const MemoryEstimate estimate =
      is_bert ? MemoryEstimate{}
              : estimate_memory(gpt_model_figures(gpt_config, seq_len, config.zero.stage3_param_persistence_threshold),
                                cluster, config);
  int64_t measured_peak = 0;  // the largest peak RSS above the pre-model baseline over ranks
  for (const auto& s : stats) measured_peak = std::max(measured_peak, s.peak_rss - s.baseline_rss);
  // The two moments apart (zerotrain/estimate.h: construction and step), largest over ranks; -1
  // where the kernel's peak could not be restarted after set-up.
  int64_t measured_setup = -1, measured_steps = -1;
  for (const auto& s : stats) {
    if (s.setup_peak_rss >= 0) measured_setup = std::max(measured_setup, s.setup_peak_rss - s.baseline_rss);
    if (s.steps_peak_rss >= 0) measured_steps = std::max(measured_steps, s.steps_peak_rss - s.baseline_rss);
  }
  const std::string moments =
      measured_setup >= 0 && measured_steps >= 0
          ? fmt::format("; set-up measured {} (estimated {}), the steps {} (estimated {})", human_bytes(measured_setup),
                        human_bytes(estimate.construction_peak), human_bytes(measured_steps),
                        human_bytes(estimate.step_peak))
          : "";
  const bool heap_retained = runtime.heap_policy == HeapPolicy::RetainedHeap;
  // On a GPU the estimate's per-device figure is the GPU's: set beside the caching allocator's
  // peaks (largest over ranks), and the host's beside the peak RSS.
  DevicePeak gpu_peak;
  if (device.cuda()) {
    const DevicePeak mine = device_peak(device);
    gpu_peak.allocated = max_over_ranks(*comm, mine.allocated, "device.peak_allocated");
    gpu_peak.reserved = max_over_ranks(*comm, mine.reserved, "device.peak_reserved");
  }
  if (leader && is_bert && device.cuda())
    fmt::print("memory per rank: measured {} allocated / {} reserved of {} ({}); peak RSS {} above the pre-model "
               "baseline (no estimate: the memory estimate models the GPT)\n",
               human_bytes(gpu_peak.allocated), human_bytes(gpu_peak.reserved), human_bytes(device.total_memory),
               device.name, human_bytes(measured_peak));
  else if (leader && is_bert)
    fmt::print("memory per rank: measured {} above the pre-model baseline (no estimate: the memory estimate models "
               "the GPT)\n",
               human_bytes(measured_peak));
  else if (leader && device.cuda())
    fmt::print("memory per rank: GPU estimated peak {}, measured {} allocated / {} reserved of {} ({}); host "
               "estimated {} per node, peak RSS {} above the pre-model baseline\n",
               human_bytes(estimate.per_device.total()), human_bytes(gpu_peak.allocated),
               human_bytes(gpu_peak.reserved), human_bytes(device.total_memory), device.name,
               human_bytes(estimate.per_host.total()), human_bytes(measured_peak));
  else if (leader)
    fmt::print("memory per rank: estimated peak {}, measured {} above the pre-model baseline ({:+.1f}%){}{}\n",
               human_bytes(estimate.per_device.total()), human_bytes(measured_peak),
               measured_peak > 0 ? 100.0 * double(estimate.per_device.total() - measured_peak) / double(measured_peak) : 0.0,
               moments,
               heap_retained ? "; the heap is retained (train.retain_freed_memory), which adds fragmentation the "
                               "estimate leaves out (docs/memory.md)"
                             : "");

  if (const CpuBlockCache* cache = installed_cpu_block_cache(); leader && cache != nullptr) {
    const CpuBlockCacheStats c = cache->stats();
    if (c.large_allocations > 0)
      fmt::print("tensor block cache (rank 0): {} of {} large allocations served from freed blocks ({:.1f}%; {} "
                 "resized), {} mapped in all, {} cached blocks unmapped to stay near the steps' live peak of {}\n",
                 c.reused + c.resized, c.large_allocations,
                 100.0 * double(c.reused + c.resized) / double(c.large_allocations), c.resized,
                 human_bytes(int64_t(c.mapped_bytes)), c.unmapped, human_bytes(c.high_water_bytes));
  }

  const OffloadReport offload = engine.offload_report();
  if (leader && !offload.backend.empty())
    fmt::print("offload (rank 0): nvme {} optimizer state + {} parameters{}, host buffers {}; read {:.2f} GB "
               "({:.2f} GB/s), wrote {:.2f} GB ({:.2f} GB/s) with {}; the training thread waited {:.1f} s of {:.1f} s "
               "for the disk\n",
               human_bytes(offload.nvme_optimizer_bytes), human_bytes(offload.nvme_parameter_bytes),
               offload.nvme_gradient_bytes > 0 ? " + " + human_bytes(offload.nvme_gradient_bytes) + " gradients" : "",
               human_bytes(offload.host_buffer_bytes), offload.bytes_read / 1e9,
               offload.read_seconds > 0 ? offload.bytes_read / 1e9 / offload.read_seconds : 0.0,
               offload.bytes_written / 1e9,
               offload.write_seconds > 0 ? offload.bytes_written / 1e9 / offload.write_seconds : 0.0, offload.backend,
               offload.stall_seconds, total_seconds);

  if (rank == 0 && !options.summary_path.empty()) {
    nlohmann::json summary;
    summary["offload"] = {{"backend", offload.backend},
                          {"nvme_optimizer_bytes", offload.nvme_optimizer_bytes},
                          {"nvme_parameter_bytes", offload.nvme_parameter_bytes},
                          {"nvme_gradient_bytes", offload.nvme_gradient_bytes},
                          {"nvme_load_staging_bytes", offload.nvme_load_staging_bytes},
                          {"host_buffer_bytes", offload.host_buffer_bytes},
                          {"bytes_read", offload.bytes_read},
                          {"bytes_written", offload.bytes_written},
                          {"read_seconds", offload.read_seconds},
                          {"write_seconds", offload.write_seconds},
                          {"stall_seconds", offload.stall_seconds}};
    {
      nlohmann::json ac = {{"policy", config.activation_checkpointing.policy}};
      nlohmann::json blocks = nlohmann::json::array();
      const auto timings = is_bert ? bert->checkpoint_timings() : model->checkpoint_timings();
      for (size_t i = 0; i < timings.size(); ++i)
        blocks.push_back({{"block", i},
                          {"checkpointed", is_checkpointed(int64_t(i))},
                          {"forward_calls", timings[i].forward_calls},
                          {"recomputations", timings[i].recomputations},
                          {"forward_seconds", timings[i].forward_seconds},
                          {"recompute_seconds", timings[i].recompute_seconds}});
      if (!timings.empty()) ac["blocks"] = blocks;
      if (auto arena = is_bert ? std::nullopt : model->checkpoint_arena_stats())
        ac["contiguous_buffer"] = {{"slots", arena->slots},
                                   {"slot_bytes", arena->slot_bytes},
                                   {"buffer_allocations", arena->buffer_allocations},
                                   {"stores", arena->stores},
                                   {"overflows", arena->overflows}};
      summary["activation_checkpointing"] = ac;
    }
    summary["world_size"] = world;
    if (!init_from_summary.is_null()) summary["init_from"] = init_from_summary;
    summary["steps"] = steps;
    summary["first_step"] = first_step;  // losses[i] is the loss of step first_step + i + 1
    summary["losses"] = losses;
    summary["final_loss"] = losses.empty() ? 0.0 : losses.back();
    summary["skipped_steps"] = engine.skipped_steps();
    summary["tokens_per_second"] =
        total_seconds > 0 ? tokens_per_step * double(steps - first_step) / total_seconds : 0.0;
    summary["seconds"] = total_seconds;
    summary["parameters"] = n_params;
    summary["intra_op_threads"] = runtime.intra_op_threads;
    nlohmann::json evals = nlohmann::json::array();
    for (auto& [s, l] : eval_losses) evals.push_back({{"step", s}, {"loss", l}});
    summary["eval_losses"] = evals;
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < world; ++r)
      ranks.push_back({{"rank", r},
                       {"peak_rss_bytes", stats[r].peak_rss},
                       {"setup_peak_rss_bytes", stats[r].setup_peak_rss},
                       {"steps_peak_rss_bytes", stats[r].steps_peak_rss},
                       {"baseline_rss_bytes", stats[r].baseline_rss},
                       {"model_state_bytes",
                        {{"parameters", stats[r].state.parameters},
                         {"gradients", stats[r].state.gradients},
                         {"optimizer_states", stats[r].state.optimizer_states},
                         {"total", stats[r].state.total()}}},
                       {"buffer_bytes", stats[r].buffers}});
    summary["ranks"] = ranks;
    // What this configuration should hold per rank by the formula, without padding
    // (docs/design.md "Memory per parameter").
    const ModelStateBytes formula = model_state_formula(engine.trainable_parameters(), world, config);
    summary["trainable_parameters"] = engine.trainable_parameters();
    summary["model_state_formula_bytes"] = {{"parameters", formula.parameters},
                                            {"gradients", formula.gradients},
                                            {"optimizer_states", formula.optimizer_states},
                                            {"total", formula.total()}};
    summary["zero"] = {{"stage", config.zero.stage},
                       {"shard_optimizer_states", config.zero.shard_optimizer_states},
                       {"shard_gradients", config.zero.shard_gradients},
                       {"shard_parameters", config.zero.shard_parameters},
                       {"hpz_partition_size", std::max(1, config.zero.hpz_partition_size)},
                       {"block_gathers_rank0", engine.block_gathers()},
                       {"secondary_block_gathers_rank0", engine.secondary_block_gathers()}};
    // Rank 0's node groups: its node's ranks, and the nodes (one rank 0 of a node each).
    summary["nodes"] = {{"count", engine.node_groups().across_nodes->world_size()},
                        {"ranks_per_node", engine.node_groups().within_node->world_size()}};
    summary["precision"] = to_string(config.precision);
    summary["precision_configured"] = to_string(configured_precision);
    summary["memory"] = {{"measured_peak_above_baseline_bytes", measured_peak},
                         {"measured_setup_peak_above_baseline_bytes", measured_setup},
                         {"measured_steps_peak_above_baseline_bytes", measured_steps},
                         {"heap_retained", heap_retained},
                         {"heap_policy", config.train.retain_freed_memory}};
    if (const CpuBlockCache* cache = installed_cpu_block_cache()) {
      const CpuBlockCacheStats c = cache->stats();
      summary["memory"]["block_cache_rank0"] = {{"large_allocations", c.large_allocations},
                                                {"reused", c.reused},
                                                {"resized", c.resized},
                                                {"mapped_bytes", c.mapped_bytes},
                                                {"unmapped", c.unmapped},
                                                {"high_water_bytes", c.high_water_bytes}};
    }
    if (!is_bert) summary["memory"]["estimate"] = estimate_to_json(estimate);
    summary["model"] = {{"type", config.model.type}, {"preset", config.model.preset}};
    if (device.cuda())
      summary["device"] = {{"type", "cuda"},
                           {"name", device.name},
                           {"index", device.device.index()},
                           {"total_memory_bytes", device.total_memory},
                           {"peak_allocated_bytes", gpu_peak.allocated},
                           {"peak_reserved_bytes", gpu_peak.reserved}};
    else
      summary["device"] = {{"type", "cpu"}};
    summary["loss_scale"] = engine.loss_scale();
    if (!flops_summary.is_null()) summary["flops_profiler"] = flops_summary;
    if (comms_logger) {
      // Rank 0's collectives up to here (the final barrier comes after).
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& row : comms_logger->rows())
        rows.push_back({{"op", row.op},
                        {"caller", row.caller},
                        {"message_bytes", row.message_bytes},
                        {"count", row.count},
                        {"total_latency_ms", row.total_ms},
                        {"avg_latency_ms", row.avg_ms},
                        {"algbw_gbps", row.algbw_gbps},
                        {"busbw_gbps", row.busbw_gbps}});
      summary["comms_logger"] = rows;
    }
    summary["skipped"] = skipped_flags;
    auto path = std::filesystem::path(options.summary_path);
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
    auto tmp = path;
    tmp += ".tmp";
    {
      std::ofstream out(tmp);
      if (!out) throw DataError(fmt::format("--summary: cannot write '{}'", options.summary_path));
      out << summary.dump(2) << "\n";
    }
    std::filesystem::rename(tmp, path);  // never leave a half-written summary behind
  }
  comm->barrier("train.end");
  if (comms_logger) {
    // Each rank's own figures beside the run's log; rank 0's as DeepSpeed's log_summary table.
    const auto dir = std::filesystem::path(config.train.log_dir);
    std::filesystem::create_directories(dir);
    const auto path = dir / fmt::format("comms_rank{}.csv", rank);
    std::ofstream out(path, std::ios::trunc);
    if (!out) throw DataError(fmt::format("comms_logger: cannot write '{}' (train.log_dir)", path.string()));
    out << comms_logger->csv();
    if (leader)
      fmt::print("communication (rank 0, {} collectives; every rank's in {}/comms_rank<r>.csv):\n{}",
                 comms_logger->total_count(), dir.string(), comms_logger->table());
  }
  return 0;
}

}  // namespace zt
