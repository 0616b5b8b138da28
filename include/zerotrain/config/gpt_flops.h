// Analytic FLOP count of the reference GPT (zerotrain/models/gpt.h), per module, the way
// DeepSpeed's flops profiler counts the operations it sees (docs/profiling.md "Formulas").
//
// Contract
// - Counts one forward of a micro-batch of `batch` sequences of `sequence` tokens (N = B·T):
//   a Linear or matrix product of [m,k]·[k,n] is m·k·n multiply-accumulates and 2·m·k·n FLOPs
//   (biases not counted, as DeepSpeed); attention scores and the weighted sum are full T×T
//   products (the causal mask is not discounted, as DeepSpeed's count of scaled_dot_product_attention);
//   LayerNorm 5 FLOPs per element, GELU and softmax 1, each residual or embedding sum 1; embedding
//   lookups 0; the loss's log-softmax is not counted.
// - A node's figures include its children's. Parameters are those the module owns: the tied head
//   owns none (they are wte's).
// - Backward is counted as 2 × forward. gpt_recompute_flops() is what activation checkpointing
//   runs again in one backward: full recomputation re-runs each checkpointed block's forward (and,
//   with a chunked loss, every chunk's head product), selective re-runs the attention core (scores,
//   softmax, weighted sum) and GELU of each checkpointed block.
// - Pure functions; no tensors.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "zerotrain/config/recompute.h"

namespace zt {

struct GPTConfig;

struct FlopsNode {
  std::string name;  // dotted module path ("blocks.0.attn.c_attn"); "" for the model
  std::string kind;  // module class as DeepSpeed prints it: "GPT", "Block", "Linear", "MatMul", ...
  int64_t params = 0;
  int64_t macs = 0;   // forward multiply-accumulates
  int64_t flops = 0;  // forward floating-point operations
  std::vector<FlopsNode> children;
};

// The module tree of one forward: GPT -> wte, wpe, embedding_sum, blocks.i (ln_1, attn (c_attn,
// scores, softmax, weighted_sum, c_proj), ln_2, mlp (c_fc, gelu, c_proj), residual), ln_f, head.
// Throws ConfigError for a non-positive batch or sequence or an invalid config.
FlopsNode gpt_forward_flops(const GPTConfig& config, int64_t batch, int64_t sequence);

// FLOPs recomputed during one backward of the micro-batch when `checkpointed_blocks` blocks
// recompute with `recompute`.
int64_t gpt_recompute_flops(const GPTConfig& config, int64_t batch, int64_t sequence, Recompute recompute,
                            int64_t checkpointed_blocks);

// One micro-batch's FLOPs: forward, backward (2 × forward) and recomputation.
struct StepFlops {
  int64_t forward = 0;
  int64_t backward = 0;
  int64_t recompute = 0;
  int64_t model() const { return forward + backward; }  // what MFU counts
  int64_t executed() const { return forward + backward + recompute; }
};
StepFlops gpt_micro_batch_flops(const GPTConfig& config, int64_t batch, int64_t sequence, Recompute recompute,
                                int64_t checkpointed_blocks);

}  // namespace zt

namespace zt {

// What the flops profiler (DeepSpeed's "flops_profiler", docs/profiling.md) reports for one
// optimizer step of the reference GPT on one rank.
struct FlopsProfileInputs {
  int64_t profile_step = 1;
  int world = 1;
  int64_t micro_batch = 1;    // sequences per micro-batch per rank
  int64_t accumulation = 1;   // micro-batches per step
  int64_t sequence = 1;
  Recompute recompute = Recompute::None;
  int64_t checkpointed_blocks = 0;
  double recompute_fwd_factor = 0.0;  // DeepSpeed's: extra forwards counted in its FLOPS figure
  double step_seconds = 0.0;          // the step's measured time
  double peak_flops = 0.0;            // per rank
  std::string peak_source;            // how the peak was obtained ("measured matmul peak ...")
  int64_t module_depth = -1;
  int64_t top_modules = 1;
  bool detailed = true;
};

struct FlopsProfile {
  StepFlops micro_batch;           // one micro-batch
  double model_flops = 0;          // per rank per step: (forward + backward) × accumulation
  double executed_flops = 0;       // per rank per step, recomputation included
  double deepspeed_flops = 0;      // (3 + recompute_fwd_factor) × forward × accumulation
  double achieved_flops_per_second = 0;  // executed / step time
  double mfu = 0;                  // model FLOP/s over the peak
  double hfu = 0;                  // executed FLOP/s over the peak
  std::string text;                // the report
};

// Throws ConfigError on non-positive shapes or a non-positive step time.
FlopsProfile gpt_flops_profile(const GPTConfig& config, const FlopsProfileInputs& inputs);

}  // namespace zt
