// The training run's step loop (train/training_run.h): batches, micro-steps, evaluation, the
// flops profile, checkpoints and the progress line with its CSV row.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include "checkpoint/hf.h"
#include "common/check.h"
#include "memory/cpu_block_cache.h"
#include "train/training_run.h"
#include "zero/step_monitor.h"
#include "zerotrain/error.h"
#include "zerotrain/models/model_kind.h"
#include "zerotrain/config/gpt_flops.h"
#include "zerotrain/models/tensor_parallel.h"

namespace zt::training {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// This rank's batches: the GPT's token windows or BERT's masked sentence pairs, built on a prefetch
// thread beside the step on the batch before (on a GPU they otherwise leave it idle, and pinned
// so that the copy to the device runs asynchronously). A batch is a function of (seed, step,
// micro-step), so resuming needs only the step.
class BatchSource {
 public:
  explicit BatchSource(TrainingRun& run)
      : run_(run), sentence_pairs_(run.kind->data_kind() == DataKind::SentencePairs) {
    const TrainConfig& config = run.config;
    const int64_t micro = config.train_micro_batch_size_per_gpu, accum = config.gradient_accumulation_steps;
    const uint64_t seed = config.train.seed;
    if (sentence_pairs_) {
      set_up_bert(micro, accum, seed);
      return;
    }
    const bool finetune = run.data.finetune();
    if (finetune) {
      // Fine-tuning examples: targets -100 outside the responses. The held-out examples are
      // sampled only when the run evaluates (the split may hold none otherwise).
      // data.pack: several examples per row, for training only (evaluation keeps one per row).
      train_examples_.emplace(*run.data.finetune_train, run.seq_len, micro, run.data_world, run.data_rank, seed,
                              config.data.pack);
      if (config.train.eval_interval > 0)
        val_examples_.emplace(*run.data.finetune_val, run.seq_len, micro, run.data_world, run.data_rank, seed ^ 0x5eedULL);
    } else {
      train_sampler_.emplace(run.data.train, run.seq_len, micro, run.data_world, run.data_rank, seed);
      val_sampler_.emplace(run.data.val, run.seq_len, micro, run.data_world, run.data_rank, seed ^ 0x5eedULL);
    }
    prefetcher_.emplace(
        [this, accum, finetune](int64_t i) {
          Batch batch = finetune ? train_examples_->batch(i / accum, i % accum)
                                 : train_sampler_->batch(i / accum, i % accum);
          if (run_.device.cuda()) {
            batch.inputs = batch.inputs.pin_memory();
            batch.targets = batch.targets.pin_memory();
            if (batch.segments.defined()) batch.segments = batch.segments.pin_memory();
          }
          return batch;
        },
        run.first_step * accum);
  }

  // The loss of this rank's next micro-batch.
  torch::Tensor next_loss() {
    if (sentence_pairs_) return run_.trainable->loss(to_device(bert_prefetcher_->next()));
    // segments: packed rows only
    return run_.trainable->loss(to_device(prefetcher_->next()));
  }

  // The mean held-out loss over train.eval_iters batches and all ranks (a collective).
  double evaluate() {
    torch::NoGradGuard no_grad;
    const TrainConfig& config = run_.config;
    double sum = 0;
    run_.module->eval();
    for (int64_t i = 0; i < config.train.eval_iters; ++i) {
      if (sentence_pairs_) {
        sum += run_.trainable->loss(to_device(val_pairs_->batch(i, 0, *masker_))).item<double>();
        continue;
      }
      auto batch = to_device(val_examples_ ? val_examples_->eval_batch(i) : val_sampler_->eval_batch(i));
      sum += run_.trainable->loss(batch).item<double>();
    }
    run_.module->train();
    return mean_over_ranks(*run_.comm, sum / double(std::max<int64_t>(1, config.train.eval_iters)), "eval.loss");
  }

 private:
  // BERT: sentence pairs of seq_len tokens masked as BERT's pre-training data. The held-out pairs
  // are drawn only when the run evaluates (the split may be too short otherwise).
  void set_up_bert(int64_t micro, int64_t accum, uint64_t seed) {
    const TrainConfig& config = run_.config;
    SentencePairOptions pair_options;
    pair_options.max_length = run_.seq_len;
    pair_options.specials = run_.kind->sentence_pair_specials();
    // A .bin file's ids are another tokenizer's: the byte values of '.', '!', '?' and newline
    // mean nothing there, so its segments are cut at lengths only.
    if (config.data.source == "bin") {
      pair_options.sentence_ends.clear();
      pair_options.leading_skip.clear();
    }
    MlmOptions mlm_options;
    mlm_options.probability = config.data.mlm_probability;
    mlm_options.max_predictions = config.data.max_predictions;
    masker_.emplace(mlm_options, run_.kind->sentence_pair_specials(), seed);
    train_pairs_.emplace(run_.data.train, pair_options, micro, run_.data_world, run_.data_rank, seed);
    if (config.train.eval_interval > 0)
      val_pairs_.emplace(run_.data.val, pair_options, micro, run_.data_world, run_.data_rank, seed ^ 0x5eedULL);
    // The sampler and the masker are immutable: the prefetch thread may use them.
    bert_prefetcher_.emplace(
        [this, accum](int64_t i) {
          BertBatch batch = train_pairs_->batch(i / accum, i % accum, *masker_);
          if (run_.device.cuda())
            for (at::Tensor* t : {&batch.input_ids, &batch.token_type_ids, &batch.attention_mask,
                                  &batch.masked_positions, &batch.masked_labels, &batch.nsp_labels})
              if (t->defined()) *t = t->pin_memory();
          return batch;
        },
        run_.first_step * accum);
  }

  Batch to_device(Batch batch) const {
    if (run_.device.cuda()) {
      batch.inputs = batch.inputs.to(run_.device.device, /*non_blocking=*/true);
      batch.targets = batch.targets.to(run_.device.device, /*non_blocking=*/true);
      if (batch.segments.defined()) batch.segments = batch.segments.to(run_.device.device, /*non_blocking=*/true);
    }
    return batch;
  }
  BertBatch to_device(BertBatch batch) const {
    if (run_.device.cuda())
      for (at::Tensor* t : {&batch.input_ids, &batch.token_type_ids, &batch.attention_mask, &batch.masked_positions,
                            &batch.masked_labels, &batch.nsp_labels})
        if (t->defined()) *t = t->to(run_.device.device, /*non_blocking=*/t->is_pinned());
    return batch;
  }

  TrainingRun& run_;
  std::optional<DistributedSampler> train_sampler_, val_sampler_;
  std::optional<FinetuneSampler> train_examples_, val_examples_;
  std::optional<BatchPrefetcher> prefetcher_;
  const bool sentence_pairs_;  // BERT's masked sentence pairs, not token windows
  std::optional<SentencePairSampler> train_pairs_, val_pairs_;
  std::optional<MlmMasker> masker_;
  std::optional<Prefetcher<BertBatch>> bert_prefetcher_;
};

// csv_monitor: rank 0's per-step log (docs/memory.md "The per-step log"); every row holds its own
// step's figures: tokens/s of this step alone, and the largest peak RSS over all ranks so far.
class CsvLog {
 public:
  explicit CsvLog(const TrainingRun& run) : enabled_(run.config.csv_monitor.enabled) {
    const TrainConfig& config = run.config;
    if (run.rank != 0 || !enabled_) return;
    auto dir = std::filesystem::path(config.csv_monitor.output_path.empty() ? config.train.log_dir
                                                                            : config.csv_monitor.output_path);
    std::filesystem::create_directories(dir);
    auto path = dir / (config.csv_monitor.job_name + ".csv");
    // A resumed run continues the log of the run it resumes.
    const bool append = run.first_step > 0 && std::filesystem::exists(path);
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw DataError(fmt::format("csv_monitor.output_path: cannot write '{}'", path.string()));
    if (!append) out_ << "step,loss,lr,grad_norm,skipped,tokens_per_second,elapsed_seconds,peak_rss_bytes_max,loss_scale\n";
  }

  // A collective when the log is enabled: the peak is every rank's, on every row (one 8-byte
  // all-reduce per step, taken by all ranks alike since the configuration is the same on all).
  void row(const TrainingRun& run, int64_t step, double loss, const StepResult& result, double rate, double elapsed,
           const PeakRss& peak) {
    if (!enabled_) return;
    const int64_t peak_max = max_over_ranks(*run.comm, peak.run(), "csv.peak_rss");
    if (out_.is_open())
      out_ << fmt::format("{},{:.9g},{:.6g},{:.6g},{},{:.1f},{:.3f},{},{:g}\n", step + 1, loss, result.lr,
                          result.grad_norm, result.skipped ? 1 : 0, rate, elapsed, peak_max, result.loss_scale);
  }

 private:
  bool enabled_;
  std::ofstream out_;
};

// flops_profiler at its step: the GPT's analytic FLOPs against the step's time and a measured
// matrix-product peak (every rank measures at once, as it shares the machine while training; the
// step counts as long as its slowest rank took).
nlohmann::json profile_flops(const TrainingRun& run, const TrainRunOptions& options, double step_seconds) {
  const TrainConfig& config = run.config;
  const FlopsProfilerConfig& fp = config.flops_profiler;
  std::string how;
  const double peak = mean_over_ranks(
      *run.comm, measure_matmul_peak(working_dtype_of(config.precision), 0.2, run.device.device, how), "flops.peak");
  auto slowest = torch::full({1}, step_seconds, torch::kFloat64);
  run.comm->all_reduce(slowest, ReduceOp::Max, "flops.step_time").wait();
  FlopsProfileInputs in;
  in.profile_step = fp.profile_step;
  in.world = run.world;
  in.micro_batch = config.train_micro_batch_size_per_gpu;
  in.accumulation = config.gradient_accumulation_steps;
  in.sequence = run.seq_len;
  in.recompute_fwd_factor = fp.recompute_fwd_factor;
  in.step_seconds = slowest.item<double>();
  in.peak_flops = peak;
  in.peak_source = how + (run.world > 1 ? ", mean over ranks" : "");
  in.module_depth = fp.module_depth;
  in.top_modules = fp.top_modules;
  in.detailed = fp.detailed;
  const FlopsProfile profile = run.trainable->flops_profile(in).value();
  if (run.rank == 0 && (!options.quiet || !fp.output_file.empty()))
    emit_report(profile.text, fp.output_file, "flops_profiler.output_file");
  return {{"step", fp.profile_step},
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

// Checkpoints every options.save_every steps and at the last.
void save_if_due(const TrainingRun& run, const TrainRunOptions& options, int64_t step, bool last) {
  if (options.save_dir.empty() || !(last || (options.save_every > 0 && (step + 1) % options.save_every == 0))) return;
  const auto save_start = Clock::now();
  const std::string tag = fmt::format("step-{}", step + 1);
  std::map<std::string, std::string> client = {{"seed", std::to_string(run.config.train.seed)}};
  if (const std::string carried = run.kind->carried_hf_config(); !carried.empty()) client[kCarriedHfConfigKey] = carried;
  run.engine->save_checkpoint(options.save_dir, tag, client, options.keep_last);
  const double seconds = seconds_since(save_start);
  if (!run.leader) return;
  int64_t bytes = 0;
  for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(options.save_dir) / tag))
    bytes += int64_t(f.file_size());
  fmt::print("saved checkpoint {}/{}: {:.2f} GB in {:.2f} s ({:.2f} GB/s)\n", options.save_dir, tag, bytes / 1e9,
             seconds, seconds > 0 ? bytes / 1e9 / seconds : 0.0);
}

// The progress line's figures kept between its prints.
struct ProgressWindow {
  Clock::time_point start;
  int64_t steps = 0;
  double rate = 0;  // tokens/s over the last window
  // wall_clock_breakdown: seconds in forward, backward and step since the last print.
  double forward = 0, backward = 0, step = 0;
  int64_t optimizer_steps = 0;
  // NVMe tiers: this rank's disk traffic since the last print (docs/offload.md "Reading the figures").
  OffloadReport io_before;
  Clock::time_point io_start;
};

// The NVMe tiers' rates since the last print, and the share of it the training thread waited.
std::string nvme_rates(const TrainingRun& run, ProgressWindow& w) {
  const OffloadReport io_now = run.engine->offload_report();
  if (io_now.backend.empty()) return "";
  const OffloadReport& before = w.io_before;
  const double window = seconds_since(w.io_start);
  const double read = double(io_now.bytes_read - before.bytes_read) / 1e9;
  const double written = double(io_now.bytes_written - before.bytes_written) / 1e9;
  const double stall = io_now.stall_seconds - before.stall_seconds;
  std::string text = fmt::format(
      " | nvme read {:.2f} GB/s write {:.2f} GB/s, waited {:.0f}%",
      io_now.read_seconds > before.read_seconds ? read / (io_now.read_seconds - before.read_seconds) : 0.0,
      io_now.write_seconds > before.write_seconds ? written / (io_now.write_seconds - before.write_seconds) : 0.0,
      window > 0 ? 100.0 * stall / window : 0.0);
  w.io_before = io_now;
  w.io_start = Clock::now();
  return text;
}

// Rank 0's line every steps_per_print steps and at the last.
void print_progress(const TrainingRun& run, ProgressWindow& w, const std::vector<RankStats>& stats, int64_t step,
                    double loss, const StepResult& result, double elapsed, std::optional<double> eval_loss) {
  const TrainConfig& config = run.config;
  const int64_t steps = config.train.steps;
  std::string peaks;
  for (auto& s : stats) peaks += fmt::format("{}{:.0f}", peaks.empty() ? "" : "/", s.peak_rss / 1048576.0);
  const double eta = elapsed / double(step + 1 - run.first_step) * double(steps - step - 1);
  std::string times;
  if (config.wall_clock_breakdown && w.optimizer_steps > 0)
    times = fmt::format(" | ms/step fwd {:.0f} bwd {:.0f} step {:.0f}", 1e3 * w.forward / w.optimizer_steps,
                        1e3 * w.backward / w.optimizer_steps, 1e3 * w.step / w.optimizer_steps);
  std::string scaling;
  if (config.precision == Precision::FP16) scaling = fmt::format(" | loss scale {:g}", run.engine->loss_scale());
  if (run.engine->skipped_steps() > 0) scaling += fmt::format(" | skipped {}", run.engine->skipped_steps());
  scaling += nvme_rates(run, w);
  if (run.device.cuda())
    scaling = fmt::format(" | GPU peak {:.0f} MiB", device_peak(run.device).allocated / 1048576.0) + scaling;
  fmt::print("step {:>{}}/{} | loss {:.4f} | lr {:.3e} | {} tok/s | left {} | peak RSS {} MiB{}{}{}\n", step + 1,
             std::to_string(steps).size(), steps, loss, result.lr, human_rate(w.rate), human_duration(eta), peaks,
             scaling, times, eval_loss ? fmt::format(" | held-out loss {:.4f}", *eval_loss) : "");
  std::fflush(stdout);
}

// One optimizer step's micro-steps; the mean loss of this rank's micro-batches.
double run_micro_steps(TrainingRun& run, BatchSource& batches, ProgressWindow& w, StepResult& result) {
  const int64_t accum = run.config.gradient_accumulation_steps;
  const bool timed = run.config.wall_clock_breakdown;
  double loss_sum = 0;
  // On a GPU the micro-steps' losses are added on the device (in double, as here) and read once
  // per step, so that the host can queue the next forward while the device still runs.
  torch::Tensor device_loss_sum;
  for (int64_t a = 0; a < accum; ++a) {
    const auto t0 = Clock::now();
    auto loss = batches.next_loss();
    if (run.device.cuda()) {
      const torch::Tensor value = loss.detach().to(torch::kFloat64);
      device_loss_sum = device_loss_sum.defined() ? device_loss_sum + value : value;
    } else {
      loss_sum += loss.item<double>();
    }
    if (timed) synchronize(run.device);  // else the forward's GPU time counts as backward's
    const auto t1 = Clock::now();
    run.engine->backward(loss);
    if (timed) synchronize(run.device);
    const auto t2 = Clock::now();
    result = run.engine->step();
    if (timed) synchronize(run.device);
    const auto t3 = Clock::now();
    w.forward += std::chrono::duration<double>(t1 - t0).count();
    w.backward += std::chrono::duration<double>(t2 - t1).count();
    w.step += std::chrono::duration<double>(t3 - t2).count();
  }
  ++w.optimizer_steps;
  ZT_CHECK_STATE(result.boundary, "the last micro-step of a window must end it");
  if (device_loss_sum.defined()) loss_sum = device_loss_sum.item<double>();
  return loss_sum / double(accum);
}

}  // namespace

StepLog run_steps(TrainingRun& run, const TrainRunOptions& options) {
  const TrainConfig& config = run.config;
  const FlopsProfilerConfig& fp = config.flops_profiler;
  if (run.leader && fp.enabled && run.kind->profiles_flops(run.grid.tensor_size) && (fp.profile_step <= run.first_step || fp.profile_step > config.train.steps))
    fmt::print("note: flops_profiler.profile_step {} is outside the steps this run takes ({} to {}): nothing is "
               "profiled\n",
               fp.profile_step, run.first_step + 1, config.train.steps);
  BatchSource batches(run);
  CsvLog csv(run);
  StepLog log;
  // Set-up's peak, kept apart from the steps' (the final memory line reports both).
  log.peak.setup = peak_rss_bytes();
  log.peak.split = reset_peak_rss();
  // The block cache's bound follows the steps from here, not construction's or loading's peak.
  if (CpuBlockCache* cache = installed_cpu_block_cache()) cache->reset_high_water();
  const int64_t steps = config.train.steps;
  const double tokens_per_step = double(config.train_batch_size) * double(run.seq_len);
  log.losses.reserve(steps);
  const auto start = Clock::now();
  ProgressWindow window{start, 0, 0, 0, 0, 0, 0, run.engine->offload_report(), start};
  for (int64_t step = run.first_step; step < steps; ++step) {
    // Dropout masks differ per rank (as with one process per device elsewhere) and depend only on
    // (seed, rank, step), so that a resumed run draws what the uninterrupted one would have.
    // By data-parallel rank: the ranks of a tensor group draw the same masks, so the activations
    // they replicate stay equal.
    const uint64_t step_seed = config.train.seed + 1000003ull * (run.data_rank + 1) + 7919ull * uint64_t(step);
    torch::manual_seed(step_seed);
    // The split region's masks (attention over this rank's heads) differ per tensor rank.
    if (run.grid.tensor) seed_tensor_parallel_rng(step_seed + 2718 + 104729ull * uint64_t(run.grid.tensor->rank()));
    const auto step_start = Clock::now();
    StepResult result;
    const double rank_loss = run_micro_steps(run, batches, window, result);
    synchronize(run.device);  // the step's device work is part of the step's time
    const double loss = mean_over_ranks(*run.comm, rank_loss, "train.loss");
    // This step's rate on this rank: its micro-steps and the loss's reduction, not the evaluation,
    // checkpoint or printing that may follow.
    const double step_seconds = seconds_since(step_start);
    if (fp.enabled && run.kind->profiles_flops(run.grid.tensor_size) && step + 1 == fp.profile_step) log.flops_summary = profile_flops(run, options, step_seconds);
    log.losses.push_back(loss);
    log.skipped.push_back(result.skipped ? 1 : 0);
    ++window.steps;
    const bool last = step + 1 == steps;
    const bool print = last || (config.steps_per_print > 0 && (step + 1) % config.steps_per_print == 0);
    const double elapsed = seconds_since(start);
    if (print) {
      const double span = seconds_since(window.start);
      window.rate = span > 0 ? tokens_per_step * window.steps / span : 0;
      window.start = Clock::now();
      window.steps = 0;
    }
    const bool eval_now = config.train.eval_interval > 0 && ((step + 1) % config.train.eval_interval == 0 || last);
    // The last step's update is installed before the final evaluation and save (delayed update).
    if (last) run.engine->apply_pending_update();
    std::optional<double> eval_loss;
    if (eval_now) {
      eval_loss = batches.evaluate();
      log.eval_losses.emplace_back(step + 1, *eval_loss);
    }
    std::vector<RankStats> stats;
    if (print) stats = gather_rank_stats(*run.comm, *run.engine, run.baseline_rss, log.peak);
    csv.row(run, step, loss, result, tokens_per_step / step_seconds, elapsed, log.peak);
    save_if_due(run, options, step, last);
    if (print && run.leader) print_progress(run, window, stats, step, loss, result, elapsed, eval_loss);
    if (print) window.forward = window.backward = window.step = 0, window.optimizer_steps = 0;
  }
  log.total_seconds = seconds_since(start);
  return log;
}

}  // namespace zt::training
