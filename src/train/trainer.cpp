#include "zerotrain/train/train.h"

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
#include "memory/cpu_block_cache.h"
#include "memory/estimate_report.h"
#include "train/runtime.h"
#include "train/training_run.h"
#include "zero/step_monitor.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/data/data.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/optim/lr_schedule.h"
#include "zerotrain/memory/estimate.h"
#include "zerotrain/data/bert_data.h"
#include "zerotrain/config/gpt_flops.h"
#include "zerotrain/data/tokenized_data.h"
#include "zerotrain/data/tokenizer.h"

namespace zt {
namespace training {
namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("data.path: cannot open text file '{}'", path));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Fine-tuning examples, tokenized once into their cache (by the launcher's check), then mapped: a
// rank reads the index and the examples it samples, never the jsonl.
Splits load_finetune_data(const TrainConfig& config, int64_t vocab_size, bool progress) {
  const auto& d = config.data;
  TokenizeOptions options;
  options.cache_dir = d.cache_dir;
  options.eos_token = d.eos_token;
  options.progress = progress;
  const FinetuneExamples examples = load_finetune_cache(d.path, d.tokenizer, d.chat_template, options).examples;
  if (vocab_size > 0) examples.validate(vocab_size);
  auto [train, val] = examples.split(d.val_fraction);
  Splits s;
  s.finetune_train = std::make_shared<const FinetuneExamples>(std::move(train));
  s.finetune_val = std::make_shared<const FinetuneExamples>(std::move(val));
  s.bytes = examples.setup_bytes();
  return s;
}

}  // namespace

int64_t file_bytes(const std::string& path) {
  std::error_code error;
  const auto size = std::filesystem::file_size(path, error);
  return error ? 0 : int64_t(size);
}

Splits load_data(const TrainConfig& config, int64_t vocab_size, bool progress) {
  const auto& d = config.data;
  if (d.source == "finetune") return load_finetune_data(config, vocab_size, progress);
  ByteTokenizer tokenizer;
  std::optional<TokenDataset> all;
  // What the data holds from here on: a token file is mapped and validate() reads all of it; bytes
  // become uint16 ids in memory (beside the embedded corpus's text, which stays).
  int64_t bytes = 0;
  if (!d.tokenizer.empty()) {
    TokenizeOptions options;
    options.cache_dir = d.cache_dir;
    options.eos_token = d.eos_token;
    options.progress = progress;
    const TokenizedCorpus corpus = load_tokenized_corpus(
        d.path, d.source == "jsonl" ? CorpusFormat::Jsonl : CorpusFormat::Text, d.tokenizer, options);
    all = corpus.tokens;
    bytes = file_bytes(corpus.cache_file.string());
  } else if (d.source == "embedded") {
    all = TokenDataset::from_text(embedded_corpus(), tokenizer);
    bytes = 3 * int64_t(embedded_corpus().size());
  } else if (d.source == "text") {
    all = TokenDataset::from_text(read_text_file(d.path), tokenizer);
    bytes = 2 * all->size();
  } else if (d.source == "bin") {
    auto train = TokenDataset::from_bin_file(d.path);
    if (!d.val_path.empty()) {
      Splits s{std::move(train), TokenDataset::from_bin_file(d.val_path), nullptr, nullptr};
      if (vocab_size > 0) s.train.validate(vocab_size);
      if (vocab_size > 0) s.val.validate(vocab_size);
      s.bytes = file_bytes(d.path) + file_bytes(d.val_path);
      return s;
    }
    all = std::move(train);
    bytes = file_bytes(d.path);
  } else {
    throw ConfigError(fmt::format(
        "data.source: expected \"embedded\", \"text\", \"jsonl\", \"finetune\" or \"bin\", found \"{}\"", d.source));
  }
  if (vocab_size > 0) all->validate(vocab_size);
  auto [train, val] = all->split(d.val_fraction);
  Splits s{std::move(train), std::move(val), nullptr, nullptr};
  s.bytes = bytes;
  return s;
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

// data.sequence_length (0: the model's context) against the model's context; the length used.
int64_t check_sequence_length(int64_t configured, int64_t context) {
  const int64_t seq_len = configured > 0 ? configured : context;
  if (seq_len > context)
    throw ConfigError(fmt::format("data.sequence_length: expected at most the model's context length {}, found {}",
                                  context, seq_len));
  return seq_len;
}

}  // namespace training

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
      throw DataError(fmt::format("{}: expected a non-empty file of uint16 or uint32 tokens (even byte count), found {} "
                                  "bytes in '{}'",
                                  key, size, path));
  };
  if (d.source == "bin") {
    check_file("data.path", d.path, true);
    if (!d.val_path.empty()) check_file("data.val_path", d.val_path, true);
  } else if (d.source != "embedded") {
    check_file("data.path", d.path, false);
  }
  // What every rank would refuse as it starts is refused once, before any starts: the model's
  // shape (a preset, the head count dividing the width), the sequence against the context, and
  // the schedule's parameters.
  const std::unique_ptr<ModelKind> kind = make_model_kind(config);  // a Llama directory's config.json read
  const int64_t context = kind->context_length();
  training::check_sequence_length(config.data.sequence_length, context);
  // The data itself: a tokenizer of a kind not implemented, a line that is not an example, a token
  // id past the model's vocabulary (the BERT's: its content vocabulary, in uint16 ids). Tokenizing
  // here also builds the token cache once, before the ranks read it.
  if (config.data.source != "embedded") {
    const bool sentence_pairs = kind->data_kind() == DataKind::SentencePairs;
    const training::Splits splits = training::load_data(config, kind->data_vocabulary(), /*progress=*/true);
    if (sentence_pairs) {  // a uint32 file is refused here, naming it
      splits.train.data16();
      splits.val.data16();
    }
    if (splits.finetune()) {
      const int64_t seq = config.data.sequence_length > 0 ? config.data.sequence_length : context;
      // Every example has a trained token in reach; the held-out ones exist when the run evaluates.
      FinetuneSampler(*splits.finetune_train, seq, 1, 1, 0, 0);
      if (config.train.eval_interval > 0) FinetuneSampler(*splits.finetune_val, seq, 1, 1, 0, 0);
    }
  }
  LrSchedule(config.scheduler, config.optimizer.lr);
  // A directory of another shape, or not a GPT-2 (Llama) directory, or a missing or mis-shaped
  // tensor, fails before any rank starts.
  if (!config.model.init_from.empty()) kind->hf_reader(config.model.init_from);
}

int64_t training_data_bytes(const TrainConfig& config) {
  const auto& d = config.data;
  if (!make_model_kind(config)->estimate_gap().empty()) return 0;  // the estimate does not model the model
  // What load_data counts, without reading the bytes where their size says it.
  if (d.tokenizer.empty() && d.source == "text") return 2 * training::file_bytes(d.path);
  if (d.source == "bin") return training::file_bytes(d.path) + (d.val_path.empty() ? 0 : training::file_bytes(d.val_path));
  return training::load_data(config, /*vocab_size=*/0).bytes;
}

int run_training_rank(const TrainConfig& config, const TrainRunOptions& options) {
  using namespace training;
  std::unique_ptr<TrainingRun> run = set_up_run(config, options);
  const StepLog log = run_steps(*run, options);
  report_run(*run, options, log);
  return 0;
}

}  // namespace zt
