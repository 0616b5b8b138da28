// The built-in training program behind `zerotrain train`: one rank of a run of the reference GPT
// on the configured data, driven by zt::Engine. Used by the CLI; a library user writes their
// own loop instead (see engine.h and examples/).
#pragma once
#include <cstdint>
#include <string>

namespace zt {

struct TrainConfig;

struct TrainRunOptions {
  std::string summary_path;  // "" : no summary; else rank 0 writes the JSON summary there
  bool quiet = false;        // no progress lines (tests)
  // Checkpoints (docs/checkpoint.md): with save_dir, one every save_every steps (0: only at the
  // end) and at the end, tagged "step-<N>", keeping the newest keep_last (0: all). With
  // resume_dir, the run continues from its latest checkpoint (any world size and stage) up to
  // train.steps.
  std::string save_dir;
  int64_t save_every = 0;
  int keep_last = 3;
  std::string resume_dir;
  // With resume_dir: load the weights only, with fresh optimizer moments (zt::LoadOptions), as
  // needed to resume with another optimizer type.
  bool reset_optimizer = false;
  // Where this rank trains (docs/gpu.md): "cpu", or "cuda" (a build with ZT_CUDA; the rank uses
  // cuda:(LOCAL_RANK % visible GPUs): the model is built on the CPU and moved there before the
  // engine takes it, batches follow it, and the memory estimate and summary describe that GPU).
  // The CLI resolves --device auto to one of the two before it gets here.
  std::string device = "cpu";
};

// Runs this process as one rank (rank and world from the environment, see comm.h). Returns 0 on
// success; throws zt::Error subclasses on failure.
int run_training_rank(const TrainConfig& config, const TrainRunOptions& options);

// Checks what can be checked before any rank starts (data files exist, are readable and have a
// plausible size; comms_logger.prof_ops names operations), so bad input fails fast with exit
// code 2. Throws DataError or ConfigError naming the key.
void check_training_inputs(const TrainConfig& config);

// Bytes the training data holds in each rank from set-up on, for the memory estimate's data term
// (ModelFigures::data_bytes): a mapped token file read through by validation, the index of
// mapped fine-tuning examples, or bytes as uint16 ids in memory. Builds a missing token cache
// (check_training_inputs has built it before launch). 0 for the BERT, which the estimate does not
// model. Throws what loading the data throws.
int64_t training_data_bytes(const TrainConfig& config);

// Peak resident set size of this process in bytes (VmHWM).
long long peak_rss_bytes();
// Resident set size of this process now, in bytes (VmRSS).
long long current_rss_bytes();

}  // namespace zt
