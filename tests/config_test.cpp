// Configuration: DeepSpeed defaults, the batch triple, the support matrix (docs/config.md),
// overrides, sources, and one clear message per malformed input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "config/schema.h"
#include "support/process.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/config/llama_config.h"

namespace {

using zt::ConfigError;
using zt::parse_config;
using zt::TrainConfig;
using zt::ValueSource;

// Returns the ConfigError message, or fails the test when nothing was thrown.
std::string error_of(const std::string& json, const std::vector<std::string>& overrides = {}, int world = 1) {
  try {
    parse_config(json, overrides, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for " << json;
  return "";
}

TEST(Config, DefaultsMatchDeepSpeed) {
  const TrainConfig c = parse_config("", {}, 1);
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_TRUE(c.zero.contiguous_gradients);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 500'000'000);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c.precision, zt::Precision::FP32);
  EXPECT_EQ(c.optimizer.type, "Adam");
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.scheduler.type, "");
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_FALSE(c.wall_clock_breakdown);
  EXPECT_EQ(c.train.retain_freed_memory, "bounded");
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  // Reserved DeepSpeed keys still show their defaults in the resolved configuration.
  EXPECT_EQ(c.resolved.at("zero_optimization.stage3_prefetch_bucket_size"), "50000000");
  EXPECT_EQ(c.resolved.at("zero_optimization.stage3_param_persistence_threshold"), "100000");
  EXPECT_EQ(c.resolved.at("zero_optimization.sub_group_size"), "1000000000");
  EXPECT_EQ(c.resolved.at("zero_optimization.offload_optimizer.device"), "\"none\"");
  EXPECT_EQ(c.resolved.at("aio.block_size"), "1048576");
  EXPECT_EQ(c.resolved.at("aio.queue_depth"), "8");
  // Every known key has a source, and all are defaults here except the derived batch size.
  for (const auto& [key, value] : c.resolved) {
    ASSERT_TRUE(c.sources.count(key)) << key;
    if (key != "train_batch_size") EXPECT_EQ(c.sources.at(key), ValueSource::Default) << key;
  }
  EXPECT_EQ(c.sources.size(), c.resolved.size());
}

TEST(Config, OverlapCommCanBeSetAtStage0) {
  // The stage-3 default (true) is derived in the config but stage 3 is rejected for now.
  const TrainConfig c = parse_config(R"({"zero_optimization": {"overlap_comm": true}})", {}, 1);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.sources.at("zero_optimization.overlap_comm"), ValueSource::File);
}

TEST(Config, StageSetsIndependentSwitches) {
  const bool expected[4][3] = {{false, false, false}, {true, false, false}, {true, true, false}, {true, true, true}};
  for (int stage = 0; stage <= 3; ++stage) {
    const TrainConfig c =
        parse_config(R"({"zero_optimization": {"stage": )" + std::to_string(stage) + "}}", {}, 2);
    EXPECT_EQ(c.zero.shard_optimizer_states, expected[stage][0]) << stage;
    EXPECT_EQ(c.zero.shard_gradients, expected[stage][1]) << stage;
    EXPECT_EQ(c.zero.shard_parameters, expected[stage][2]) << stage;
  }
}

TEST(Config, MixedPrecisionBlocks) {
  TrainConfig c = parse_config(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}})", {}, 2);
  EXPECT_EQ(c.precision, zt::Precision::BF16);
  c = parse_config(R"({"fp16": {"enabled": true, "initial_scale_power": 8, "hysteresis": 1}})", {}, 1);
  EXPECT_EQ(c.precision, zt::Precision::FP16);
  EXPECT_EQ(c.fp16.initial_scale_power, 8);
  EXPECT_EQ(c.fp16.hysteresis, 1);
  c = parse_config("{}", {}, 1);
  EXPECT_EQ(c.precision, zt::Precision::FP32);
}

TEST(Config, AdamWAndAdamMode) {
  TrainConfig c = parse_config(R"({"optimizer": {"type": "adamw"}})", {}, 1);
  EXPECT_EQ(c.optimizer.type, "AdamW");  // case-insensitive as in DeepSpeed, stored canonical
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  c = parse_config(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "lr": 5e-4}}})", {}, 1);
  EXPECT_FALSE(c.optimizer.adam_w_mode);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 5e-4);
  c = parse_config(R"({"optimizer": {"type": "lamb", "params": {"min_coeff": 0.1, "max_coeff": 3}}})", {}, 1);
  EXPECT_EQ(c.optimizer.type, "Lamb");
  EXPECT_DOUBLE_EQ(c.optimizer.min_coeff, 0.1);
  EXPECT_DOUBLE_EQ(c.optimizer.max_coeff, 3.0);
  c = parse_config(R"({"optimizer": {"type": "sgd", "params": {"momentum": 0.9, "nesterov": true}}})", {}, 1);
  EXPECT_EQ(c.optimizer.type, "SGD");
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.9);
  EXPECT_TRUE(c.optimizer.nesterov);
  c = parse_config(R"({"optimizer": {"params": {"betas": [0.8, 0.95]}}})", {}, 1);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
}

struct BatchCase {
  std::string json;
  int world;
  int64_t tbs, micro, accum;
  ValueSource tbs_src, micro_src, accum_src;
};

TEST(Config, BatchTripleDerivation) {
  const auto F = ValueSource::File, D = ValueSource::Derived, Def = ValueSource::Default, A = ValueSource::Auto;
  const std::vector<BatchCase> cases = {
      {R"({})", 1, 1, 1, 1, D, Def, Def},
      {R"({})", 3, 3, 1, 1, D, Def, Def},
      {R"({"train_batch_size": 32})", 2, 32, 16, 1, F, D, D},
      {R"({"train_batch_size": 24})", 3, 24, 8, 1, F, D, D},
      {R"({"train_micro_batch_size_per_gpu": 4})", 3, 12, 4, 1, D, F, D},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 1, 8, 4, 2, D, F, F},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 2, 16, 4, 2, D, F, F},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 3, 24, 4, 2, D, F, F},
      {R"({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4})", 3, 48, 4, 4, F, F, D},
      {R"({"train_batch_size": 48, "gradient_accumulation_steps": 2})", 3, 48, 8, 2, F, D, F},
      {R"({"train_batch_size": 16, "gradient_accumulation_steps": 4})", 2, 16, 2, 4, F, D, F},
      {R"({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})", 2, 12,
       2, 3, F, F, F},
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"})",
       2, 4, 2, 1, A, F, A},
      // accelerate's file: the accumulation given, the micro-batch "auto" (zerotrain's default, 1).
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3})",
       2, 6, 1, 3, A, A, F},
  };
  for (const BatchCase& bc : cases) {
    SCOPED_TRACE(bc.json + " world " + std::to_string(bc.world));
    const TrainConfig c = parse_config(bc.json, {}, bc.world);
    EXPECT_EQ(c.world_size, bc.world);
    EXPECT_EQ(c.train_batch_size, bc.tbs);
    EXPECT_EQ(c.train_micro_batch_size_per_gpu, bc.micro);
    EXPECT_EQ(c.gradient_accumulation_steps, bc.accum);
    EXPECT_EQ(c.train_batch_size, c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * bc.world);
    EXPECT_EQ(c.sources.at("train_batch_size"), bc.tbs_src);
    EXPECT_EQ(c.sources.at("train_micro_batch_size_per_gpu"), bc.micro_src);
    EXPECT_EQ(c.sources.at("gradient_accumulation_steps"), bc.accum_src);
    EXPECT_EQ(c.resolved.at("train_batch_size"), std::to_string(bc.tbs));
  }
}

struct BadCase {
  std::string json;
  std::vector<std::string> overrides;
  std::string expected;  // substring of the ConfigError message
  int world = 1;
};

TEST(Config, MalformedConfigsGiveClearErrors) {
  const std::vector<BadCase> cases = {
      // Invalid JSON: line and column from the parser.
      {"{\n  \"train_batch_size\": 8,\n  oops\n}", {}, "invalid JSON: parse error at line 3, column"},
      {"[1, 2]", {}, "expected a JSON object at the top level, found [1,2]"},
      // Unknown keys with suggestions, at any level.
      {R"({"zero_optimisation": {"stage": 0}})", {},
       "unknown key 'zero_optimisation' — did you mean 'zero_optimization'?"},
      {R"({"optimizer": {"params": {"betaz": [0.9, 0.99]}}})", {},
       "unknown key 'optimizer.params.betaz' — did you mean 'optimizer.params.betas'?"},
      {R"({"train_micro_batch_size_per_gpus": 4})", {},
       "unknown key 'train_micro_batch_size_per_gpus' — did you mean 'train_micro_batch_size_per_gpu'?"},
      {R"({"model": {"n_layers": 2}})", {}, "unknown key 'model.n_layers' — did you mean 'model.n_layer'?"},
      {R"({"zero_optimization": {"completely_unrelated": 1}})", {},
       "unknown key 'zero_optimization.completely_unrelated' (valid keys in 'zero_optimization':"},
      {R"({"optimizer": 3})", {}, "optimizer: expected an object (a block of settings), found 3"},
      // Wrong types and ranges name the dotted key, the expectation and the value found.
      {R"({"optimizer": {"params": {"lr": "fast"}}})", {},
       "optimizer.params.lr: expected a non-negative number, found \"fast\""},
      {R"({"optimizer": {"params": {"lr": -1e-3}}})", {}, "optimizer.params.lr: expected a non-negative number"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", {},
       "optimizer.params.betas: expected two numbers in [0, 1), found [0.9]"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.5]}}})", {}, "optimizer.params.betas: expected two numbers"},
      {R"({"optimizer": {"params": {"betas": "0.9,0.99"}}})", {}, "optimizer.params.betas: expected two numbers"},
      {R"({"optimizer": {"params": {"eps": true}}})", {}, "optimizer.params.eps: expected a positive number, found true"},
      {R"({"optimizer": {"type": "Adamm"}})", {}, "optimizer.type: expected one of \"Adam\", \"AdamW\""},
      {R"({"zero_optimization": {"stage": 7}})", {},
       "zero_optimization.stage: expected an integer in [0, 3], found 7"},
      {R"({"zero_optimization": {"stage": 1.5}})", {}, "zero_optimization.stage: expected an integer in [0, 3]"},
      {R"({"zero_optimization": {"reduce_bucket_size": -5}})", {},
       "zero_optimization.reduce_bucket_size: expected a positive integer, found -5"},
      {R"({"train_batch_size": 0})", {}, "train_batch_size: expected a positive integer or \"auto\", found 0"},
      {R"({"train_micro_batch_size_per_gpu": "four"})", {}, "train_micro_batch_size_per_gpu: expected a positive"},
      {R"({"gradient_clipping": -1})", {}, "gradient_clipping: expected a non-negative number, found -1"},
      {R"({"wall_clock_breakdown": "yes"})", {}, "wall_clock_breakdown: expected true or false, found \"yes\""},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": 3}}})", {},
       "scheduler.params.warmup_type: expected a string, found 3"},
      {R"({"train": {"retain_freed_memory": "sometimes"}})", {},
       "train.retain_freed_memory: expected one of \"bounded\", \"auto\", \"always\", \"never\", found \"sometimes\""},
      {R"({"train": {"cpu_half_precision": "never"}})", {},
       "train.cpu_half_precision: expected one of \"auto\", \"always\", found \"never\""},
      {R"({"scheduler": {"type": "WarmupCosine"}})", {}, "did you mean \"WarmupCosineLR\"?"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})", {},
       "scheduler.params.warmup_num_steps: expected a positive integer, found 0"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}})", {},
       "scheduler.params.cos_min_ratio: not a parameter of WarmupLR"},
      {R"({"scheduler": {"params": {"warmup_num_steps": 10}}})", {}, "scheduler.type is not set"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "warmup_num_steps": 10}}})", {},
       "scheduler.params.warmup_num_steps: not a parameter of OneCycle (its parameters: cycle_first_stair_count, "
       "cycle_first_step_size, cycle_max_lr, cycle_max_mom, cycle_min_lr, cycle_min_mom, cycle_momentum, "
       "cycle_second_stair_count, cycle_second_step_size, decay_lr_rate, decay_mom_rate, decay_step_size)"},
      {R"({"scheduler": {"type": "LRRangeTest", "params": {"cycle_min_lr": 1e-4}}})", {},
       "scheduler.params.cycle_min_lr: not a parameter of LRRangeTest (its parameters: lr_range_test_min_lr, "
       "lr_range_test_staircase, lr_range_test_step_rate, lr_range_test_step_size)"},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 1e-3}}})", {},
       "scheduler.params.warmup_max_lr: not a parameter of WarmupCosineLR (its parameters: cos_min_ratio, "
       "total_num_steps, warmup_min_ratio, warmup_num_steps, warmup_type)"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}})", {},
       "scheduler.params.cycle_min_lr: required for OneCycle (DeepSpeed's OneCycle has no default for it), found "
       "nothing"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}})", {},
       "scheduler.params.cycle_max_lr: required for OneCycle"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": null, "cycle_max_lr": 1e-3}}})", {},
       "scheduler.params.cycle_min_lr: expected a non-negative number, found null"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
          "cycle_first_step_size": 0}}})", {},
       "scheduler.params.cycle_first_step_size: expected a positive number, found 0"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
          "cycle_max_mom": 1.0}}})", {},
       "scheduler.params.cycle_max_mom: expected a number in [0, 1), found 1.0"},
      {R"({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}})", {},
       "scheduler.params.lr_range_test_step_size: expected a positive integer, found 0"},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 2}}})", {},
       "scheduler.params.cos_min_ratio: expected a number in [0, 1], found 2"},
      {R"({"fp16": {"loss_scale_window": 0}})", {}, "fp16.loss_scale_window: expected an integer in [1, 2147483647], found 0"},
      {R"({"data": {"source": "parquet"}})", {}, "data.source: expected one of \"embedded\", \"bin\", \"text\", \"jsonl\", \"finetune\""},
      {R"({"data": {"source": "bin"}})", {}, "data.path: required when data.source is \"bin\""},
      {R"({"data": {"val_fraction": 1.0}})", {}, "data.val_fraction: expected a number in [0, 1), found 1.0"},
      {R"({"train": {"steps": 0}})", {}, "train.steps: expected an integer in [1, 100000000], found 0"},
      {R"({"comm": {"timeout_seconds": 0}})", {}, "comm.timeout_seconds: expected a positive number, found 0"},
      // The batch triple.
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", {},
       "batch size mismatch: train_batch_size 32 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 "
       "× world size 2 (= 16)",
       2},
      {R"({"train_batch_size": 10})", {}, "train_batch_size 10 is not divisible by the world size 3", 3},
      {R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})", {},
       "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × world size 2", 2},
      {R"({"train_batch_size": 30, "gradient_accumulation_steps": 4})", {},
       "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 × world size 1"},
      {R"({"gradient_accumulation_steps": 4})", {}, "gradient_accumulation_steps 4 alone does not determine the batch"},
      // The support matrix.
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {},
       "fp16.enabled and bf16.enabled are both true"},
      {R"({"optimizer": {"type": "OneBitLamb"}})", {},
       "optimizer.type \"OneBitLamb\" is not supported: 1-bit LAMB (compressed communication) is not implemented "
       "(zerotrain implements Adam, AdamW, Lamb, SGD)"},
      {R"({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})", {},
       "optimizer.params.momentum: not a parameter of Adam"},
      {R"({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})", {},
       "optimizer.params.betas: not a parameter of SGD"},
      {R"({"optimizer": {"type": "Lamb", "params": {"min_coeff": 2, "max_coeff": 1}}})", {},
       "optimizer.params.min_coeff 2 is greater than max_coeff 1"},
      {R"({"optimizer": {"type": "SGD", "params": {"nesterov": true}}})", {},
       "optimizer.params.nesterov: needs momentum > 0 and dampening 0"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", {},
       "zero_optimization.offload_optimizer.device: expected \"none\" at zero_optimization.stage 0"},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -1}})", {},
       "zero_optimization.stage3_param_persistence_threshold"},
      {R"({"activation_checkpointing": {"policy": "selective", "contiguous_memory_optimization": true}})", {},
       "activation_checkpointing.contiguous_memory_optimization: holds the inputs of fully recomputed blocks"},
      {R"({"activation_checkpointing": {"policy": "some"}})", {}, "activation_checkpointing.policy"},
      {R"({"activation_checkpointing": {"number_checkpoints": -1}})", {}, "activation_checkpointing.number_checkpoints"},
      // Overrides: same checks, same messages.
      {"{}", {"zero_optimisation.stage=1"}, "unknown key 'zero_optimisation' — did you mean 'zero_optimization'?"},
      {"{}", {"zero_optimization.stag=1"},
       "unknown key 'zero_optimization.stag' — did you mean 'zero_optimization.stage'?"},
      {"{}", {"optimizer.params.lr=fast"}, "optimizer.params.lr: expected a non-negative number, found \"fast\""},
      {"{}", {"optimizer.params.lr.x=1"}, "unknown key 'optimizer.params.lr.x' ('optimizer.params.lr' is a value"},
      {"{}", {"train.steps"}, "override 'train.steps': expected key.path=value"},
      {"{}", {"zero_optimization.stage=4"}, "zero_optimization.stage: expected an integer in [0, 3], found 4"},
      {"{}", {"optimizer=3"}, "optimizer: expected an object (a block of settings), found 3"},
  };
  ASSERT_GE(cases.size(), 25u);
  for (const BadCase& bc : cases) {
    SCOPED_TRACE(bc.json + (bc.overrides.empty() ? "" : " --set " + bc.overrides.front()));
    const std::string message = error_of(bc.json, bc.overrides, bc.world);
    EXPECT_NE(message.find(bc.expected), std::string::npos) << "message: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

TEST(Config, NoSuggestionForDistantKeys) {
  const std::string message = error_of(R"({"optimizer": {"params": {"xyz": 1}}})");
  EXPECT_EQ(message.find("did you mean"), std::string::npos) << message;
  EXPECT_NE(message.find("valid keys in 'optimizer.params': lr, betas"), std::string::npos) << message;
}

TEST(Config, OverridesApplyBeforeValidationAndRecordTheirSource) {
  const std::string file = R"({"train_micro_batch_size_per_gpu": 4, "optimizer": {"params": {"lr": 1e-3}}})";
  const TrainConfig c = parse_config(file,
                                     {"optimizer.params.lr=3e-4", "scheduler.type=WarmupLR",
                                      "scheduler.params.warmup_num_steps=5", "train.log_dir=out/run 1",
                                      "gradient_accumulation_steps=2", "zero_optimization={\"overlap_comm\": true}"},
                                     2);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.sources.at("optimizer.params.lr"), ValueSource::CommandLine);
  EXPECT_EQ(c.scheduler.type, "WarmupLR");  // not JSON, so taken as a string
  EXPECT_EQ(c.scheduler.warmup_num_steps, 5);
  EXPECT_EQ(c.train.log_dir, "out/run 1");
  EXPECT_EQ(c.sources.at("train.log_dir"), ValueSource::CommandLine);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.sources.at("zero_optimization.overlap_comm"), ValueSource::CommandLine);
  EXPECT_EQ(c.sources.at("zero_optimization.stage"), ValueSource::Default);
  // The batch triple is derived after the overrides.
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.train_batch_size, 16);
  EXPECT_EQ(c.sources.at("train_batch_size"), ValueSource::Derived);
  EXPECT_EQ(c.sources.at("train_micro_batch_size_per_gpu"), ValueSource::File);
  // WarmupLR without warmup_max_lr warms up to the optimizer's lr (DeepSpeed), derived.
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.sources.at("scheduler.params.warmup_max_lr"), ValueSource::Derived);
  // An override can make an otherwise invalid file valid: validation sees the final values.
  const TrainConfig fixed = parse_config(R"({"zero_optimization": {"stage": 2}})", {"zero_optimization.stage=0"}, 1);
  EXPECT_EQ(fixed.zero.stage, 0);
}

TEST(Config, DecayingSchedulersDeriveTotalStepsFromTheRun) {
  TrainConfig c = parse_config(R"({"scheduler": {"type": "WarmupCosineLR"}, "train": {"steps": 1500}})", {}, 1);
  EXPECT_EQ(c.scheduler.total_num_steps, 1500);
  EXPECT_EQ(c.sources.at("scheduler.params.total_num_steps"), ValueSource::Derived);
  EXPECT_DOUBLE_EQ(c.scheduler.cos_min_ratio, 1e-4);
  EXPECT_EQ(c.scheduler.warmup_type, "log");
  c = parse_config(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}}})",
                   {}, 1);
  EXPECT_EQ(c.scheduler.total_num_steps, 50);
  EXPECT_EQ(c.sources.at("scheduler.params.total_num_steps"), ValueSource::File);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 1e-3);  // WarmupDecayLR keeps DeepSpeed's literal default
}

// Every DeepSpeed scheduler parses with DeepSpeed's defaults for what is left out
// (lr_schedules.py; the values themselves: lr_schedule_test).
TEST(Config, SchedulersTakeDeepSpeedsDefaults) {
  TrainConfig c = parse_config(R"({"scheduler": {"type": "WarmupLR"}})", {}, 1);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-3);  // the optimizer's lr (1e-3 by default), derived
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(c.scheduler.warmup_type, "log");

  c = parse_config(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})",
                   {}, 1);
  const zt::SchedulerConfig& s = c.scheduler;
  EXPECT_EQ(s.cycle_min_lr, 1e-4);
  EXPECT_EQ(s.cycle_max_lr, 1e-3);
  EXPECT_EQ(s.decay_lr_rate, 0.0);
  EXPECT_EQ(s.cycle_first_step_size, 2000);
  EXPECT_FALSE(s.cycle_second_step_size.has_value());  // DeepSpeed's None: the first half's size
  EXPECT_EQ(s.cycle_first_stair_count, 0);
  EXPECT_FALSE(s.cycle_second_stair_count.has_value());  // None: the first half's count
  EXPECT_EQ(s.decay_step_size, 0);
  EXPECT_TRUE(s.cycle_momentum);
  EXPECT_EQ(s.cycle_min_mom, 0.8);
  EXPECT_EQ(s.cycle_max_mom, 0.9);
  EXPECT_EQ(s.decay_mom_rate, 0.0);
  EXPECT_EQ(c.resolved.at("scheduler.params.cycle_second_step_size"), "null");
  EXPECT_TRUE(c.notes.empty());
  // DeepSpeed's None spelt out is the default too.
  c = parse_config(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
      "cycle_second_step_size": null, "cycle_second_stair_count": null}}})",
                   {}, 1);
  EXPECT_FALSE(c.scheduler.cycle_second_step_size.has_value());

  c = parse_config(R"({"scheduler": {"type": "LRRangeTest"}})", {}, 1);
  EXPECT_EQ(c.scheduler.lr_range_test_min_lr, 1e-3);
  EXPECT_EQ(c.scheduler.lr_range_test_step_size, 2000);
  EXPECT_EQ(c.scheduler.lr_range_test_step_rate, 1.0);
  EXPECT_FALSE(c.scheduler.lr_range_test_staircase);
}

// Where DeepSpeed only warns, the configuration is accepted and the warning is a note; the
// schedule then computes what DeepSpeed computes (lr_schedule_test).
TEST(Config, WhatDeepSpeedsSchedulersWarnAboutIsNoted) {
  const std::string root = ZT_SOURCE_DIR;
  // zero2.json warms up over 20 steps; a 5-step run leaves nothing to decay over.
  TrainConfig c = zt::load_config(root + "/configs/zero2.json", {"train.steps=5"}, 2);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0],
            "scheduler.params.total_num_steps 5 (from train.steps) leaves no steps to decay over after the 20-step "
            "warm-up: the lr drops to cos_min_ratio × lr right after it (DeepSpeed warns and does the same)");
  c = parse_config(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}})", {}, 1);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_NE(c.notes[0].find("the lr drops to warmup_min_lr"), std::string::npos) << c.notes[0];

  c = parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})", {}, 1);
  EXPECT_EQ(c.notes, std::vector<std::string>{"scheduler.params.warmup_type \"cosine\" is neither \"log\" nor "
                                              "\"linear\": the warm-up is \"log\", as DeepSpeed's WarmupLR runs it"});
  c = parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.01}}})",
                   {}, 1);
  EXPECT_EQ(c.notes, std::vector<std::string>{"scheduler.params.warmup_max_lr 0.01 is below warmup_min_lr 0.1: the "
                                              "warm-up lowers the lr (as in DeepSpeed)"});

  // OneCycle sets the lr, and the betas of optimizers that have them; SGD has none.
  c = parse_config(R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2}}})",
                   {}, 1);
  EXPECT_EQ(c.notes, (std::vector<std::string>{
                         "optimizer.params.lr has no effect: scheduler OneCycle sets the lr of every step",
                         "scheduler.params.cycle_momentum has no effect: optimizer SGD has no betas to cycle "
                         "(DeepSpeed turns it off with a warning)"}));
  c = parse_config(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                    "decay_lr_rate": 0.1}}})",
                   {}, 1);
  EXPECT_EQ(c.notes, (std::vector<std::string>{
                         "optimizer.params.betas has no effect: scheduler OneCycle with cycle_momentum sets the betas "
                         "of every step (beta1 from cycle_min_mom and cycle_max_mom, beta2 0.99, as DeepSpeed)",
                         "scheduler.params.decay_lr_rate has no effect: scheduler.params.decay_step_size is 0 (no "
                         "decay after the cycle)"}));
  c = parse_config(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                    "cycle_momentum": false, "cycle_min_mom": 0.7}}})",
                   {}, 1);
  EXPECT_EQ(c.notes, std::vector<std::string>{"scheduler.params.cycle_min_mom has no effect: the momentum is not "
                                              "cycled (cycle_momentum is false, or the optimizer has no betas)"});
}

TEST(Config, IntegralFloatsAreIntegers) {
  // DeepSpeed configs often write bucket sizes as 5e8.
  const TrainConfig c = parse_config(R"({"zero_optimization": {"reduce_bucket_size": 2e8}})", {}, 1);
  EXPECT_EQ(c.zero.reduce_bucket_size, 200'000'000);
  EXPECT_EQ(c.resolved.at("zero_optimization.reduce_bucket_size"), "200000000");
}

TEST(Config, DescribeListsEveryKeyWithItsSource) {
  const TrainConfig c = parse_config(R"({"train_micro_batch_size_per_gpu": 4})", {"train.steps=10"}, 2);
  const std::string text = zt::describe(c);
  size_t lines = 0;
  for (char ch : text) lines += ch == '\n';
  EXPECT_EQ(lines, c.resolved.size());
  EXPECT_NE(text.find("zero_optimization.stage"), std::string::npos);
  EXPECT_NE(text.find("(default)"), std::string::npos);
  EXPECT_NE(text.find("(file)"), std::string::npos);
  EXPECT_NE(text.find("(command line)"), std::string::npos);
  EXPECT_NE(text.find("(derived)"), std::string::npos);
  // Aligned: "key<spaces> = value<spaces>  (source)".
  const auto line_of = [&](const std::string& key) {
    const size_t at = text.find("\n" + key + " ");
    return text.substr(at + 1, text.find('\n', at + 1) - at - 1);
  };
  const std::string stage = line_of("zero_optimization.stage");
  const std::string steps = line_of("train.steps");
  EXPECT_NE(stage.find(" = 0 "), std::string::npos) << stage;
  EXPECT_TRUE(stage.ends_with("(default)")) << stage;
  EXPECT_TRUE(steps.ends_with("(command line)")) << steps;
  EXPECT_EQ(stage.find('='), steps.find('=')) << stage << "\n" << steps;
  EXPECT_STREQ(zt::to_string(ValueSource::Derived), "derived");
  EXPECT_STREQ(zt::to_string(ValueSource::File), "file");
}

TEST(Config, ShippedConfigsParse) {
  const std::string root = ZT_SOURCE_DIR;
  const TrainConfig demo = zt::load_config(root + "/configs/demo.json", {}, 2);
  EXPECT_EQ(demo.model.preset, "small");
  EXPECT_EQ(demo.train_batch_size, 32);
  EXPECT_EQ(demo.train.steps, 300);
  EXPECT_EQ(demo.train.eval_interval, 50);
  EXPECT_EQ(demo.scheduler.type, "WarmupCosineLR");
  EXPECT_EQ(demo.scheduler.total_num_steps, 300);
  EXPECT_DOUBLE_EQ(demo.gradient_clipping, 1.0);
  const TrainConfig tiny = zt::load_config(root + "/configs/tiny.json", {}, 1);
  EXPECT_EQ(tiny.model.preset, "tiny");
  EXPECT_EQ(tiny.train_batch_size, 8);
  const TrainConfig zero2 = zt::load_config(root + "/configs/zero2.json", {}, 2);
  EXPECT_TRUE(zero2.zero.shard_gradients);
  EXPECT_EQ(zero2.zero.reduce_bucket_size, 20'000'000);
  EXPECT_EQ(zero2.train_batch_size, 64);
}

TEST(Config, LoadConfigErrorsNameThePath) {
  try {
    zt::load_config("/nonexistent/dir/cfg.json", {}, 1);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("config file '/nonexistent/dir/cfg.json' not found"), std::string::npos)
        << e.what();
  }
  const std::string dir = zt::testing::make_temp_dir("config_test");
  const std::string path = dir + "/bad.json";
  std::ofstream(path) << "{\n\"train\": {\"steps\": 3,}\n}\n";
  try {
    zt::load_config(path, {}, 1);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path + ": invalid JSON"), std::string::npos) << message;
    EXPECT_NE(message.find("line 2, column"), std::string::npos) << message;
  }
}

TEST(Config, WorldSizeMustBePositive) {
  EXPECT_NE(error_of("{}", {}, 0).find("world size: expected a positive integer, found 0"), std::string::npos);
}

// --- Hostile input: every input that is not a usable configuration is one ConfigError
// line; nothing crashes, hangs or is silently accepted.

namespace cd = zt::config_detail;
using json = nlohmann::json;

// The error of an input, whatever exception it is: a test then shows which exception escaped.
std::string any_error_of(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("NOT A ConfigError: ") + e.what();
  }
  return "NO ERROR";
}

void expect_one_line_error(const std::string& message, const std::string& expected) {
  EXPECT_NE(message.find(expected), std::string::npos) << "message: " << message.substr(0, 500);
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message.substr(0, 500);
  EXPECT_LT(message.size(), 400u) << "short: " << message.substr(0, 500);
}

// {"a": {"b": value}} for "a.b".
json nest(const std::string& path, const json& value) {
  json doc = value;
  std::string rest = path;
  std::vector<std::string> parts;
  std::stringstream in(path);
  for (std::string part; std::getline(in, part, '.');) parts.push_back(part);
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) doc = json{{*it, doc}};
  return doc;
}

TEST(ConfigHostile, NotJsonBinaryAndHugeTexts) {
  expect_one_line_error(any_error_of([] { parse_config("hello", {}, 1); }), "config: invalid JSON");
  std::string binary;
  for (int i = 0; i < 256; ++i) binary += static_cast<char>(i);
  const std::string message = any_error_of([&] { parse_config("{\"a\": \"" + binary, {}, 1); });
  expect_one_line_error(message, "config: invalid JSON");
  for (unsigned char ch : message) EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << "printable: " << message;
  expect_one_line_error(any_error_of([] { parse_config("\x89PNG\r\n\x1a\n\0\0", {}, 1); }), "invalid JSON");
  // Larger than any configuration: refused before parsing, not by running out of memory.
  const std::string huge = "{\"model\": {\"preset\": \"" + std::string(2 << 20, 'x') + "\"}}";
  expect_one_line_error(any_error_of([&] { parse_config(huge, {}, 1); }),
                        "config: 2097177 bytes, more than the 1048576 bytes a configuration may have");
  // Under the size limit, a string value is still a name or a path, not a megabyte of text.
  std::string long_path_doc = R"({"data": {"source": "text", "path": ")";
  long_path_doc.append(5000, 'p').append("\"}}");
  expect_one_line_error(any_error_of([&] { parse_config(long_path_doc, {}, 1); }),
      "data.path: expected a string of at most 4096 bytes, found one of 5000 bytes");
  // A NUL would cut the path short at the open() call: another file than the one written.
  expect_one_line_error(any_error_of([] { parse_config(R"({"data": {"source": "text", "path": "a\u0000b"}})", {}, 1); }),
                        "data.path: expected a string, found \"a\\u0000b\" (control characters are not allowed)");
}

TEST(ConfigHostile, DeepNestingIsRefusedWithoutRecursion) {
  expect_one_line_error(any_error_of([] { parse_config(std::string(100000, '['), {}, 1); }),
                        "config: nested more than 16 levels deep at '(top level)[][][]");
  expect_one_line_error(any_error_of([] { parse_config(std::string(100000, '[') + std::string(100000, ']'), {}, 1); }),
                        "nested more than 16 levels deep");
  std::string objects;
  for (int i = 0; i < 50000; ++i) objects += "{\"optimizer\":";
  expect_one_line_error(any_error_of([&] { parse_config(objects, {}, 1); }),
                        "nested more than 16 levels deep at 'optimizer.optimizer.optimizer.");
  const std::string deep_value =
      "{\"optimizer\": {\"params\": {\"lr\": " + std::string(1000, '[') + std::string(1000, ']') + "}}}";
  expect_one_line_error(any_error_of([&] { parse_config(deep_value, {}, 1); }),
                        "nested more than 16 levels deep at 'optimizer.params.lr[][]");
  expect_one_line_error(any_error_of([] { parse_config("{}", {"optimizer.params.lr=" + std::string(100000, '[') + std::string(100000, ']')}, 1); }),
                        "override 'optimizer.params.lr': nested more than 16 levels deep");
}

TEST(ConfigHostile, DuplicateKeysAreRefusedNamingTheKey) {
  expect_one_line_error(any_error_of([] { parse_config(R"({"train": {"steps": 1, "steps": 2}})", {}, 1); }),
                        "config: duplicate key 'train.steps' (each key may appear once)");
  expect_one_line_error(any_error_of([] { parse_config(R"({"train": {"steps": 1}, "train": {"seed": 2}})", {}, 1); }),
                        "config: duplicate key 'train'");
  // The same name in different blocks is no duplicate.
  EXPECT_EQ(parse_config(R"({"tensorboard": {"enabled": false}, "csv_monitor": {"enabled": true}})", {}, 1).train.steps,
            200);
  expect_one_line_error(
      any_error_of([] { parse_config("{}", {R"(optimizer.params={"lr": 0.1, "lr": 0.2})"}, 1); }),
      "override 'optimizer.params': duplicate key 'lr'");
}

TEST(ConfigHostile, NumbersOutOfRange) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"train": {"steps": 1e999}})", "config: invalid JSON"},
      {R"({"train": {"steps": -1}})", "train.steps: expected an integer in [1, 100000000], found -1"},
      {R"({"train": {"steps": 1180591620717411303424}})", "train.steps: expected an integer in [1, 100000000]"},  // 2^70
      {R"({"train": {"steps": 9223372036854775808}})", "train.steps: expected an integer in [1, 100000000]"},     // 2^63
      {R"({"train": {"steps": 18446744073709551615}})", "train.steps: expected an integer in [1, 100000000]"},
      {R"({"train": {"steps": 2.5}})", "train.steps: expected an integer in [1, 100000000], found 2.5"},
      {R"({"train": {"steps": 9223372036854775807}})", "train.steps: expected an integer in [1, 100000000]"},
      {R"({"train": {"steps": NaN}})", "config: train.steps: expected a finite number, found NaN"},
      {R"({"train": {"steps": "NaN"}})", "train.steps: expected an integer in [1, 100000000], found \"NaN\""},
      {R"({"optimizer": {"params": {"lr": Infinity}}})", "config: optimizer.params.lr: expected a finite number, found Infinity"},
      {R"({"optimizer": {"params": {"lr": 1e308}}, "train": {"steps": 1e308}})", "train.steps: expected an integer in [1, 100000000]"},
      // `int` fields: a value that fits int64 but not int is refused, never truncated.
      {R"({"fp16": {"loss_scale_window": 1099511627776}})",
       "fp16.loss_scale_window: expected an integer in [1, 2147483647], found 1099511627776"},
      {R"({"fp16": {"hysteresis": 4294967297}})", "fp16.hysteresis: expected an integer in [1, 2147483647]"},
      // Model sizes whose parameter arithmetic would overflow.
      {R"({"model": {"n_embd": 1099511627776}})", "model.n_embd: expected an integer in [0, 1048576]"},
      {R"({"model": {"vocab_size": 1e12}})", "model.vocab_size: expected an integer in [0, 16777216]"},
      // The batch triple's product.
      {R"({"train_micro_batch_size_per_gpu": 4294967296, "gradient_accumulation_steps": 4294967296})",
       "batch sizes: train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size overflows"},
      {R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 9223372036854775807})", "overflows"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    expect_one_line_error(any_error_of([&] { parse_config(text, {}, 2); }), expected);
  }
  expect_one_line_error(any_error_of([] { parse_config("{}", {"train.steps=1e999"}, 1); }),
                        "train.steps: expected an integer in [1, 100000000], found \"1e999\"");
}

// Every key of the schema, every wrong type: a ConfigError naming the key.
TEST(ConfigHostile, WrongTypesForEveryKey) {
  const std::vector<json> samples = {true, 7, 1.5, "zzz", json::array(), json::array({1, 2, 3}), json::object(),
                                     nullptr};
  int checked = 0;
  for (const cd::Leaf& leaf : cd::leaves()) {
    for (const json& sample : samples) {
      const bool fits = (leaf.kind == cd::Kind::Bool && sample.is_boolean()) ||
                        (leaf.kind == cd::Kind::Int && sample.is_number_integer()) ||
                        (leaf.kind == cd::Kind::Number && sample.is_number()) ||
                        (leaf.kind == cd::Kind::BatchSize && sample.is_number_integer()) ||
                        (leaf.kind == cd::Kind::String && sample.is_string() && leaf.choices.empty()) ||
                        (leaf.kind == cd::Kind::Object && sample.is_object()) ||
                        ((leaf.kind == cd::Kind::StringList || leaf.kind == cd::Kind::AutoOrStringList) &&
                         sample.is_array() && sample.empty()) ||
                        sample.is_null();  // null is DeepSpeed's None: the key's default
      if (fits) continue;
      SCOPED_TRACE(leaf.path + " = " + sample.dump());
      const std::string message = any_error_of([&] { parse_config(nest(leaf.path, sample).dump(), {}, 1); });
      expect_one_line_error(message, leaf.path + ": expected ");
      const std::string from_override =
          any_error_of([&] { parse_config("{}", {leaf.path + "=" + sample.dump()}, 1); });
      expect_one_line_error(from_override, leaf.path + ": expected ");
      ++checked;
    }
  }
  EXPECT_GT(checked, 400);
}

// Every bounded numeric key just outside its range, and every integer key at the largest value
// it accepts: refused with its range, or stored whole (a field narrower than the table's range
// would raise a non-ConfigError here).
TEST(ConfigHostile, RangesOfEveryNumericKey) {
  for (const cd::Leaf& leaf : cd::leaves()) {
    if (leaf.kind != cd::Kind::Int && leaf.kind != cd::Kind::Number) continue;
    SCOPED_TRACE(leaf.path);
    const double step = leaf.kind == cd::Kind::Int ? 1 : 1e-3;
    if (leaf.lo) {
      const double below = leaf.lo_open ? *leaf.lo : *leaf.lo - step;
      expect_one_line_error(any_error_of([&] { parse_config(nest(leaf.path, below).dump(), {}, 1); }),
                            leaf.path + ": expected " + leaf.expected());
    }
    if (leaf.hi) {
      const double above = leaf.hi_open ? *leaf.hi : *leaf.hi + step;
      expect_one_line_error(any_error_of([&] { parse_config(nest(leaf.path, above).dump(), {}, 1); }),
                            leaf.path + ": expected " + leaf.expected());
    }
    if (leaf.kind == cd::Kind::Int) {
      const json top = leaf.hi ? json(static_cast<int64_t>(*leaf.hi)) : json(INT64_MAX);
      const std::string message = any_error_of([&] { parse_config(nest(leaf.path, top).dump(), {}, 1); });
      EXPECT_EQ(message.find("NOT A ConfigError"), std::string::npos) << message;
    }
  }
}

TEST(ConfigHostile, UnknownKeysAreShownEscapedAndShort) {
  const std::string newline_key = any_error_of([] { parse_config(R"({"fp16": {"a\nb": 1}})", {}, 1); });
  expect_one_line_error(newline_key, "unknown key 'fp16.a\\nb'");
  std::string long_key_doc = "{\"fp16\": {\"";
  long_key_doc.append(500000, 'k').append("\": 1}}");
  const std::string long_key = any_error_of([&] { parse_config(long_key_doc, {}, 1); });
  expect_one_line_error(long_key, "unknown key 'fp16.kkkk");
  // At the top level DeepSpeed ignores such keys: a warning, as short and printable.
  const TrainConfig top = parse_config(R"({"a\nb": 1})", {}, 1);
  ASSERT_EQ(top.warnings.size(), 1u);
  EXPECT_EQ(top.warnings[0], "ignored (keys DeepSpeed does not read either): a?b");
  const std::string long_override = any_error_of([] { parse_config("{}", {std::string(500000, 'k') + "=1"}, 1); });
  expect_one_line_error(long_override, "unknown key 'kkkk");
}

TEST(ConfigHostile, MalformedOverrides) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"=1", "override '=1': expected key.path=value"},
      {"", "override '': expected key.path=value"},
      {"train.steps", "override 'train.steps': expected key.path=value"},
      {".=1", "unknown key ''"},
      {"train..steps=1", "unknown key 'train.'"},
      {"train.steps.=1", "unknown key 'train.steps.'"},
      {"train.steps=", "train.steps: expected an integer in [1, 100000000], found \"\""},
      {"train.steps=[1", "train.steps: expected an integer in [1, 100000000], found \"[1\""},
      {"train.steps=-5", "train.steps: expected an integer in [1, 100000000], found -5"},
      {"train={\"steps\": 0}", "train.steps: expected an integer in [1, 100000000], found 0"},
      {"train=[1]", "train: expected an object (a block of settings), found [1]"},
      {"model.preset=" + std::string(2 << 20, 'x'), "more than the 1048576 bytes a configuration may have"},
      {"a\x01\x02=1", "unknown key 'a\\u0001\\u0002'"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text.substr(0, 80));
    expect_one_line_error(any_error_of([&] { parse_config("{}", {text}, 1); }), expected);
  }
}

TEST(ConfigHostile, FilesThatAreNotConfigurations) {
  const std::string dir = zt::testing::make_temp_dir("config_hostile");
  auto load = [](const std::string& path) { return any_error_of([&] { zt::load_config(path, {}, 1); }); };
  std::ofstream(dir + "/empty.json").flush();
  expect_one_line_error(load(dir + "/empty.json"), "is empty: expected a JSON object (write {} for all defaults)");
  std::ofstream(dir + "/blank.json") << " \n\t\n";
  expect_one_line_error(load(dir + "/blank.json"), "is empty");
  {
    std::ofstream out(dir + "/binary.json", std::ios::binary);
    for (int i = 0; i < 4096; ++i) out.put(static_cast<char>((i * 7919) & 0xff));
  }
  expect_one_line_error(load(dir + "/binary.json"), dir + "/binary.json: invalid JSON");
  // 100 MB (sparse, so the test writes nothing): refused by its size, not read.
  std::filesystem::resize_file((std::ofstream(dir + "/huge.json").close(), dir + "/huge.json"), 100'000'000);
  expect_one_line_error(load(dir + "/huge.json"), "100000000 bytes, more than the 1048576 bytes");
  expect_one_line_error(load("/dev/zero"), "config file '/dev/zero' is not a regular file");
  expect_one_line_error(load(dir), "is a directory, expected a JSON file");
  expect_one_line_error(load(""), "config file: expected a path");
  std::ofstream(dir + "/dup.json") << R"({"train": {"steps": 3}, "train": {"steps": 4}})";
  expect_one_line_error(load(dir + "/dup.json"), dir + "/dup.json: duplicate key 'train'");
}

// The configuration the overrides give, or a test failure with the error and nothing.
std::optional<TrainConfig> parse_or_fail(const std::vector<std::string>& overrides) {
  try {
    return parse_config("{}", overrides, 1);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return std::nullopt;
  }
}

// The audit of "no key accepted and silently ignored" as a table: every key of the schema with
// what it does. A key added to the schema fails this test until it is classified here; a key
// that lands in TrainConfig is checked to arrive there, a reserved one to be refused when it
// differs from its default. (Which code reads each field is listed beside it.)
TEST(ConfigAudit, EveryKeyIsUsedRefusedOrReported) {
  // Noted: accepted, a note says it has no effect in zerotrain. Reported: a DeepSpeed report
  // zerotrain does not produce, named in the warning.
  enum Behaviour { Used, Reserved, Noted, Reported };
  struct Entry {
    Behaviour behaviour;
    std::string value;  // a non-default valid value ("" for reserved keys: one is chosen)
    std::function<bool(const TrainConfig&)> arrived;
    const char* reader;
  };
  using C = const TrainConfig&;
  const std::map<std::string, Entry> table = {
      {"train_batch_size", {Used, "6", [](C c) { return c.train_batch_size == 6; }, "trainer, engine"}},
      {"train_micro_batch_size_per_gpu", {Used, "3", [](C c) { return c.train_micro_batch_size_per_gpu == 3; }, "trainer"}},
      {"gradient_accumulation_steps", {Used, "5", [](C c) { return c.gradient_accumulation_steps == 5; }, "trainer, engine"}},
      {"gradient_clipping", {Used, "0.5", [](C c) { return c.gradient_clipping == 0.5; }, "engine"}},
      {"steps_per_print", {Used, "3", [](C c) { return c.steps_per_print == 3; }, "trainer"}},
      {"wall_clock_breakdown", {Used, "true", [](C c) { return c.wall_clock_breakdown; }, "trainer (time per phase)"}},
      {"optimizer.type", {Used, "\"SGD\"", [](C c) { return c.optimizer.type == "SGD"; }, "engine"}},
      {"optimizer.params.lr", {Used, "0.5", [](C c) { return c.optimizer.lr == 0.5; }, "engine, lr schedule"}},
      {"optimizer.params.betas", {Used, "[0.5, 0.6]", [](C c) { return c.optimizer.beta1 == 0.5 && c.optimizer.beta2 == 0.6; }, "engine"}},
      {"optimizer.params.eps", {Used, "0.5", [](C c) { return c.optimizer.eps == 0.5; }, "engine"}},
      {"optimizer.params.weight_decay", {Used, "0.5", [](C c) { return c.optimizer.weight_decay == 0.5; }, "engine"}},
      {"optimizer.params.adam_w_mode", {Used, "false", [](C c) { return !c.optimizer.adam_w_mode; }, "engine"}},
      {"optimizer.params.bias_correction", {Used, "false", [](C c) { return !c.optimizer.bias_correction; }, "engine"}},
      {"optimizer.params.min_coeff", {Used, "0.5", [](C c) { return c.optimizer.min_coeff == 0.5; }, "engine (Lamb)"}},
      {"optimizer.params.max_coeff", {Used, "5.0", [](C c) { return c.optimizer.max_coeff == 5.0; }, "engine (Lamb)"}},
      {"optimizer.params.momentum", {Used, "0.5", [](C c) { return c.optimizer.momentum == 0.5; }, "engine (SGD)"}},
      {"optimizer.params.dampening", {Used, "0.5", [](C c) { return c.optimizer.dampening == 0.5; }, "engine (SGD)"}},
      {"optimizer.params.nesterov", {Used, "true", [](C c) { return c.optimizer.nesterov; }, "engine (SGD)"}},
      {"optimizer.params.amsgrad", {Reserved, "", nullptr, ""}},
      {"optimizer.params.torch_adam", {Noted, "true", nullptr, ""}},
      {"optimizer.params.fused", {Noted, "true", nullptr, ""}},
      {"optimizer.params.fp32_optimizer_states", {Reserved, "", nullptr, ""}},
      {"optimizer.params.max_grad_norm", {Used, "0.5", [](C c) { return c.optimizer.lamb_max_grad_norm == 0.5; }, "validate_support (Lamb: refused in fp16), note"}},
      {"optimizer.params.eps_inside_sqrt", {Reserved, "", nullptr, ""}},
      {"optimizer.legacy_fusion", {Noted, "true", nullptr, ""}},
      {"communication_data_type", {Used, "\"fp32\"", [](C c) { return c.resolved.at("communication_data_type") == "\"fp32\""; }, "validate_support (the working precision only)"}},
      {"seq_parallel_communication_data_type", {Noted, "\"bf16\"", nullptr, ""}},
      {"gradient_allreduce_op", {Reserved, "", nullptr, ""}},
      {"sparse_gradients", {Reserved, "", nullptr, ""}},
      {"disable_allgather", {Reserved, "", nullptr, ""}},
      {"managed_gradient_accumulation", {Reserved, "", nullptr, ""}},
      {"zero_allow_untested_optimizer", {Noted, "true", nullptr, ""}},
      {"zero_force_ds_cpu_optimizer", {Noted, "false", nullptr, ""}},
      {"dataloader_drop_last", {Noted, "true", nullptr, ""}},
      {"vocabulary_size", {Noted, "50257", nullptr, ""}},
      {"graph_harvesting", {Noted, "true", nullptr, ""}},
      {"use_data_before_expert_parallelism", {Reserved, "", nullptr, ""}},
      {"dump_state", {Reported, "true", nullptr, ""}},
      {"memory_breakdown", {Reported, "true", nullptr, ""}},
      {"log_level", {Reported, "\"info\"", nullptr, ""}},
      {"timers.throughput.enabled", {Reported, "false", nullptr, ""}},
      {"timers.throughput.synchronized", {Reported, "false", nullptr, ""}},
      {"data_types.grad_accum_dtype", {Used, "\"fp32\"", [](C c) { return c.resolved.at("data_types.grad_accum_dtype") == "\"fp32\""; }, "validate_support (the working precision only)"}},
      {"data_types.param_dtype", {Used, "\"fp32\"", [](C c) { return c.resolved.at("data_types.param_dtype") == "\"fp32\""; }, "validate_support (the working precision only)"}},
      {"data_types.buffer_dtype", {Used, "\"bf16\"", [](C c) { return c.buffer_dtype == "bf16"; }, "engine (cast_buffers)"}},
      {"data_types.keep_in_fp32_modules", {Used, "[\"norm\"]", [](C c) { return c.keep_in_fp32_buffers == std::vector<std::string>{"norm"}; }, "engine (cast_buffers)"}},
      {"compression_training", {Reserved, R"({"weight_quantization": {"shared_parameters": {"enabled": true}}})", nullptr, ""}},
      {"data_efficiency", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"curriculum_learning", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"progressive_layer_drop", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"elasticity", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"quantize_training", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"sparse_attention", {Reserved, R"({"mode": "fixed"})", nullptr, ""}},
      {"amp", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"torch_autocast", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"hybrid_engine", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"weight_quantization", {Reserved, R"({"quantized_initialization": {}})", nullptr, ""}},
      {"expert_parallel", {Reserved, R"({"enabled": true})", nullptr, ""}},
      {"tensor_parallel.autotp_size", {Used, "1", [](C c) { return c.tensor_parallel == 1; }, "trainer (make_process_grid), batch derivation"}},
      {"tensor_parallel.tp_overlap_comm", {Reserved, "", nullptr, ""}},
      {"pipeline", {Noted, R"({"activation_checkpoint_interval": 1})", nullptr, ""}},
      {"compile", {Noted, R"({"deepcompile": true})", nullptr, ""}},
      {"autotuning", {Noted, R"({"enabled": true})", nullptr, ""}},
      {"nebula", {Noted, R"({"enabled": true})", nullptr, ""}},
      {"datastates", {Noted, R"({"checkpoint": {}})", nullptr, ""}},
      {"eigenvalue", {Reported, R"({"enabled": true})", nullptr, ""}},
      {"checkpoint.tag_validation", {Noted, "\"Fail\"", nullptr, ""}},
      {"checkpoint.load_universal", {Reserved, "", nullptr, ""}},
      {"checkpoint.use_node_local_storage", {Noted, "true", nullptr, ""}},
      {"checkpoint.parallel_write.pipeline_stage", {Noted, "true", nullptr, ""}},
      {"checkpoint.writer", {Noted, R"({"type": "fast", "decoupled": true})", nullptr, ""}},
      {"aio.use_gds", {Reserved, "", nullptr, ""}},
      {"zero_optimization.use_multi_rank_bucket_allreduce", {Noted, "false", nullptr, ""}},
      {"zero_optimization.load_from_fp32_weights", {Reserved, "", nullptr, ""}},
      {"zero_optimization.elastic_checkpoint", {Reserved, "", nullptr, ""}},
      {"zero_optimization.ignore_unused_parameters", {Noted, "false", nullptr, ""}},
      {"zero_optimization.legacy_stage1", {Reserved, "", nullptr, ""}},
      {"zero_optimization.zero_hpz_partition_size", {Used, "0", [](C c) { return c.zero.hpz_partition_size == 0; }, "engine (stage 3), estimate"}},
      {"zero_optimization.zero_quantized_weights", {Reserved, "", nullptr, ""}},
      {"zero_optimization.zero_quantized_nontrainable_weights", {Reserved, "", nullptr, ""}},
      {"zero_optimization.zero_quantized_gradients", {Reserved, "", nullptr, ""}},
      {"zero_optimization.zeropp_loco_param", {Reserved, R"({"err_beta": 0.8, "reset_T": 1024})", nullptr, ""}},
      {"zero_optimization.zenflow", {Reserved, R"({"topk_ratio": 0.05})", nullptr, ""}},
      {"zero_optimization.mics_shard_size", {Noted, "8", nullptr, ""}},
      {"zero_optimization.mics_hierarchical_params_gather", {Noted, "true", nullptr, ""}},
      {"zero_optimization.memory_efficient_linear", {Noted, "false", nullptr, ""}},
      {"zero_optimization.override_module_apply", {Noted, "false", nullptr, ""}},
      {"zero_optimization.pipeline_loading_checkpoint", {Noted, "true", nullptr, ""}},
      {"zero_optimization.log_trace_cache_warnings", {Noted, "true", nullptr, ""}},
      {"zero_optimization.enable_sanity_checks", {Noted, "true", nullptr, ""}},
      {"zero_optimization.save_muon_momentum_buffer_in_memory", {Noted, "true", nullptr, ""}},
      {"zero_optimization.leaf_module", {Noted, R"({"names": ["blocks.0"]})", nullptr, ""}},
      {"zero_optimization.cpu_offload_use_pin_memory", {Noted, "true", nullptr, ""}},
      {"zero_optimization.stage3_model_persistence_threshold", {Noted, "1000", nullptr, ""}},
      {"zero_optimization.stage3_module_granularity_threshold", {Noted, "1000", nullptr, ""}},
      {"zero_optimization.stage3_use_all_reduce_for_fetch_params", {Noted, "true", nullptr, ""}},
      {"zero_optimization.stage3_allgather_sequential", {Noted, "true", nullptr, ""}},
      {"zero_optimization.offload_optimizer.super_offload", {Noted, "true", nullptr, ""}},
      {"zero_optimization.offload_optimizer.cpuadam_cores_perc", {Noted, "0.5", nullptr, ""}},
      {"fp16.fp16_master_weights_and_grads", {Reserved, "", nullptr, ""}},
      {"bf16.immediate_grad_update", {Noted, "true", nullptr, ""}},
      {"bf16.check_grad_overflow", {Reserved, "", nullptr, ""}},
      {"bf16.bf16_master_weights_and_grads", {Reserved, "", nullptr, ""}},
      {"bf16.bf16_optimizer_states", {Reserved, "", nullptr, ""}},
      {"wandb.enabled", {Reported, "true", nullptr, ""}},
      {"wandb.group", {Reported, "\"g\"", nullptr, ""}},
      {"wandb.team", {Reported, "\"t\"", nullptr, ""}},
      {"wandb.project", {Reported, "\"p\"", nullptr, ""}},
      {"comet.enabled", {Reported, "true", nullptr, ""}},
      {"comet.samples_log_interval", {Reported, "5", nullptr, ""}},
      {"comet.project", {Reported, "\"p\"", nullptr, ""}},
      {"comet.workspace", {Reported, "\"w\"", nullptr, ""}},
      {"comet.api_key", {Reported, "\"k\"", nullptr, ""}},
      {"comet.experiment_name", {Reported, "\"e\"", nullptr, ""}},
      {"comet.experiment_key", {Reported, "\"e\"", nullptr, ""}},
      {"comet.mode", {Reported, "\"m\"", nullptr, ""}},
      {"comet.online", {Reported, "true", nullptr, ""}},
      {"scheduler.type", {Used, "\"WarmupLR\"", [](C c) { return c.scheduler.type == "WarmupLR"; }, "lr schedule"}},
      {"scheduler.params.warmup_min_lr", {Used, "0.0001", [](C c) { return c.scheduler.warmup_min_lr == 0.0001; }, "lr schedule"}},
      {"scheduler.params.warmup_max_lr", {Used, "0.5", [](C c) { return c.scheduler.warmup_max_lr == 0.5; }, "lr schedule"}},
      {"scheduler.params.warmup_num_steps", {Used, "7", [](C c) { return c.scheduler.warmup_num_steps == 7; }, "lr schedule"}},
      {"scheduler.params.warmup_type", {Used, "\"linear\"", [](C c) { return c.scheduler.warmup_type == "linear"; }, "lr schedule"}},
      {"scheduler.params.total_num_steps", {Used, "70", [](C c) { return c.scheduler.total_num_steps == 70; }, "lr schedule"}},
      {"scheduler.params.cos_min_ratio", {Used, "0.5", [](C c) { return c.scheduler.cos_min_ratio == 0.5; }, "lr schedule"}},
      {"scheduler.params.warmup_min_ratio", {Used, "0.5", [](C c) { return c.scheduler.warmup_min_ratio == 0.5; }, "lr schedule"}},
      {"scheduler.params.cycle_min_lr", {Used, "0.5", [](C c) { return c.scheduler.cycle_min_lr == 0.5; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_max_lr", {Used, "0.5", [](C c) { return c.scheduler.cycle_max_lr == 0.5; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.decay_lr_rate", {Used, "0.5", [](C c) { return c.scheduler.decay_lr_rate == 0.5; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_first_step_size", {Used, "7", [](C c) { return c.scheduler.cycle_first_step_size == 7; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_second_step_size", {Used, "5", [](C c) { return c.scheduler.cycle_second_step_size == 5.0; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_first_stair_count", {Used, "3", [](C c) { return c.scheduler.cycle_first_stair_count == 3; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_second_stair_count", {Used, "2", [](C c) { return c.scheduler.cycle_second_stair_count == 2; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.decay_step_size", {Used, "4", [](C c) { return c.scheduler.decay_step_size == 4; }, "lr schedule (OneCycle)"}},
      {"scheduler.params.cycle_momentum", {Used, "false", [](C c) { return !c.scheduler.cycle_momentum; }, "lr schedule (OneCycle), engine (betas)"}},
      {"scheduler.params.cycle_min_mom", {Used, "0.5", [](C c) { return c.scheduler.cycle_min_mom == 0.5; }, "lr schedule (OneCycle), engine (betas)"}},
      {"scheduler.params.cycle_max_mom", {Used, "0.95", [](C c) { return c.scheduler.cycle_max_mom == 0.95; }, "lr schedule (OneCycle), engine (betas)"}},
      {"scheduler.params.decay_mom_rate", {Used, "0.5", [](C c) { return c.scheduler.decay_mom_rate == 0.5; }, "lr schedule (OneCycle), engine (betas)"}},
      {"scheduler.params.lr_range_test_min_lr", {Used, "0.5", [](C c) { return c.scheduler.lr_range_test_min_lr == 0.5; }, "lr schedule (LRRangeTest)"}},
      {"scheduler.params.lr_range_test_step_size", {Used, "7", [](C c) { return c.scheduler.lr_range_test_step_size == 7; }, "lr schedule (LRRangeTest)"}},
      {"scheduler.params.lr_range_test_step_rate", {Used, "0.5", [](C c) { return c.scheduler.lr_range_test_step_rate == 0.5; }, "lr schedule (LRRangeTest)"}},
      {"scheduler.params.lr_range_test_staircase", {Used, "true", [](C c) { return c.scheduler.lr_range_test_staircase; }, "lr schedule (LRRangeTest)"}},
      {"zero_optimization.stage", {Used, "2", [](C c) { return c.zero.stage == 2 && c.zero.shard_gradients; }, "engine (switches)"}},
      {"zero_optimization.contiguous_gradients", {Used, "true", [](C c) { return c.zero.contiguous_gradients; }, "always contiguous; false refused"}},
      {"zero_optimization.reduce_bucket_size", {Used, "1000", [](C c) { return c.zero.reduce_bucket_size == 1000; }, "engine, estimate"}},
      {"zero_optimization.allgather_bucket_size", {Used, "1000", [](C c) { return c.zero.allgather_bucket_size == 1000; }, "engine"}},
      {"zero_optimization.overlap_comm", {Used, "true", [](C c) { return c.zero.overlap_comm; }, "engine, estimate"}},
      {"zero_optimization.reduce_scatter", {Noted, "false", nullptr, ""}},
      {"zero_optimization.allgather_partitions", {Noted, "false", nullptr, ""}},
      {"zero_optimization.round_robin_gradients", {Noted, "true", nullptr, ""}},
      {"zero_optimization.stage3_prefetch_bucket_size", {Used, "1000", [](C c) { return c.zero.stage3_prefetch_bucket_size == 1000; }, "engine (stage 3)"}},
      {"zero_optimization.stage3_param_persistence_threshold", {Used, "1000", [](C c) { return c.zero.stage3_param_persistence_threshold == 1000; }, "engine, trainer, estimate"}},
      {"zero_optimization.stage3_max_live_parameters", {Used, "1000", [](C c) { return c.zero.stage3_max_live_parameters == 1000; }, "engine (stage 3)"}},
      {"zero_optimization.stage3_max_reuse_distance", {Used, "1000", [](C c) { return c.zero.stage3_max_reuse_distance == 1000; }, "engine (stage 3)"}},
      {"zero_optimization.stage3_gather_16bit_weights_on_model_save", {Noted, "true", nullptr, ""}},
      {"zero_optimization.sub_group_size", {Used, "1000", [](C c) { return c.zero.sub_group_size == 1000; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.device", {Used, "\"nvme\"", [](C c) { return c.zero.offload_optimizer.device == zt::OffloadDevice::Nvme; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.nvme_path", {Used, "\"swap\"", [](C c) { return c.zero.offload_optimizer.nvme_path == "swap"; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.pin_memory", {Used, "true", [](C c) { return c.zero.offload_optimizer.pin_memory; }, "engine (offload; noted: training runs on the CPU)"}},
      {"zero_optimization.offload_optimizer.buffer_count", {Used, "3", [](C c) { return c.zero.offload_optimizer.buffer_count == 3; }, "engine (offload), estimate"}},
      {"zero_optimization.offload_optimizer.pipeline_read", {Used, "true", [](C c) { return c.zero.offload_optimizer.pipeline_read; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.pipeline_write", {Used, "true", [](C c) { return c.zero.offload_optimizer.pipeline_write; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.fast_init", {Used, "true", [](C c) { return c.zero.offload_optimizer.fast_init; }, "engine (offload; noted: always initialised from the model)"}},
      {"zero_optimization.offload_optimizer.ratio", {Used, "0.5", [](C c) { return c.zero.offload_optimizer.ratio == 0.5; }, "engine (offload), estimate"}},
      {"zero_optimization.offload_optimizer.delayed_update", {Used, "true", [](C c) { return c.zero.offload_optimizer.delayed_update; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.delayed_update_after", {Used, "7", [](C c) { return c.zero.offload_optimizer.delayed_update_after == 7; }, "engine (offload)"}},
      {"zero_optimization.offload_optimizer.nvme_gradients", {Used, "true", [](C c) { return c.zero.offload_optimizer.nvme_gradients; }, "engine (offload), estimate"}},
      {"zero_optimization.offload_param.device", {Used, "\"nvme\"", [](C c) { return c.zero.offload_param.device == zt::OffloadDevice::Nvme; }, "engine (offload)"}},
      {"zero_optimization.offload_param.nvme_path", {Used, "\"swap\"", [](C c) { return c.zero.offload_param.nvme_path == "swap"; }, "engine (offload)"}},
      {"zero_optimization.offload_param.pin_memory", {Used, "true", [](C c) { return c.zero.offload_param.pin_memory; }, "engine (offload; noted: training runs on the CPU)"}},
      {"zero_optimization.offload_param.buffer_count", {Used, "3", [](C c) { return c.zero.offload_param.buffer_count == 3; }, "engine (offload), estimate"}},
      {"zero_optimization.offload_param.buffer_size", {Used, "1000", [](C c) { return c.zero.offload_param.buffer_size == 1000; }, "engine (offload), estimate"}},
      {"zero_optimization.offload_param.max_in_cpu", {Used, "1000", [](C c) { return c.zero.offload_param.max_in_cpu == 1000; }, "engine (offload), estimate"}},
      {"aio.block_size", {Used, "4096", [](C c) { return c.aio.block_size == 4096; }, "engine (nvme I/O)"}},
      {"aio.queue_depth", {Used, "4", [](C c) { return c.aio.queue_depth == 4; }, "engine (nvme I/O)"}},
      {"aio.thread_count", {Used, "2", [](C c) { return c.aio.thread_count == 2; }, "engine (nvme I/O)"}},
      {"aio.single_submit", {Used, "true", [](C c) { return c.aio.single_submit; }, "engine (nvme I/O)"}},
      {"aio.overlap_events", {Used, "false", [](C c) { return !c.aio.overlap_events; }, "engine (nvme I/O)"}},
      {"fp16.enabled", {Used, "true", [](C c) { return c.precision == zt::Precision::FP16; }, "engine, trainer (precision)"}},
      {"fp16.loss_scale", {Used, "128.0", [](C c) { return c.fp16.loss_scale == 128.0; }, "loss scaler"}},
      {"fp16.initial_scale_power", {Used, "8", [](C c) { return c.fp16.initial_scale_power == 8; }, "loss scaler"}},
      {"fp16.loss_scale_window", {Used, "10", [](C c) { return c.fp16.loss_scale_window == 10; }, "loss scaler"}},
      {"fp16.hysteresis", {Used, "3", [](C c) { return c.fp16.hysteresis == 3; }, "loss scaler"}},
      {"fp16.min_loss_scale", {Used, "2.0", [](C c) { return c.fp16.min_loss_scale == 2.0; }, "loss scaler"}},
      {"fp16.auto_cast", {Reserved, "", nullptr, ""}},
      {"fp16.consecutive_hysteresis", {Reserved, "", nullptr, ""}},
      {"bf16.enabled", {Used, "true", [](C c) { return c.precision == zt::Precision::BF16; }, "engine, trainer (precision)"}},
      {"csv_monitor.enabled", {Used, "false", [](C c) { return !c.csv_monitor.enabled; }, "trainer"}},
      {"csv_monitor.output_path", {Used, "\"out\"", [](C c) { return c.csv_monitor.output_path == "out"; }, "trainer"}},
      {"csv_monitor.job_name", {Used, "\"job\"", [](C c) { return c.csv_monitor.job_name == "job"; }, "trainer"}},
      {"tensorboard.enabled", {Reported, "true", nullptr, ""}},
      {"tensorboard.output_path", {Reported, "\"out\"", nullptr, ""}},
      {"tensorboard.job_name", {Reported, "\"job\"", nullptr, ""}},
      {"model.type", {Used, "\"bert\"", [](C c) { return c.model.type == "bert" && c.model.preset == "bert-tiny"; }, "trainer (which model), bert_config_of"}},
      {"model.pre_layer_norm", {Used, "true", [](C c) { return c.model.pre_layer_norm && zt::bert_config_of(c).pre_layer_norm; }, "bert_config_of (BERT only; refused with gpt)"}},
      {"model.next_sentence", {Used, "false", [](C c) { return c.model.next_sentence == false && !zt::bert_config_of(c).next_sentence; }, "bert_config_of (BERT only; refused with gpt)"}},
      {"data.mlm_probability", {Used, "0.25", [](C c) { return c.data.mlm_probability == 0.25; }, "trainer (MlmMasker; BERT only)"}},
      {"data.max_predictions", {Used, "7", [](C c) { return c.data.max_predictions == 7; }, "trainer (MlmMasker; BERT only)"}},
      {"model.preset", {Used, "\"small\"", [](C c) { return c.model.preset == "small"; }, "gpt_config_of"}},
      {"model.n_layer", {Used, "3", [](C c) { return c.model.n_layer == 3; }, "gpt_config_of"}},
      {"model.n_head", {Used, "3", [](C c) { return c.model.n_head == 3; }, "gpt_config_of"}},
      {"model.n_embd", {Used, "48", [](C c) { return c.model.n_embd == 48; }, "gpt_config_of"}},
      {"model.vocab_size", {Used, "300", [](C c) { return c.model.vocab_size == 300; }, "gpt_config_of"}},
      {"model.context_length", {Used, "64", [](C c) { return c.model.context_length == 64; }, "gpt_config_of"}},
      {"model.dropout", {Used, "0.5", [](C c) { return c.model.dropout == 0.5; }, "gpt_config_of"}},
      {"model.loss_chunk_tokens", {Used, "512", [](C c) { return c.model.loss_chunk_tokens == 512; }, "gpt_config_of, estimate"}},
      {"model.init_from", {Used, "\"hf/gpt2\"", [](C c) { return c.model.init_from == "hf/gpt2"; }, "trainer (Engine::load_weights), export --init"}},
      {"model.n_kv_head", {Used, "1", [](C c) { return c.model.n_kv_head == 1 && zt::llama_config_of(c).num_key_value_heads == 1; }, "llama_config_of (Llama only; refused with gpt, bert)"}},
      {"model.intermediate_size", {Used, "96", [](C c) { return zt::llama_config_of(c).intermediate_size == 96; }, "llama_config_of (Llama only; refused with gpt, bert)"}},
      {"model.config_from", {Used, "\"hf/llama\"", [](C c) { return c.model.config_from == "hf/llama"; }, "llama_config_of: trainer, export --init (Llama only)"}},
      {"data.source", {Used, "\"text\"", [](C c) { return c.data.source == "text"; }, "trainer (load_data)"}},
      {"data.path", {Used, "\"p\"", [](C c) { return c.data.path == "p"; }, "trainer (text, bin; refused for embedded)"}},
      {"data.val_path", {Used, "\"v\"", [](C c) { return c.data.val_path == "v"; }, "trainer (bin only; refused otherwise)"}},
      {"data.val_fraction", {Used, "0.5", [](C c) { return c.data.val_fraction == 0.5; }, "trainer (split)"}},
      {"data.sequence_length", {Used, "16", [](C c) { return c.data.sequence_length == 16; }, "trainer, estimate"}},
      {"data.tokenizer", {Used, "\"tok\"", [](C c) { return c.data.tokenizer == "tok"; }, "trainer (load_tokenized_corpus, load_finetune_examples)"}},
      {"data.cache_dir", {Used, "\"cache\"", [](C c) { return c.data.cache_dir == "cache"; }, "trainer (load_tokenized_corpus)"}},
      {"data.eos_token", {Used, "\"<eos>\"", [](C c) { return c.data.eos_token == "<eos>"; }, "trainer (jsonl documents, fine-tuning pairs)"}},
      {"data.chat_template", {Used, "\"chatml\"", [](C c) { return c.data.chat_template == "chatml"; }, "trainer (load_finetune_examples)"}},
      {"data.pack", {Used, "true", [](C c) { return c.data.pack; }, "trainer (packed FinetuneSampler rows, the decoders' segments)"}},
      {"train.steps", {Used, "70", [](C c) { return c.train.steps == 70; }, "trainer"}},
      {"train.seed", {Used, "9", [](C c) { return c.train.seed == 9; }, "trainer"}},
      {"train.eval_interval", {Used, "9", [](C c) { return c.train.eval_interval == 9; }, "trainer"}},
      {"train.eval_iters", {Used, "9", [](C c) { return c.train.eval_iters == 9; }, "trainer (noted when eval_interval 0)"}},
      {"train.threads", {Used, "3", [](C c) { return c.train.threads == 3; }, "trainer (runtime settings)"}},
      {"train.log_dir", {Used, "\"logs\"", [](C c) { return c.train.log_dir == "logs"; }, "trainer, CLI launch"}},
      {"train.retain_freed_memory", {Used, "\"never\"", [](C c) { return c.train.retain_freed_memory == "never"; }, "runtime"}},
      {"train.cpu_half_precision", {Used, "\"always\"", [](C c) { return c.train.cpu_half_precision == "always"; }, "trainer (precision on a CPU without 16-bit units)"}},
      {"activation_checkpointing.policy", {Used, "\"selective\"", [](C c) { return c.activation_checkpointing.policy == "selective"; }, "trainer (GPT checkpointing), estimate"}},
      {"activation_checkpointing.partition_activations", {Used, "false", [](C c) { return !c.activation_checkpointing.partition_activations; }, "trainer (the GPT's checkpoints over its tensor group), estimate"}},
      {"activation_checkpointing.cpu_checkpointing", {Used, "true", [](C c) { return c.activation_checkpointing.cpu_checkpointing; }, "trainer (GPT checkpointing)"}},
      {"activation_checkpointing.contiguous_memory_optimization", {Used, "true", [](C c) { return c.activation_checkpointing.contiguous_memory_optimization; }, "trainer (GPT checkpointing)"}},
      {"activation_checkpointing.synchronize_checkpoint_boundary", {Used, "true", [](C c) { return c.activation_checkpointing.synchronize_checkpoint_boundary; }, "trainer (GPT checkpointing)"}},
      {"activation_checkpointing.profile", {Used, "true", [](C c) { return c.activation_checkpointing.profile; }, "trainer (summary)"}},
      {"activation_checkpointing.number_checkpoints", {Used, "3", [](C c) { return c.activation_checkpointing.number_checkpoints == 3; }, "trainer (GPT checkpointing)"}},
      {"comm.timeout_seconds", {Used, "9.0", [](C c) { return c.comm.timeout_seconds == 9.0; }, "trainer (communicator)"}},
      {"prescale_gradients", {Used, "true", [](C c) { return c.averaging.prescale_gradients; }, "engine (gradient reducer: divided before the sum)"}},
      {"gradient_predivide_factor", {Used, "2.0", [](C c) { return c.averaging.gradient_predivide_factor == 2.0; }, "engine (gradient reducer, step's unscale)"}},
      {"comms_logger.enabled", {Used, "true", [](C c) { return c.comms_logger.enabled; }, "trainer (communicator's comms logger)"}},
      {"comms_logger.verbose", {Used, "true", [](C c) { return c.comms_logger.verbose; }, "comms logger (a line per collective)"}},
      {"comms_logger.prof_all", {Used, "false", [](C c) { return !c.comms_logger.prof_all; }, "comms logger (which operations)"}},
      {"comms_logger.debug", {Used, "true", [](C c) { return c.comms_logger.debug; }, "comms logger (caller labels)"}},
      {"comms_logger.prof_ops", {Used, "[\"all_reduce\"]", [](C c) { return c.comms_logger.prof_ops == std::vector<std::string>{"all_reduce"}; }, "comms logger (which operations)"}},
      {"flops_profiler.enabled", {Used, "true", [](C c) { return c.flops_profiler.enabled; }, "trainer (flops profile)"}},
      {"flops_profiler.recompute_fwd_factor", {Used, "0.5", [](C c) { return c.flops_profiler.recompute_fwd_factor == 0.5; }, "flops profile (DeepSpeed's FLOPS figure)"}},
      {"flops_profiler.profile_step", {Used, "3", [](C c) { return c.flops_profiler.profile_step == 3; }, "trainer (the step profiled)"}},
      {"flops_profiler.module_depth", {Used, "2", [](C c) { return c.flops_profiler.module_depth == 2; }, "flops profile (breakdown depth)"}},
      {"flops_profiler.top_modules", {Used, "3", [](C c) { return c.flops_profiler.top_modules == 3; }, "flops profile (modules per depth)"}},
      {"flops_profiler.detailed", {Used, "false", [](C c) { return !c.flops_profiler.detailed; }, "flops profile (per-module tree)"}},
      {"flops_profiler.output_file", {Used, "\"f.txt\"", [](C c) { return c.flops_profiler.output_file == "f.txt"; }, "trainer (where the profile goes)"}},
  };
  // Values some keys need besides themselves to be accepted.
  const std::map<std::string, std::vector<std::string>> context = {
      {"zero_optimization.zero_hpz_partition_size", {"zero_optimization.stage=3"}},
      {"optimizer.params.min_coeff", {"optimizer.type=\"Lamb\""}},
      {"optimizer.params.max_coeff", {"optimizer.type=\"Lamb\""}},
      {"optimizer.params.momentum", {"optimizer.type=\"SGD\""}},
      {"optimizer.params.dampening", {"optimizer.type=\"SGD\""}},
      {"optimizer.params.nesterov", {"optimizer.type=\"SGD\"", "optimizer.params.momentum=0.9"}},
      {"scheduler.params.warmup_min_lr", {"scheduler.type=\"WarmupLR\""}},
      {"scheduler.params.warmup_max_lr", {"scheduler.type=\"WarmupLR\""}},
      {"scheduler.params.warmup_num_steps", {"scheduler.type=\"WarmupLR\""}},
      {"scheduler.params.warmup_type", {"scheduler.type=\"WarmupLR\""}},
      {"scheduler.params.total_num_steps", {"scheduler.type=\"WarmupCosineLR\"", "scheduler.params.warmup_num_steps=5"}},
      {"data.path", {"data.source=\"text\""}},
      {"data.tokenizer", {"data.source=\"text\"", "data.path=\"p\""}},
      {"data.cache_dir", {"data.source=\"text\"", "data.path=\"p\"", "data.tokenizer=\"t\""}},
      {"data.eos_token", {"data.source=\"text\"", "data.path=\"p\"", "data.tokenizer=\"t\""}},
      {"data.chat_template", {"data.source=\"finetune\"", "data.path=\"p\"", "data.tokenizer=\"t\""}},
      {"data.pack", {"data.source=\"finetune\"", "data.path=\"p\"", "data.tokenizer=\"t\""}},
      {"model.pre_layer_norm", {"model.type=\"bert\""}},
      {"model.n_kv_head", {"model.type=\"llama\""}},
      {"model.intermediate_size", {"model.type=\"llama\""}},
      {"model.config_from", {"model.type=\"llama\""}},
      {"model.next_sentence", {"model.type=\"bert\""}},
      {"data.mlm_probability", {"model.type=\"bert\""}},
      {"data.max_predictions", {"model.type=\"bert\""}},
      {"data.source", {"data.path=\"p\""}},
      {"gradient_accumulation_steps", {"train_micro_batch_size_per_gpu=2"}},
      {"scheduler.params.cos_min_ratio", {"scheduler.type=\"WarmupCosineLR\"", "scheduler.params.warmup_num_steps=5"}},
      {"scheduler.params.warmup_min_ratio", {"scheduler.type=\"WarmupCosineLR\"", "scheduler.params.warmup_num_steps=5"}},
      {"scheduler.params.lr_range_test_min_lr", {"scheduler.type=\"LRRangeTest\""}},
      {"scheduler.params.lr_range_test_step_size", {"scheduler.type=\"LRRangeTest\""}},
      {"scheduler.params.lr_range_test_step_rate", {"scheduler.type=\"LRRangeTest\""}},
      {"scheduler.params.lr_range_test_staircase", {"scheduler.type=\"LRRangeTest\""}},
      {"data.val_path", {"data.source=\"bin\"", "data.path=\"t\""}},
      {"optimizer.params.max_grad_norm", {"optimizer.type=\"Lamb\""}},
      {"optimizer.params.eps_inside_sqrt", {"optimizer.type=\"Lamb\""}},
      // A report inside a block switched off is not ignored by zerotrain any more than by DeepSpeed.
      {"tensorboard.output_path", {"tensorboard.enabled=true"}},
      {"tensorboard.job_name", {"tensorboard.enabled=true"}},
      {"wandb.group", {"wandb.enabled=true"}},
      {"wandb.team", {"wandb.enabled=true"}},
      {"wandb.project", {"wandb.enabled=true"}},
      {"comet.samples_log_interval", {"comet.enabled=true"}},
      {"comet.project", {"comet.enabled=true"}},
      {"comet.workspace", {"comet.enabled=true"}},
      {"comet.api_key", {"comet.enabled=true"}},
      {"comet.experiment_name", {"comet.enabled=true"}},
      {"comet.experiment_key", {"comet.enabled=true"}},
      {"comet.mode", {"comet.enabled=true"}},
      {"comet.online", {"comet.enabled=true"}},
  };
  // The offload keys, with the tier they configure switched on (each key then overrides its own).
  std::map<std::string, std::vector<std::string>> with_tier = context;
  const std::vector<std::string> nvme_optimizer = {"zero_optimization.stage=1",
                                                   "zero_optimization.offload_optimizer.device=\"nvme\"",
                                                   "zero_optimization.offload_optimizer.nvme_path=\"d\""};
  const std::vector<std::string> nvme_param = {"zero_optimization.stage=3",
                                               "zero_optimization.offload_param.device=\"nvme\"",
                                               "zero_optimization.offload_param.nvme_path=\"d\""};
  for (const auto& [key, entry] : table) {
    if (key.starts_with("zero_optimization.offload_param.")) with_tier[key] = nvme_param;
    else if (key.starts_with("zero_optimization.offload_optimizer.") || key.starts_with("aio.") ||
             key == "zero_optimization.sub_group_size")
      with_tier[key] = nvme_optimizer;
  }
  // The OneCycle keys with OneCycle and its two required bounds (each key then replaces its own).
  for (const auto& [key, entry] : table)
    if (key.starts_with("scheduler.params.cycle_") || key.starts_with("scheduler.params.decay_"))
      with_tier[key] = {"scheduler.type=\"OneCycle\"", "scheduler.params.cycle_min_lr=0.1",
                        "scheduler.params.cycle_max_lr=1.0"};
  // Gradients on NVMe need sharded gradients.
  with_tier["zero_optimization.offload_optimizer.nvme_gradients"].front() = "zero_optimization.stage=2";
  // The context's overrides with `key` set to `value` (the context may set that key already: a
  // key is given once on a command line).
  auto with_value = [](std::vector<std::string> overrides, const std::string& key, const std::string& value) {
    std::erase_if(overrides, [&](const std::string& o) { return o.starts_with(key + "="); });
    overrides.push_back(key + "=" + value);
    return overrides;
  };
  std::set<std::string> schema_keys;
  for (const cd::Leaf& leaf : cd::leaves()) {
    schema_keys.insert(leaf.path);
    SCOPED_TRACE(leaf.path);
    auto it = table.find(leaf.path);
    if (it == table.end()) {
      ADD_FAILURE() << "schema key '" << leaf.path << "' is not classified: say which code reads it, or reserve it";
      continue;
    }
    const Entry& entry = it->second;
    std::vector<std::string> context_of;
    if (auto c = context.find(leaf.path); c != context.end()) context_of = c->second;
    if (entry.behaviour == Noted || entry.behaviour == Reported) {
      EXPECT_TRUE(leaf.supported);
      EXPECT_EQ(leaf.status, entry.behaviour == Noted ? cd::Status::Inert : cd::Status::Reporting);
      const std::vector<std::string> overrides = with_value(context_of, leaf.path, entry.value);
      const std::optional<TrainConfig> parsed = parse_or_fail(overrides);
      if (!parsed) continue;
      const TrainConfig& config = *parsed;
      if (entry.behaviour == Noted) {
        const std::string expected = leaf.path + " has no effect in zerotrain: ";
        EXPECT_TRUE(std::any_of(config.notes.begin(), config.notes.end(),
                                [&](const std::string& n) { return n.starts_with(expected); }))
            << "no note for it";
      } else {
        EXPECT_NE(std::find(config.ignored_keys.begin(), config.ignored_keys.end(), leaf.path),
                  config.ignored_keys.end())
            << "not named as ignored";
      }
      continue;
    }
    if (entry.behaviour == Reserved) {
      EXPECT_FALSE(leaf.supported) << "listed as reserved but accepted with any value";
      json other = leaf.kind == cd::Kind::Bool ? json(!leaf.def.get<bool>())
                   : leaf.def.is_number() && leaf.hi && leaf.def.get<double>() + 1 > *leaf.hi
                       ? json(leaf.def.get<double>() / 2)
                   : leaf.def.is_number() ? json(leaf.def.get<double>() + 1)
                   : leaf.kind == cd::Kind::Int ? json(5)
                                                : json("x");
      if (!leaf.choices.empty()) other = leaf.choices.back();
      const std::vector<std::string> overrides =
          with_value(context_of, leaf.path, entry.value.empty() ? other.dump() : entry.value);
      expect_one_line_error(any_error_of([&] { parse_config("{}", overrides, 1); }),
                            leaf.path + " = ");
      expect_one_line_error(any_error_of([&] { parse_config("{}", overrides, 1); }), "is not implemented");
      continue;
    }
    EXPECT_TRUE(leaf.supported);
    std::vector<std::string> overrides;
    if (auto c = with_tier.find(leaf.path); c != with_tier.end()) overrides = c->second;
    overrides = with_value(overrides, leaf.path, entry.value);
    const std::optional<TrainConfig> config = parse_or_fail(overrides);
    if (!config) continue;
    EXPECT_TRUE(entry.arrived(*config)) << "the value does not reach TrainConfig (read by: " << entry.reader << ")";
  }
  for (const auto& [key, entry] : table)
    EXPECT_TRUE(schema_keys.count(key)) << key << " is no longer in the schema";
}

TEST(ConfigAudit, DataKeysTheSourceNeverReadsAreRefused) {
  expect_one_line_error(error_of(R"({"data": {"path": "train.txt"}})"),
                        "data.path: not read when data.source is \"embedded\"");
  expect_one_line_error(error_of(R"({"data": {"source": "text", "path": "a.txt", "val_path": "b.txt"}})"),
                        "data.val_path: read only when data.source is \"bin\", found \"text\"");
  expect_one_line_error(error_of(R"({"data": {"source": "bin", "path": "a.bin", "val_path": "b.bin", "val_fraction": 0.2}})"),
                        "data.val_fraction: not used when data.val_path names the held-out file");
  EXPECT_NO_THROW(parse_config(R"({"data": {"source": "bin", "path": "a.bin", "val_path": "b.bin"}})", {}, 1));
}

// tensor_parallel.autotp_size: a divisor of the world; the batch keys count data-parallel ranks
// (as DeepSpeed's), and the GPT's heads and vocabulary must split evenly.
TEST(ConfigValidation, TensorParallelSizeDividesTheWorldAndTheBatchCountsDataParallelRanks) {
  const TrainConfig c = parse_config(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
                                         "tensor_parallel": {"autotp_size": 2}})",
                                     {}, 4);
  EXPECT_EQ(c.tensor_parallel, 2);
  EXPECT_EQ(c.data_parallel_size(), 2);
  EXPECT_EQ(c.train_batch_size, 12);
  EXPECT_EQ(parse_config(R"({"tensor_parallel": {"autotp_size": 0}})", {}, 4).tensor_parallel, 1);
  expect_one_line_error(any_error_of([] { parse_config(R"({"tensor_parallel": {"autotp_size": 3}})", {}, 4); }),
                        "tensor_parallel.autotp_size: expected a divisor of the world size 4, found 3");
  expect_one_line_error(
      any_error_of([] { parse_config(R"({"train_batch_size": 3, "tensor_parallel": {"autotp_size": 2}})", {}, 4); }),
      "train_batch_size 3 is not divisible by the data-parallel size 2 (world size 4 / tensor_parallel.autotp_size 2)");
  expect_one_line_error(
      any_error_of([] { parse_config(R"({"model": {"n_head": 3, "n_embd": 96}, "tensor_parallel": {"autotp_size": 2}})", {}, 2); }),
      "model.n_head: expected a multiple of tensor_parallel.autotp_size 2");
  // BERT splits too (its heads and vocabulary); the Llama does not yet.
  EXPECT_EQ(parse_config(R"({"model": {"type": "bert", "preset": "bert-tiny"}, "tensor_parallel": {"autotp_size": 2}})",
                         {}, 2)
                .tensor_parallel,
            2);
  expect_one_line_error(
      any_error_of([] {
        parse_config(R"({"model": {"type": "bert", "preset": "bert-tiny", "vocab_size": 261}, "tensor_parallel": {"autotp_size": 2}})",
                     {}, 2);
      }),
      "model.vocab_size: expected a multiple of tensor_parallel.autotp_size 2");
  // The Llama's kv heads split too.
  EXPECT_EQ(parse_config(R"({"model": {"type": "llama", "preset": "llama-tiny"}, "tensor_parallel": {"autotp_size": 2}})",
                         {}, 2)
                .tensor_parallel,
            2);
  expect_one_line_error(
      any_error_of([] {
        parse_config(R"({"model": {"type": "llama", "preset": "llama-tiny", "n_kv_head": 1}, "tensor_parallel": {"autotp_size": 2}})",
                     {}, 2);
      }),
      "model.n_kv_head: expected a multiple of tensor_parallel.autotp_size 2");
  // partition_activations splits what full recomputation keeps: with another policy it is noted.
  const TrainConfig partitioned = parse_config(
      R"({"activation_checkpointing": {"partition_activations": true, "policy": "full"}, "tensor_parallel": {"autotp_size": 2}})",
      {}, 2);
  EXPECT_TRUE(partitioned.activation_checkpointing.partition_activations);
  EXPECT_TRUE(partitioned.notes.empty());
  const TrainConfig selective = parse_config(
      R"({"activation_checkpointing": {"partition_activations": true, "policy": "selective"}, "tensor_parallel": {"autotp_size": 2}})",
      {}, 2);
  ASSERT_EQ(selective.notes.size(), 1u);
  EXPECT_NE(selective.notes[0].find("policy \"selective\" keeps none"), std::string::npos) << selective.notes[0];
}

// zero_hpz_partition_size: stage 3 only, a divisor of the world size; 0 and 1 mean none.
TEST(ConfigValidation, SecondaryPartitionNeedsStageThreeAndADivisorOfTheWorld) {
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})", {}, 4)
                .zero.hpz_partition_size,
            2);
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})", {}, 4)
                .zero.hpz_partition_size,
            4);
  EXPECT_NO_THROW(parse_config(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 1}})", {}, 4));
  expect_one_line_error(
      any_error_of([] { parse_config(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})", {}, 4); }),
      "zero_optimization.zero_hpz_partition_size: expected 0 or 1 at zero_optimization.stage 2 (the secondary "
      "partition holds stage-3 parameter shards), found 2");
  expect_one_line_error(
      any_error_of([] { parse_config(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})", {}, 4); }),
      "zero_optimization.zero_hpz_partition_size: expected a divisor of the world size 4 (groups of consecutive "
      "ranks), found 3");
  expect_one_line_error(
      any_error_of([] { parse_config(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": -1}})", {}, 4); }),
      "zero_optimization.zero_hpz_partition_size");
}

// A key set twice on the command line is refused, as a duplicate key in a file is, also when a
// whole block sets it again.
TEST(ConfigOverrides, AKeySetTwiceIsRefused) {
  auto message_of = [](const std::vector<std::string>& overrides) -> std::string {
    try {
      parse_config("{}", overrides, 1);
    } catch (const zt::ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message_of({"train.steps=3", "train.steps=4"}),
            "--set train.steps: given twice on the command line ('train.steps=3' and 'train.steps=4'); expected each "
            "key once");
  EXPECT_NE(message_of({"optimizer.params.lr=0.1", "optimizer.params={\"lr\": 0.2}"})
                .find("--set optimizer.params.lr: given twice"),
            std::string::npos);
  EXPECT_EQ(parse_config("{}", {"train.steps=3", "optimizer.params.lr=0.1"}, 1).train.steps, 3);
}

TEST(ConfigAudit, KeysWithoutEffectHereAreNoted) {
  EXPECT_TRUE(parse_config("", {}, 1).notes.empty());
  const std::string root = ZT_SOURCE_DIR;
  for (const char* name : {"demo.json", "tiny.json", "zero2.json"})
    EXPECT_TRUE(zt::load_config(root + "/configs/" + name, {}, 2).notes.empty()) << name;
  const TrainConfig c = parse_config(
      R"({"fp16": {"enabled": false, "loss_scale_window": 50}, "zero_optimization": {"stage": 1,
          "stage3_max_live_parameters": 10}, "train": {"eval_iters": 3}, "csv_monitor": {"enabled": false,
          "job_name": "j"}})",
      {}, 1);
  const std::vector<std::string> expected = {
      "fp16.loss_scale_window has no effect: fp16.enabled is false (the loss scaler runs only in fp16)",
      "zero_optimization.stage3_max_live_parameters has no effect: zero_optimization.stage is 1 (it applies to stage 3)",
      "train.eval_iters has no effect: train.eval_interval is 0 (no evaluation runs)",
      "csv_monitor.job_name has no effect: csv_monitor.enabled is false"};
  EXPECT_EQ(c.notes, expected);
  EXPECT_TRUE(parse_config(R"({"fp16": {"enabled": true, "loss_scale_window": 50}})", {}, 1).notes.empty());
}

// --- ZeRO-Offload / ZeRO-Infinity keys (zero_optimization.offload_*, sub_group_size, aio).

TEST(ConfigOffload, ValuesArriveWithDeepSpeedDefaults) {
  const TrainConfig d = parse_config("", {}, 1);
  EXPECT_EQ(d.zero.offload_optimizer.device, zt::OffloadDevice::None);
  EXPECT_EQ(d.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(d.zero.offload_optimizer.ratio, 1.0);
  EXPECT_FALSE(d.zero.offload_optimizer.delayed_update);
  EXPECT_EQ(d.zero.offload_optimizer.delayed_update_after, 40);
  EXPECT_FALSE(d.zero.offload_optimizer.nvme_gradients);
  EXPECT_EQ(d.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(d.zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(d.zero.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(d.zero.sub_group_size, 1'000'000'000);
  EXPECT_EQ(d.aio.block_size, 1 << 20);
  EXPECT_EQ(d.aio.queue_depth, 8);
  EXPECT_EQ(d.aio.thread_count, 1);
  EXPECT_FALSE(d.aio.single_submit);
  EXPECT_TRUE(d.aio.overlap_events);
  EXPECT_EQ(d.resolved.at("zero_optimization.offload_param.nvme_path"), "null");

  // A DeepSpeed ZeRO-Infinity configuration, as its documentation writes it (5e8 as floats).
  const TrainConfig c = parse_config(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4,
                            "pipeline_read": true, "pipeline_write": false, "ratio": 0.25,
                            "delayed_update": true, "delayed_update_after": 3},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme/p", "buffer_count": 6,
                        "buffer_size": 1e8, "max_in_cpu": 1e9}},
      "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": true,
              "overlap_events": false}})",
                                     {}, 2);
  EXPECT_EQ(c.zero.sub_group_size, 100'000'000);
  EXPECT_EQ(c.zero.offload_optimizer.device, zt::OffloadDevice::Nvme);
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_FALSE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 0.25);
  EXPECT_TRUE(c.zero.offload_optimizer.delayed_update);
  EXPECT_EQ(c.zero.offload_optimizer.delayed_update_after, 3);
  EXPECT_EQ(c.zero.offload_param.device, zt::OffloadDevice::Nvme);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/local_nvme/p");
  EXPECT_EQ(c.zero.offload_param.buffer_count, 6);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(c.aio.block_size, 262144);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.thread_count, 2);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_TRUE(c.notes.empty()) << c.notes.front();
  EXPECT_EQ(c.sources.at("zero_optimization.offload_optimizer.ratio"), ValueSource::File);
  // Overrides reach the same fields, and "cpu" at every stage from 1.
  for (int stage : {1, 2, 3}) {
    const TrainConfig o = parse_config("{}", {"zero_optimization.stage=" + std::to_string(stage),
                                               "zero_optimization.offload_optimizer.device=cpu"}, 1);
    EXPECT_EQ(o.zero.offload_optimizer.device, zt::OffloadDevice::Cpu);
  }
  EXPECT_STREQ(zt::to_string(zt::OffloadDevice::Nvme), "nvme");
}

TEST(ConfigOffload, ImpossibleCombinationsAreRefusedNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "d"}}})",
       "zero_optimization.offload_optimizer.device: expected \"none\" at zero_optimization.stage 0 (offloading "
       "optimizer states needs ZeRO stage 1, 2 or 3), found \"nvme\""},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})",
       "zero_optimization.offload_optimizer.nvme_path: expected a directory for the nvme tier (device is \"nvme\"), "
       "found nothing (the key is not given)"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": null}}})",
       "zero_optimization.offload_optimizer.nvme_path: expected a directory for the nvme tier (device is \"nvme\"), "
       "found null"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""}}})",
       "zero_optimization.offload_param.nvme_path: expected a directory for the nvme tier (device is \"nvme\"), "
       "found \"\""},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"delayed_update": true}}})",
       "zero_optimization.offload_optimizer.delayed_update: true needs offload_optimizer.device \"cpu\" or "
       "\"nvme\""},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "d", "ratio": 0}}})",
       "zero_optimization.offload_optimizer.ratio: expected a number in (0, 1], found 0"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "d", "ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio: expected a number in (0, 1], found 1.5"},
      {R"({"zero_optimization": {"offload_optimizer": {"delayed_update_after": -1}}})",
       "zero_optimization.offload_optimizer.delayed_update_after: expected a non-negative integer, found -1"},
      {R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "d", "nvme_gradients": true}}})",
       "zero_optimization.offload_optimizer.nvme_gradients: true needs sharded gradients (stage 2 or 3), found stage 1"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "d", "nvme_gradients": true, "delayed_update": true}}})",
       "zero_optimization.offload_optimizer.nvme_gradients: true cannot be combined with delayed_update"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
       "zero_optimization.offload_optimizer.device: expected one of \"none\", \"cpu\", \"nvme\", found \"disk\""},
      {R"({"zero_optimization": {"offload_param": {"buffer_size": 0}}})",
       "zero_optimization.offload_param.buffer_size: expected a positive integer, found 0"},
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth: expected an integer in [1, 65536], found 0"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    expect_one_line_error(any_error_of([&] { parse_config(text, {}, 2); }), expected);
  }
  // Parameter offload below stage 3: DeepSpeed ignores it, and zerotrain too, with a note.
  const TrainConfig below = parse_config("{}", {"zero_optimization.stage=2", "zero_optimization.offload_param.device=nvme",
                                                "zero_optimization.offload_param.nvme_path=d"},
                                         1);
  EXPECT_EQ(below.zero.offload_param.device, zt::OffloadDevice::None);
  ASSERT_FALSE(below.notes.empty());
  EXPECT_EQ(below.notes[0],
            "zero_optimization.offload_param.device has no effect: zero_optimization.stage is 2 (parameters are "
            "offloaded only at stage 3, where they are sharded; DeepSpeed ignores it too)");
}

TEST(ConfigOffload, KeysWithoutEffectAreNoted) {
  auto notes_of = [](const std::string& text) { return parse_config(text, {}, 1).notes; };
  const std::string O = "zero_optimization.offload_optimizer.", P = "zero_optimization.offload_param.";
  // No tier: every other key of its block, sub_group_size and aio.
  EXPECT_EQ(notes_of(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e6,
      "offload_optimizer": {"device": "none", "nvme_path": "d", "pin_memory": true, "buffer_count": 8,
                            "pipeline_read": true, "pipeline_write": true, "fast_init": true, "ratio": 0.5,
                            "delayed_update": false, "delayed_update_after": 2, "nvme_gradients": true},
      "offload_param": {"nvme_path": "d", "pin_memory": true, "buffer_count": 2, "buffer_size": 10,
                        "max_in_cpu": 0}},
      "aio": {"block_size": 4096, "thread_count": 2}})"),
            (std::vector<std::string>{
                O + "nvme_path has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "pin_memory has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "buffer_count has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "pipeline_read has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "pipeline_write has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "fast_init has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "ratio has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "delayed_update has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "delayed_update_after has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                O + "nvme_gradients has no effect: zero_optimization.offload_optimizer.device is \"none\"",
                P + "nvme_path has no effect: zero_optimization.offload_param.device is \"none\"",
                P + "pin_memory has no effect: zero_optimization.offload_param.device is \"none\"",
                P + "buffer_count has no effect: zero_optimization.offload_param.device is \"none\"",
                P + "buffer_size has no effect: zero_optimization.offload_param.device is \"none\"",
                P + "max_in_cpu has no effect: zero_optimization.offload_param.device is \"none\"",
                "zero_optimization.sub_group_size has no effect: zero_optimization.offload_optimizer.device is not "
                "\"nvme\" (sub-groups are the unit the nvme tier reads, steps and writes)",
                "aio.block_size has no effect: no tier is on nvme (zero_optimization.offload_optimizer.device and "
                "offload_param.device are not \"nvme\")",
                "aio.thread_count has no effect: no tier is on nvme (zero_optimization.offload_optimizer.device and "
                "offload_param.device are not \"nvme\")"}));

  // The cpu tiers: the nvme keys and ratio always; the device itself (unless the step is delayed)
  // and pinning only with parameters on the CPU (cpu_device_notes: a GPU run prints none of them).
  const TrainConfig cpu = parse_config(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true, "ratio": 0.5, "buffer_count": 2,
                            "fast_init": true, "delayed_update_after": 3},
      "offload_param": {"device": "cpu", "pin_memory": true, "max_in_cpu": 5}}})",
                                       {}, 1);
  const std::vector<std::string> expected_cpu = {
      O + "buffer_count has no effect: zero_optimization.offload_optimizer.device is \"cpu\" (it applies to the nvme "
          "tier)",
      O + "fast_init has no effect: zero_optimization.offload_optimizer.device is \"cpu\" (it applies to the nvme tier)",
      O + "ratio has no effect: zero_optimization.offload_optimizer.device is \"cpu\": the whole optimizer state is "
          "in host memory (ratio splits it between nvme and host memory)",
      O + "delayed_update_after has no effect: zero_optimization.offload_optimizer.delayed_update is false",
      P + "max_in_cpu has no effect: zero_optimization.offload_param.device is \"cpu\" (it applies to the nvme tier)"};
  EXPECT_EQ(cpu.notes, expected_cpu);
  const std::vector<std::string> expected_cpu_device = {
      O + "device has no effect: with parameters on the CPU the optimizer state is in host memory already "
          "(\"cpu\" moves nothing; with delayed_update it still delays the step; on a GPU it moves the state and the "
          "step to host memory)",
      O + "pin_memory has no effect: with parameters on the CPU nothing is copied to a GPU (page-locked buffers only "
          "speed those copies)",
      P + "device has no effect: with parameters on the CPU the parameter shards are in host memory already "
          "(\"cpu\" moves nothing; with parameters on a GPU, the shards stay in host memory and cross at each gather)",
      P + "pin_memory has no effect: with parameters on the CPU nothing is copied to a GPU (page-locked buffers only "
          "speed those copies)"};
  EXPECT_EQ(cpu.cpu_device_notes, expected_cpu_device);
  // With the delayed update, the cpu tier does something: no note for the device.
  EXPECT_TRUE(notes_of(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu",
      "delayed_update": true, "delayed_update_after": 5}}})")
                  .empty());

  // nvme: pipelining is honoured; fast_init true changes nothing; aio and sub_group_size apply.
  EXPECT_EQ(notes_of(R"({"zero_optimization": {"stage": 2, "sub_group_size": 1e6,
      "offload_optimizer": {"device": "nvme", "nvme_path": "d", "pipeline_read": true, "pipeline_write": true,
                            "fast_init": true, "buffer_count": 2, "ratio": 0.5}},
      "aio": {"queue_depth": 4}})"),
            (std::vector<std::string>{
                O + "fast_init has no effect: zerotrain always initialises the nvme tier directly from the model, "
                    "without a host copy of the whole state"}));
  // Parameters on nvme alone: aio applies, sub_group_size does not.
  EXPECT_EQ(notes_of(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e6,
      "offload_param": {"device": "nvme", "nvme_path": "d", "buffer_size": 1e6, "max_in_cpu": 0}},
      "aio": {"block_size": 4096}})"),
            (std::vector<std::string>{
                "zero_optimization.sub_group_size has no effect: zero_optimization.offload_optimizer.device is not "
                "\"nvme\" (sub-groups are the unit the nvme tier reads, steps and writes)"}));
}

// --- The same classes through the CLI binary: exit status 2 and exactly one line on stderr,
// before anything starts (no rank is launched, nothing is written).

struct CliResult {
  int exit_code;
  std::vector<std::string> stderr_lines;
};

CliResult run_cli(const std::vector<std::string>& args, const std::string& cwd) {
  // stderr alone: the shell sends stdout to /dev/null and stderr into the captured pipe.
  std::vector<std::string> argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>&1 >/dev/null", zt::testing::cli_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = zt::testing::run_process(argv, {}, std::chrono::seconds(60), cwd);
  CliResult result{r.exit_code, {}};
  std::stringstream in(r.output);
  for (std::string line; std::getline(in, line);) result.stderr_lines.push_back(line);
  return result;
}

struct CliCase {
  std::vector<std::string> args;
  std::string expected;  // substring of the one stderr line
};

// Each case: exit status 2, exactly one stderr line naming the problem; nothing written in `dir`.
void expect_cli_refuses(const std::vector<CliCase>& cases, const std::string& dir) {
  for (const CliCase& c : cases) {
    std::string shown;
    for (const std::string& a : c.args) shown.append(" ").append(a, 0, 60);
    SCOPED_TRACE("zerotrain" + shown);
    const CliResult r = run_cli(c.args, dir);
    EXPECT_EQ(r.exit_code, 2);
    ASSERT_EQ(r.stderr_lines.size(), 1u) << (r.stderr_lines.empty() ? "" : r.stderr_lines.front());
    EXPECT_TRUE(r.stderr_lines[0].starts_with("zerotrain: error: ")) << r.stderr_lines[0];
    EXPECT_NE(r.stderr_lines[0].find(c.expected), std::string::npos) << r.stderr_lines[0];
    EXPECT_LT(r.stderr_lines[0].size(), 600u);
  }
  // Nothing was started or written: no run logs and no output files appeared.
  EXPECT_FALSE(std::filesystem::exists(dir + "/runs"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/out.safetensors"));
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir + "/" + name, std::ios::binary) << text;
  return dir + "/" + name;
}

// The tiny configuration with its run directory inside `dir`, so that a case that wrongly
// started training would leave dir/runs behind.
std::string good_config(const std::string& dir) {
  return write_file(dir, "good.json", R"({"model": {"preset": "tiny"}, "train": {"steps": 1, "log_dir": "runs"}})");
}

TEST(ConfigCli, ConfigurationFilesThatAreNotUsable) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_files");
  std::string bytes;
  for (int i = 0; i < 2048; ++i) bytes += static_cast<char>((i * 131) & 0xff);
  std::string deep(100000, '[');
  deep.append(100000, ']');
  const std::string huge = write_file(dir, "huge.json", "");
  std::filesystem::resize_file(huge, 100'000'000);  // sparse: costs no disk
  const std::string dup = write_file(dir, "dup.json", R"({"optimizer": {"params": {"lr": 1e-3, "lr": 3e-3}}})");
  expect_cli_refuses(
      {
          {{"train", dir + "/missing.json"}, "not found"},
          {{"train", write_file(dir, "empty.json", "")}, "is empty"},
          {{"train", write_file(dir, "not.json", "train: {steps: 3}")}, "invalid JSON"},
          {{"train", write_file(dir, "binary.json", bytes)}, "invalid JSON"},
          {{"train", write_file(dir, "deep.json", deep)}, "nested more than 16 levels deep"},
          {{"train", write_file(dir, "open.json", std::string(100000, '['))}, "nested more than 16 levels deep"},
          {{"train", dup}, "duplicate key 'optimizer.params.lr'"},
          {{"train", write_file(dir, "inf.json", R"({"optimizer": {"params": {"lr": 1e999}}})")}, "invalid JSON"},
          {{"train", write_file(dir, "bigint.json", R"({"train": {"steps": 1180591620717411303424}})")},
           "train.steps: expected an integer in [1, 100000000]"},
          {{"train", write_file(dir, "float.json", R"({"train": {"steps": 2.5}})")},
           "train.steps: expected an integer in [1, 100000000], found 2.5"},
          {{"train", write_file(dir, "type.json", R"({"zero_optimization": {"stage": "2"}})")},
           "zero_optimization.stage: expected an integer in [0, 3], found \"2\""},
          {{"train", huge}, "100000000 bytes, more than the 1048576 bytes"},
          {{"train", dir}, "is a directory"},
          {{"train", "/dev/zero"}, "is not a regular file"},
          {{"estimate", dup}, "duplicate key"},
          {{"estimate", write_file(dir, "window.json", R"({"fp16": {"loss_scale_window": 1099511627776}})")},
           "fp16.loss_scale_window: expected an integer in [1, 2147483647]"},
      },
      dir);
}

TEST(ConfigCli, TrainFlagsWithBadValues) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_train");
  const std::string good = good_config(dir);
  // A checkpoint whose manifest is damaged: refused before any rank starts.
  const std::string damaged_checkpoint = dir + "/damaged-checkpoint";
  std::filesystem::create_directories(damaged_checkpoint + "/step-1");
  std::ofstream(damaged_checkpoint + "/latest") << "step-1\n";
  std::ofstream(damaged_checkpoint + "/step-1/manifest.json") << "{\"format\": ";
  const std::string a_file = write_file(dir, "a_file", "x");
  expect_cli_refuses(
      {
          {{"train", good, "--nproc", "0"}, "--nproc"},
          {{"train", good, "--nproc", "-1"}, "--nproc"},
          {{"train", good, "--nproc", "abc"}, "--nproc"},
          {{"train", good, "--nproc", "99999999999"}, "--nproc"},
          {{"train", good, "--nproc", "100000"}, "--nproc"},
          {{"train", good, "--steps", "0"}, "--steps"},
          {{"train", good, "--steps", "-1"}, "--steps"},
          {{"train", good, "--steps", "abc"}, "--steps"},
          {{"train", good, "--steps", "99999999999999999999"}, "--steps"},
          {{"train", good, "--master-port", "70000"}, "--master-port"},
          {{"train", good, "--save-every", "-1"}, "--save-every: Value -1 not in range 0 to 100000000"},
          {{"train", good, "--keep-last", "-2"}, "--keep-last: Value -2 not in range 0 to 2147483647"},
          {{"train", good, "--set", "train.steps"}, "override 'train.steps': expected key.path=value"},
          {{"train", good, "--set", "=3"}, "expected key.path=value"},
          {{"train", good, "--set", "train.stepz=3"}, "did you mean 'train.steps'?"},
          {{"train", good, "--set", "train.steps=-1"}, "train.steps: expected an integer in [1, 100000000], found -1"},
          {{"train", good, "--set", "train.steps=1e999"}, "train.steps: expected an integer in [1, 100000000]"},
          {{"train", good, "--set", "optimizer.params={\"lr\": 1, \"lr\": 2}"}, "duplicate key 'lr'"},
          {{"train", good, "--set", "train.steps=3", "--set", "train.steps=4"},
           "--set train.steps: given twice on the command line ('train.steps=3' and 'train.steps=4')"},
          {{"train", good, "--steps", "3", "--set", "train.steps=4"},
           "--steps 3 and --set train.steps=4: both set train.steps"},
          {{"train", good, "--set", "train.steps=" + std::string(50000, '[') + std::string(50000, ']')},
           "nested more than 16 levels deep"},
          {{"train", good, "--summary", a_file + "/under/summary.json"}, "--summary: the path '" + a_file + "' is not a directory"},
          {{"train", good, "--summary", dir}, "--summary: expected a file path, found the directory"},
          {{"train", good, "--save-dir", a_file}, "--save-dir: expected a directory, found the file"},
          // Every output is probed before the first step (/proc refuses new files, even to root).
          {{"train", good, "--save-dir", a_file + "/checkpoints"}, "--save-dir: the path '" + a_file + "' is not a directory"},
          {{"train", good, "--save-dir", "/proc/zerotrain-checkpoints"}, "--save-dir: cannot write in '/proc'"},
          {{"train", good, "--summary", "/proc/zerotrain-summary.json"}, "--summary: cannot write in '/proc'"},
          {{"train", good, "--resume", dir + "/nothing"}, "--resume: no checkpoint"},
          {{"train", good, "--resume", damaged_checkpoint}, "manifest.json"},
          // What a rank would refuse as it starts is refused before any starts.
          {{"train", good, "--set", "model.preset=gpt-nope"}, "unknown GPT preset 'gpt-nope'"},
          {{"train", good, "--set", "model.n_embd=65"}, "model.n_embd: expected a multiple of model.n_head"},
          {{"train", good, "--set", "data.sequence_length=100000"},
           "data.sequence_length: expected at most the model's context length"},
          {{"train", good, "--set", "scheduler.type=OneCycle"}, "scheduler.params.cycle_min_lr: required for OneCycle"},
      },
      dir);
}

// `estimate` says what `train` says of a configuration: its notes and warnings, on stderr.
TEST(ConfigCli, EstimatePrintsTheConfigurationsNotesAndWarnings) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_estimate_notes");
  const std::string path = dir + "/config.json";
  std::ofstream(path) << R"({"fp16": {"enabled": false, "loss_scale_window": 50},
                             "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": true}}})";
  const CliResult cpu = run_cli({"estimate", path, "--device", "cpu"}, dir);
  EXPECT_EQ(cpu.exit_code, 0);
  auto has = [](const CliResult& r, const std::string& text) {
    return std::any_of(r.stderr_lines.begin(), r.stderr_lines.end(),
                       [&](const std::string& line) { return line == text; });
  };
  const std::string window = "zerotrain: note: fp16.loss_scale_window has no effect: fp16.enabled is false (the loss "
                             "scaler runs only in fp16)";
  const std::string pinning = "zerotrain: note: zero_optimization.offload_optimizer.pin_memory has no effect: with "
                              "parameters on the CPU nothing is copied to a GPU (page-locked buffers only speed those "
                              "copies)";
  EXPECT_TRUE(has(cpu, window));
  EXPECT_TRUE(has(cpu, pinning));
  // For GPUs pinning matters: that note is the CPU's only.
  const CliResult gpu = run_cli({"estimate", path, "--device", "cuda"}, dir);
  EXPECT_EQ(gpu.exit_code, 0);
  EXPECT_TRUE(has(gpu, window));
  EXPECT_FALSE(has(gpu, pinning));
}

TEST(ConfigCli, EstimateFlagsWithBadValues) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_estimate");
  expect_cli_refuses(
      {
          {{"estimate", "--micro-batch", "0"}, "--micro-batch: Value 0 not in range 1 to 16777216"},
          {{"estimate", "--micro-batch", "-1"}, "--micro-batch"},
          {{"estimate", "--micro-batch", "abc"}, "--micro-batch"},
          {{"estimate", "--stage", "4"}, "--stage"},
          {{"estimate", "--stage", "-1"}, "--stage"},
          {{"estimate", "--nodes", "0"}, "--nodes"},
          {{"estimate", "--nodes", "99999999999"}, "--nodes"},
          {{"estimate", "--nodes", "65536", "--devices-per-node", "65536"}, "--devices-per-node"},
          {{"estimate", "--layers", "-3"}, "--layers"},
          {{"estimate", "--hidden", "1099511627776", "--layers", "2", "--vocab", "10", "--params", "1B"}, "--hidden"},
          {{"estimate", "--params", "abc"}, "--params: expected a positive count"},
          {{"estimate", "--params", "nan"}, "--params: expected a positive count"},
          {{"estimate", "--device-memory", "-1GiB"}, "--device-memory: expected a size"},
          {{"estimate", "--headroom", "nan"}, "--headroom"},
          {{"estimate", "--precision", "fp64"}, "--precision"},
          {{"estimate", "--set", "model.n_embd=1099511627776"}, "model.n_embd: expected an integer in [0, 1048576]"},
          {{"estimate", "--set", "nonsense"}, "expected key.path=value"},
      },
      dir);
}

TEST(ConfigCli, ExportAndLaunchFlagsWithBadValues) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_export");
  expect_cli_refuses(
      {
          {{"export", dir + "/no-checkpoint", "--out", dir + "/out.safetensors"}, "no checkpoint in"},
          {{"export", dir, "--out", dir + "/no/such/dir/out.safetensors"}, "--out: the directory"},
          {{"export", dir, "--out", dir}, "--out: expected a file path, found the directory"},
          {{"export", dir, "--out", "/proc/zerotrain-model.safetensors"}, "--out: cannot write in '/proc'"},
          {{"export", dir, "--format", "hf", "--out", "/proc/zerotrain-hf"}, "--out: cannot write in '/proc'"},
          {{"export", dir, "--out", dir + "/x", "--dtype", "fp64"}, "--dtype"},
          {{"launch", "--nproc", "0", "--", "/bin/true"}, "--nproc"},
          {{"launch", "--nproc", "-1", "--", "/bin/true"}, "--nproc"},
          {{"launch", "--nproc", "abc", "--", "/bin/true"}, "--nproc"},
          {{"launch", "--nproc", "99999999999", "--", "/bin/true"}, "--nproc"},
          {{"launch", "--nproc", "5000", "--", "/bin/true"}, "--nproc"},
          {{"launch", "--nproc", "1", "--master-port", "-5", "--", "/bin/true"}, "--master-port"},
          // DeepSpeed's launcher flags without a meaning here, each refused with the equivalent.
          {{"launch", "--nproc", "1", "--hostfile", "/job/hostfile", "--", "/bin/true"}, "--nnodes N --node-rank I"},
          {{"launch", "--nproc", "1", "-i", "localhost:0,2", "--", "/bin/true"}, "CUDA_VISIBLE_DEVICES"},
          {{"launch", "--nproc", "1", "--exclude", "localhost:1", "--", "/bin/true"}, "CUDA_VISIBLE_DEVICES"},
          {{"launch", "--nproc", "1", "--launcher", "slurm", "--", "/bin/true"}, "without ssh or MPI"},
          {{"launch", "--nproc", "1", "--module", "--", "/bin/true"}, "-- python -m MODULE"},
          {{"launch", "--nproc", "1", "--force_multi", "--", "/bin/true"}, "without ssh or MPI"},
      },
      dir);
}

// DeepSpeed's launcher spellings of zerotrain launch's own options (--num_gpus, --num_nodes,
// --node_rank, --master_addr, --master_port) and the switches that describe what it does anyway.
TEST(ConfigCli, LaunchTakesDeepSpeedsSpellings) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_launch_ds");
  const CliResult r = run_cli({"launch", "--num_gpus", "2", "--num_nodes", "1", "--node_rank", "0", "--master_addr",
                               "127.0.0.1", "--no_ssh", "--no_python", "--no_local_rank", "--log-dir", dir + "/logs",
                               "--", "/bin/sh", "-c", "echo $WORLD_SIZE $LOCAL_RANK"},
                              dir);
  EXPECT_EQ(r.exit_code, 0);
  std::ifstream log(dir + "/logs/rank1.log");
  std::string line;
  std::getline(log, line);
  EXPECT_EQ(line, "2 1");
}

// A checkpoint whose manifest has the right checksum but fields of the wrong type (written by
// hand or by another version): export fails with one line and exit 2, as for any damaged input.
// Found by fuzz/manifest_fuzz; the rank file is the fuzz fixture of a real tiny checkpoint.
TEST(ConfigCli, ExportOfAMalformedManifestIsOneLine) {
  const std::string dir = zt::testing::make_temp_dir("config_cli_manifest");
  const std::string fixture = std::string(ZT_SOURCE_DIR) + "/fuzz/data/checkpoint/rank-00000-of-00001.safetensors";
  std::filesystem::create_directories(dir + "/step-1");
  std::filesystem::copy_file(fixture, dir + "/step-1/rank-00000-of-00001.safetensors");
  std::ifstream in(std::string(ZT_SOURCE_DIR) + "/fuzz/corpus/manifest_fuzz/valid.json", std::ios::binary);
  const json valid = json::parse(in);
  auto with_checksum = [](json manifest) {  // as the writer computes it: over the text with zeros
    manifest["checksum"] = "00000000";
    const std::string zeroed = manifest.dump(1);
    manifest["checksum"] = zt::crc32_hex(zeroed);
    return manifest.dump(1);
  };
  struct Variant {
    std::string name;
    std::function<void(json&)> damage;
    std::string expected;  // in the one line: the file refused
  };
  const std::vector<Variant> variants = {
      {"valid", [](json&) {}, ""},
      {"parameters are numbers", [](json& m) { m["parameters"] = json::array({1, 2}); }, "manifest.json"},
      {"files is an object", [](json& m) { m["files"] = json::object({{"a", 1}}); }, "manifest.json"},
      {"shape of strings", [](json& m) { m["parameters"][0]["shape"] = json::array({"a"}); }, "manifest.json"},
      {"scalars is a list", [](json& m) { m["scalars"] = json::array(); }, "manifest.json"},
      {"format is a number", [](json& m) { m["format"] = 3; }, "manifest.json"},
      {"shape overflows", [](json& m) { m["parameters"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; },
       "manifest.json"},
      {"shape beyond the files", [](json& m) { m["parameters"][0]["shape"] = {int64_t{1} << 40}; },
       "manifest.json"},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    json manifest = valid;
    v.damage(manifest);
    std::ofstream(dir + "/step-1/manifest.json", std::ios::binary | std::ios::trunc) << with_checksum(manifest);
    const CliResult r = run_cli({"export", dir, "--tag", "step-1", "--out", dir + "/out.safetensors"}, dir);
    if (v.expected.empty()) {  // the fixture itself exports: the damage, not the setup, fails the others
      EXPECT_EQ(r.exit_code, 0);
      EXPECT_TRUE(r.stderr_lines.empty());
      continue;
    }
    EXPECT_EQ(r.exit_code, 2);
    ASSERT_EQ(r.stderr_lines.size(), 1u);
    EXPECT_NE(r.stderr_lines[0].find(v.expected), std::string::npos) << r.stderr_lines[0];
  }
}

}  // namespace

TEST(ConfigActivationCheckpointing, BlockWithoutPolicyMeansFullAndPolicyNoneNotesTheRest) {
  const TrainConfig plain = parse_config("", {}, 1);
  EXPECT_EQ(plain.activation_checkpointing.policy, "none");
  const TrainConfig block = parse_config(R"({"activation_checkpointing": {"cpu_checkpointing": false,
      "number_checkpoints": null}})", {}, 1);
  EXPECT_EQ(block.activation_checkpointing.policy, "full");
  EXPECT_EQ(block.sources.at("activation_checkpointing.policy"), zt::ValueSource::Derived);
  EXPECT_EQ(block.activation_checkpointing.number_checkpoints, 0);
  const TrainConfig none = parse_config(R"({"activation_checkpointing": {"policy": "none", "profile": true}})", {}, 1);
  ASSERT_EQ(none.notes.size(), 1u);
  EXPECT_EQ(none.notes[0],
            "activation_checkpointing.profile has no effect: activation_checkpointing.policy is \"none\" (nothing is "
            "recomputed)");
  const TrainConfig every = parse_config(R"({"activation_checkpointing": {"policy": "selective", "number_checkpoints": 4,
      "profile": true}})", {}, 1);
  EXPECT_EQ(every.activation_checkpointing.number_checkpoints, 4);
  EXPECT_TRUE(every.activation_checkpointing.profile);
  EXPECT_TRUE(every.notes.empty());
}

// --- DeepSpeed's configuration files as published projects write them (docs/config.md).

namespace {

std::string describe_line(const TrainConfig& c, const std::string& key) {
  const std::string text = zt::describe(c);
  const auto at = text.find(key + " ");
  return at == std::string::npos ? "" : text.substr(at, text.find('\n', at) - at);
}

}  // namespace

// Every file of tests/data/deepspeed_configs is accepted at world size 2, and the warnings name
// exactly the keys it ignores.
TEST(ConfigDeepSpeedCorpus, PublishedConfigurationsAreAccepted) {
  const std::string dir = std::string(ZT_SOURCE_DIR) + "/tests/data/deepspeed_configs";
  const std::map<std::string, std::vector<std::string>> ignored = {
      {"hf_transformers_zero2.json", {}},
      {"hf_transformers_zero3.json", {}},
      {"accelerate_zero2.json", {}},
      {"llamafactory_ds_z0.json", {}},
      {"llamafactory_ds_z2.json", {}},
      {"llamafactory_ds_z2_offload.json", {}},
      {"llamafactory_ds_z3.json", {}},
      {"axolotl_zero1.json", {}},
      {"axolotl_zero3_bf16.json", {}},
      {"llava_zero2.json", {}},
      {"llava_zero3_offload.json", {}},
      {"megatron_deepspeed_gpt.json", {}},
      {"gpt_neox.json", {"min_lr", "checkpoint_activations", "partition_activations", "synchronize_each_layer"}},
      {"deepspeedexamples_cifar.json", {}},
      {"deepspeed_docs_monitors.json",
       {"tensorboard.enabled", "tensorboard.output_path", "tensorboard.job_name", "wandb.enabled", "wandb.group",
        "wandb.team", "wandb.project", "timers.throughput.synchronized"}},
      {"deepspeed_legacy_spellings.json", {"comment", "cuda_visible_devices"}},
  };
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    auto it = ignored.find(name);
    ASSERT_NE(it, ignored.end()) << "add the file's expected warnings to this test";
    TrainConfig c;
    try {
      c = zt::load_config(entry.path().string(), {}, 2);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      continue;
    }
    std::vector<std::string> got = c.ignored_keys, want = it->second;
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want);
    EXPECT_LE(c.warnings.size(), 2u);
    for (const std::string& key : want) {
      const bool named = std::any_of(c.warnings.begin(), c.warnings.end(),
                                     [&](const std::string& w) { return w.find(key) != std::string::npos; });
      EXPECT_TRUE(named) << key << " is not in a warning line";
    }
  }
  EXPECT_EQ(files, ignored.size());
}

// "Accepted" means "trains": every file of the corpus trains 2 steps of the default model on 2
// ranks through the CLI (one test per file, so that they run side by side).
std::vector<std::string> corpus_files() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(ZT_SOURCE_DIR) + "/tests/data/deepspeed_configs"))
    if (entry.path().extension() == ".json") names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class ConfigDeepSpeedCorpusTrains : public ::testing::TestWithParam<std::string> {};

TEST_P(ConfigDeepSpeedCorpusTrains, TwoStepsOnTheDefaultModel) {
  const std::string dir = zt::testing::make_temp_dir("corpus_train");
  const std::string path = std::string(ZT_SOURCE_DIR) + "/tests/data/deepspeed_configs/" + GetParam();
  const auto r = zt::testing::run_process({zt::testing::cli_path(), "train", path, "--nproc", "2", "--steps", "2",
                                           "--device", "cpu", "--set", "train.log_dir=" + dir + "/logs", "--summary",
                                           dir + "/summary.json"},
                                          {}, std::chrono::seconds(90), dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir + "/summary.json");
  const nlohmann::json summary = nlohmann::json::parse(in);
  EXPECT_EQ(summary.at("steps"), 2);
  for (const auto& loss : summary.at("losses")) EXPECT_TRUE(std::isfinite(loss.get<double>())) << summary.dump();
}

INSTANTIATE_TEST_SUITE_P(Files, ConfigDeepSpeedCorpusTrains, ::testing::ValuesIn(corpus_files()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param.substr(0, info.param.size() - 5);  // without ".json"
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(ConfigDeepSpeedCorpus, WhatTheFilesResolveTo) {
  const std::string dir = std::string(ZT_SOURCE_DIR) + "/tests/data/deepspeed_configs/";
  // Hugging Face's "auto": the hidden-size rules from the model's width (preset "tiny").
  const TrainConfig z3 = zt::load_config(dir + "hf_transformers_zero3.json", {}, 2);
  const int64_t h = zt::gpt_preset("tiny").n_embd;
  EXPECT_EQ(z3.zero.reduce_bucket_size, h * h);
  EXPECT_EQ(z3.zero.stage3_prefetch_bucket_size, static_cast<int64_t>(0.9 * static_cast<double>(h * h)));
  EXPECT_EQ(z3.zero.stage3_param_persistence_threshold, 10 * h);
  EXPECT_EQ(z3.sources.at("zero_optimization.reduce_bucket_size"), ValueSource::Auto);
  EXPECT_EQ(z3.precision, zt::Precision::FP32);
  EXPECT_EQ(z3.sources.at("bf16.enabled"), ValueSource::Auto);
  EXPECT_EQ(z3.zero.offload_param.device, zt::OffloadDevice::Cpu);
  EXPECT_NE(describe_line(z3, "zero_optimization.reduce_bucket_size").find("(auto)"), std::string::npos);
  // LLaVA spells the stage-3 key by its field name.
  const TrainConfig llava = zt::load_config(dir + "llava_zero3_offload.json", {}, 2);
  EXPECT_EQ(llava.resolved.at("zero_optimization.stage3_gather_16bit_weights_on_model_save"), "true");
  EXPECT_NE(describe_line(llava, "zero_optimization.stage3_gather_16bit_weights_on_model_save")
                .find("(file (as zero_optimization.gather_16bit_weights_on_model_save))"),
            std::string::npos)
      << zt::describe(llava);
  // The older spellings.
  const TrainConfig legacy = zt::load_config(dir + "deepspeed_legacy_spellings.json", {}, 2);
  EXPECT_EQ(legacy.precision, zt::Precision::BF16);
  EXPECT_EQ(legacy.zero.stage, 1);
  EXPECT_EQ(legacy.zero.allgather_bucket_size, 100'000'000);
  EXPECT_NE(describe_line(legacy, "bf16.enabled").find("(file (as bfloat16.enabled))"), std::string::npos);
  EXPECT_NE(describe_line(legacy, "zero_optimization.allgather_bucket_size").find("(as allgather_size)"),
            std::string::npos);
  // Megatron-DeepSpeed: the accumulation steps follow from the batch and the world size.
  EXPECT_EQ(zt::load_config(dir + "megatron_deepspeed_gpt.json", {}, 2).gradient_accumulation_steps, 2);
}

// DeepSpeed 0.19 reads aio.intra_op_parallelism (the I/O threads; older versions read
// thread_count, zerotrain's name) and aio.use_gds, and chooses a checkpoint writer under
// checkpoint.writer: the first is honoured, the second refused when true, the third noted.
TEST(ConfigDeepSpeedRules, TheAioAndCheckpointKeysOfDeepSpeed019) {
  const TrainConfig threads = parse_config(R"({"aio": {"intra_op_parallelism": 4}})", {}, 1);
  EXPECT_EQ(threads.aio.thread_count, 4);
  EXPECT_TRUE(threads.ignored_keys.empty());
  EXPECT_NE(describe_line(threads, "aio.thread_count").find("(as aio.intra_op_parallelism)"), std::string::npos)
      << zt::describe(threads);
  expect_one_line_error(error_of(R"({"aio": {"intra_op_parallelism": 4, "thread_count": 2}})"), "aio.thread_count");
  expect_one_line_error(error_of(R"({"aio": {"use_gds": true}})"), "aio.use_gds = true is not supported");
  EXPECT_NO_THROW(parse_config(R"({"aio": {"use_gds": false}})", {}, 1));
  const TrainConfig writer = parse_config(R"({"checkpoint": {"writer": {"type": "fast"}}})", {}, 1);
  EXPECT_TRUE(writer.ignored_keys.empty());
  EXPECT_TRUE(std::any_of(writer.notes.begin(), writer.notes.end(), [](const std::string& n) {
    return n.starts_with("checkpoint.writer has no effect in zerotrain: ");
  }));
}

TEST(ConfigDeepSpeedRules, UnknownKeys) {
  // Inside a block DeepSpeed validates: an error with a suggestion.
  expect_one_line_error(error_of(R"({"zero_optimization": {"stage": 2, "overlap_com": true}})"),
                        "unknown key 'zero_optimization.overlap_com' — did you mean 'zero_optimization.overlap_comm'?");
  expect_one_line_error(error_of(R"({"fp16": {"enabled": true, "loss_scael": 0}})"),
                        "unknown key 'fp16.loss_scael' — did you mean 'fp16.loss_scale'?");
  expect_one_line_error(error_of(R"({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}})"),
                        "did you mean 'zero_optimization.offload_optimizer.device'?");
  expect_one_line_error(error_of(R"({"tensorboard": {"enable": true}})"), "did you mean 'tensorboard.enabled'?");
  // No DeepSpeed version reads fp16.scale_tolerance: DeepSpeed's fp16 model refuses it.
  expect_one_line_error(error_of(R"({"fp16": {"scale_tolerance": 0.25}})"), "unknown key 'fp16.scale_tolerance'");
  // In a block DeepSpeed reads leniently an unknown key is ignored, but a near miss of one of its
  // keys is a typo: refused with the suggestion.
  expect_one_line_error(error_of(R"({"optimizer": {"type": "AdamW", "parms": {"lr": 0.5}}})"),
                        "unknown key 'optimizer.parms' — did you mean 'optimizer.params'?");
  expect_one_line_error(error_of(R"({"scheduler": {"type": "WarmupLR", "param": {"warmup_num_steps": 5}}})"),
                        "did you mean 'scheduler.params'?");
  EXPECT_EQ(parse_config(R"({"optimizer": {"type": "AdamW", "comment": "x"}})", {}, 1).ignored_keys,
            std::vector<std::string>{"optimizer.comment"});
  // At the top level DeepSpeed ignores unknown keys: one warning line.
  const TrainConfig top = parse_config(R"({"comment": "x", "cuda_visible_devices": "0", "fp16_scale_tolerance": 0})",
                                       {}, 1);
  EXPECT_EQ(top.ignored_keys, (std::vector<std::string>{"comment", "cuda_visible_devices", "fp16_scale_tolerance"}));
  ASSERT_EQ(top.warnings.size(), 1u);
  EXPECT_EQ(top.warnings[0],
            "ignored (keys DeepSpeed does not read either): comment, cuda_visible_devices, fp16_scale_tolerance");
  // ... unless it is a near miss of a known one.
  expect_one_line_error(error_of(R"({"optimiser": {"type": "Adam"}})"),
                        "unknown key 'optimiser' — did you mean 'optimizer'?");
  expect_one_line_error(error_of(R"({"gradient_cliping": 1.0})"), "did you mean 'gradient_clipping'?");
  // Blocks DeepSpeed reads with dict.get: a warning; optimizer.params (constructor arguments): an error.
  EXPECT_EQ(parse_config(R"({"activation_checkpointing": {"checkpoint_in_cpu": true}})", {}, 1).ignored_keys,
            std::vector<std::string>{"activation_checkpointing.checkpoint_in_cpu"});
  EXPECT_EQ(parse_config(R"({"aio": {"io_backend": "posix"}})", {}, 1).ignored_keys,
            std::vector<std::string>{"aio.io_backend"});
  expect_one_line_error(error_of(R"({"optimizer": {"params": {"lr_x": 1}}})"), "unknown key 'optimizer.params.lr_x'");
}

TEST(ConfigDeepSpeedRules, OtherSpellingsAreCanonical) {
  const TrainConfig bf = parse_config(R"({"bfloat16": {"enabled": true}})", {}, 1);
  EXPECT_EQ(bf.precision, zt::Precision::BF16);
  EXPECT_EQ(bf.spellings.at("bf16.enabled"), "bfloat16.enabled");
  const TrainConfig off = parse_config(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})", {}, 1);
  EXPECT_EQ(off.zero.offload_optimizer.device, zt::OffloadDevice::Cpu);
  EXPECT_NE(describe_line(off, "zero_optimization.offload_optimizer.device").find("(as zero_optimization.cpu_offload)"),
            std::string::npos);
  const TrainConfig param = parse_config(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true}})", {}, 1);
  EXPECT_EQ(param.zero.offload_param.device, zt::OffloadDevice::Cpu);
  const TrainConfig pin = parse_config(R"({"zero_optimization": {"cpu_offload_use_pin_memory": true}})", {}, 1);
  EXPECT_EQ(pin.notes.size(), 1u);
  const TrainConfig fp16_save =
      parse_config(R"({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": true}})", {}, 1);
  EXPECT_EQ(fp16_save.resolved.at("zero_optimization.stage3_gather_16bit_weights_on_model_save"), "true");
  const TrainConfig names = parse_config(
      R"({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000, "param_persistence_threshold": 7,
          "max_live_parameters": 5000}})",
      {}, 1);
  EXPECT_EQ(names.zero.stage3_prefetch_bucket_size, 1000);
  EXPECT_EQ(names.zero.stage3_param_persistence_threshold, 7);
  EXPECT_EQ(names.zero.stage3_max_live_parameters, 5000);
  EXPECT_EQ(names.spellings.at("zero_optimization.stage3_prefetch_bucket_size"),
            "zero_optimization.prefetch_bucket_size");
  EXPECT_EQ(parse_config(R"({"zero_optimization": true})", {}, 1).zero.stage, 1);
  EXPECT_EQ(parse_config(R"({"zero_optimization": false})", {}, 1).zero.stage, 0);
  // null: the default.
  const TrainConfig null = parse_config(R"({"gradient_clipping": null, "zero_optimization": {"stage": null,
      "offload_optimizer": null}})", {}, 1);
  EXPECT_EQ(null.gradient_clipping, 1.0);
  EXPECT_EQ(null.zero.stage, 0);
  EXPECT_NE(describe_line(null, "gradient_clipping").find("(file (null: the default))"), std::string::npos);
  // Both spellings of one key: an error.
  expect_one_line_error(error_of(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
                        "bfloat16 and bf16 are two spellings of one key");
  expect_one_line_error(
      error_of(R"({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})"),
      "zero_optimization.prefetch_bucket_size and zero_optimization.stage3_prefetch_bucket_size are two spellings");
  expect_one_line_error(
      error_of(R"({"zero_optimization": {"stage": 1, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})"),
      "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are two spellings of one setting");
  expect_one_line_error(error_of(R"({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true,
      "gather_16bit_weights_on_model_save": true}})"),
                        "are two spellings of one key");
}

TEST(ConfigDeepSpeedRules, AutoValues) {
  const TrainConfig c = parse_config(
      R"({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
          "eps": "auto", "weight_decay": "auto"}}, "scheduler": {"type": "WarmupDecayLR", "params": {
          "warmup_min_lr": "auto", "warmup_max_lr": 3e-4, "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"},
          "model": {"n_embd": 64}, "train": {"steps": 30}})",
      {}, 1);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.sources.at("gradient_clipping"), ValueSource::Auto);
  EXPECT_EQ(c.optimizer.lr, 3e-4);  // the warm-up's peak, the same learning rate in Hugging Face's Trainer
  EXPECT_EQ(c.sources.at("optimizer.params.lr"), ValueSource::Auto);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 2);  // the Trainer's 0, as DeepSpeed's schedulers take it
  EXPECT_EQ(c.scheduler.total_num_steps, 30);
  EXPECT_EQ(c.sources.at("scheduler.params.total_num_steps"), ValueSource::Auto);
  EXPECT_EQ(c.precision, zt::Precision::FP32);
  EXPECT_EQ(c.zero.reduce_bucket_size, 64 * 64);
  // A key of a block DeepSpeed validates: DeepSpeed drops "auto" there, which means its default.
  EXPECT_EQ(c.zero.allgather_bucket_size, 500'000'000);
  EXPECT_EQ(c.sources.at("zero_optimization.allgather_bucket_size"), ValueSource::Auto);
  EXPECT_NE(describe_line(c, "optimizer.params.lr").find("(auto)"), std::string::npos);
  // warmup_max_lr "auto" follows the optimizer's lr.
  EXPECT_EQ(parse_config(R"({"optimizer": {"params": {"lr": 2e-4}}, "scheduler": {"type": "WarmupLR",
      "params": {"warmup_max_lr": "auto"}}})", {}, 1).scheduler.warmup_max_lr, 2e-4);
  // Elsewhere "auto" is no value DeepSpeed knows.
  expect_one_line_error(error_of(R"({"steps_per_print": "auto"})"), "steps_per_print: expected");
}

TEST(ConfigDeepSpeedRules, DeepSpeedFeaturesAndTheirRefusals) {
  // Optimizers zerotrain does not implement: one line each, their parameters not reported.
  expect_one_line_error(error_of(R"({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400,
      "cuda_aware": false, "comm_backend_name": "nccl"}}})"),
                        "optimizer.type \"OneBitAdam\" is not supported: 1-bit Adam");
  expect_one_line_error(error_of(R"({"optimizer": {"type": "ZeroOneAdam"}})"), "0/1 Adam");
  expect_one_line_error(error_of(R"({"optimizer": {"type": "adagrad", "params": {"lr": 0.01}}})"),
                        "optimizer.type \"Adagrad\" is not supported: Adagrad is not implemented");
  // DeepSpeed builds any torch.optim class by its name: refused as not implemented, not unknown.
  expect_one_line_error(error_of(R"({"optimizer": {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.99}}})"),
                        "optimizer.type \"RMSprop\" is not supported: torch.optim.RMSprop is not implemented");
  // Kernel choices are accepted with a note; the math is the same.
  const TrainConfig adam = parse_config(R"({"optimizer": {"type": "Adam", "params": {"torch_adam": true,
      "fused": true, "adam_w_mode": false}}})", {}, 1);
  EXPECT_FALSE(adam.optimizer.adam_w_mode);
  EXPECT_EQ(adam.notes.size(), 2u);
  expect_one_line_error(error_of(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})"),
                        "optimizer.params.amsgrad = true is not supported: the AMSGrad variant is not implemented");
  // AdamW with adam_w_mode false: DeepSpeed runs AdamW; so does zerotrain, with a note.
  const TrainConfig adamw = parse_config(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", {}, 1);
  EXPECT_TRUE(adamw.optimizer.adam_w_mode);
  EXPECT_EQ(adamw.notes.size(), 1u);
  // Lamb's max_grad_norm: DeepSpeed zeroes it outside fp16 (a note), and it would clip in fp16 (refused).
  EXPECT_EQ(parse_config(R"({"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}})", {}, 1).notes.size(), 1u);
  expect_one_line_error(error_of(R"({"fp16": {"enabled": true}, "optimizer": {"type": "Lamb",
      "params": {"max_grad_norm": 1.0}}})"),
                        "optimizer.params.max_grad_norm = 1 is not supported in fp16");
  // Dtypes: the working precision's is accepted, another refused.
  EXPECT_NO_THROW(parse_config(R"({"bf16": {"enabled": true}, "communication_data_type": "bf16",
      "data_types": {"grad_accum_dtype": "bf16"}})", {}, 1));
  EXPECT_NO_THROW(parse_config(R"({"communication_data_type": null})", {}, 1));
  expect_one_line_error(error_of(R"({"bf16": {"enabled": true}, "communication_data_type": "fp32"})"),
                        "communication_data_type = \"fp32\" is not supported: gradient reduction in another dtype than "
                        "the working precision (bf16) is not implemented");
  expect_one_line_error(error_of(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}})"),
                        "data_types.grad_accum_dtype = \"fp32\" is not supported: gradient accumulation");
  expect_one_line_error(error_of(R"({"fp16": {"enabled": true, "auto_cast": true}})"),
                        "fp16.auto_cast = true is not supported: autocast of fp16 operations");
  // Feature blocks: accepted switched off, refused switched on.
  EXPECT_NO_THROW(parse_config(R"({"compression_training": {"weight_quantization": {"shared_parameters":
      {"enabled": false}}}, "elasticity": {"enabled": false, "max_train_batch_size": 100}})", {}, 1));
  expect_one_line_error(error_of(R"({"elasticity": {"enabled": true}})"),
                        "elasticity = {\"enabled\":true} is not supported: elastic training");
  // DeepSpeed ignores parameter offload below stage 3; so does zerotrain, with a note.
  const TrainConfig below = parse_config(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
                                         {}, 1);
  EXPECT_EQ(below.zero.offload_param.device, zt::OffloadDevice::None);
  EXPECT_FALSE(below.notes.empty());
  // Model parallelism of one: DeepSpeed's partition_activations splits nothing.
  EXPECT_FALSE(parse_config(R"({"activation_checkpointing": {"partition_activations": true}})", {}, 1).notes.empty());
  // A reporting key switched on: one warning.
  const TrainConfig tb = parse_config(R"({"tensorboard": {"enabled": true, "output_path": "tb"}})", {}, 1);
  EXPECT_EQ(tb.warnings, (std::vector<std::string>{
                             "ignored (DeepSpeed reports zerotrain does not produce): tensorboard.enabled, "
                             "tensorboard.output_path"}));
}

// docs/config.md has a row for every key of the table.
TEST(ConfigDocs, EveryKeyIsDocumented) {
  std::ifstream in(std::string(ZT_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md is missing";
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const cd::Leaf& leaf : cd::leaves())
    EXPECT_NE(text.find("`" + leaf.path + "`"), std::string::npos) << leaf.path << " is not in docs/config.md";
}

// --- model.type "bert" (docs/bert.md): its keys, the GPT's keys, its presets and positions.
TEST(ConfigBert, DefaultsToBertTinyWithThePresetsHeads) {
  const TrainConfig c = parse_config(R"({"model": {"type": "bert"}})", {}, 1);
  EXPECT_EQ(c.model.preset, "bert-tiny");
  EXPECT_EQ(c.sources.at("model.preset"), ValueSource::Derived);
  const zt::BertConfig b = zt::bert_config_of(c);
  EXPECT_EQ(b.vocab_size, 260);
  EXPECT_EQ(b.max_positions, 128);
  EXPECT_TRUE(b.next_sentence);
  EXPECT_FALSE(b.pre_layer_norm);
  EXPECT_EQ(parse_config("{}", {}, 1).model.type, "gpt");
  // The size overrides apply to the BERT: hidden and intermediate 4·hidden, positions.
  const TrainConfig o = parse_config(
      R"({"model": {"type": "bert", "preset": "bert-base", "n_layer": 1, "n_embd": 32, "n_head": 4, "context_length": 64,
          "vocab_size": 300, "dropout": 0.0, "next_sentence": false, "pre_layer_norm": true}, "data": {"sequence_length": 64}})",
      {}, 1);
  const zt::BertConfig ob = zt::bert_config_of(o);
  EXPECT_EQ(ob.n_layer, 1);
  EXPECT_EQ(ob.hidden, 32);
  EXPECT_EQ(ob.intermediate, 128);
  EXPECT_EQ(ob.n_head, 4);
  EXPECT_EQ(ob.max_positions, 64);
  EXPECT_EQ(ob.vocab_size, 300);
  EXPECT_EQ(ob.dropout, 0.0);
  EXPECT_FALSE(ob.next_sentence);
  EXPECT_TRUE(ob.pre_layer_norm);
}

TEST(ConfigBert, KeysOfTheOtherTypeArePresetsAndPositionsAreChecked) {
  for (const char* key : {"model.pre_layer_norm=true", "model.next_sentence=false", "data.mlm_probability=0.2",
                          "data.max_predictions=20"}) {
    SCOPED_TRACE(key);
    const std::string name = std::string(key).substr(0, std::string(key).find('='));
    expect_one_line_error(error_of("{}", {key}), name + ": applies to model.type \"bert\" only, found model.type \"gpt\"");
  }
  expect_one_line_error(error_of(R"({"model": {"type": "bert", "init_from": "hf/gpt2"}})"),
                        "model.init_from: applies to model.type \"gpt\" (Hugging Face GPT-2 directories) and \"llama\"");
  expect_one_line_error(error_of(R"({"model": {"type": "bert", "loss_chunk_tokens": 512}})"),
                        "model.loss_chunk_tokens: applies to model.type \"gpt\" only");
  // A GPT preset with type bert: the valid BERT presets are listed.
  const std::string unknown = error_of(R"({"model": {"type": "bert", "preset": "tiny"}})");
  expect_one_line_error(unknown, "model.preset: expected a BERT preset with model.type \"bert\"");
  EXPECT_NE(unknown.find("found \"tiny\""), std::string::npos) << unknown;
  for (const std::string& name : zt::bert_preset_names()) EXPECT_NE(unknown.find(name), std::string::npos) << unknown;
  expect_one_line_error(error_of(R"({"model": {"type": "bart"}})"), "model.type");
  expect_one_line_error(error_of(R"({"model": {"type": "bert"}, "data": {"sequence_length": 129}})"),
                        "data.sequence_length: expected at most the BERT's max_positions 128");
  EXPECT_NO_THROW(parse_config(R"({"model": {"type": "bert"}, "data": {"sequence_length": 128}})", {}, 1));
  expect_one_line_error(error_of(R"({"model": {"type": "bert", "preset": "bert-base"}, "data": {"sequence_length": 513}})"),
                        "max_positions 512");
  expect_one_line_error(error_of(R"({"model": {"type": "bert"}, "data": {"sequence_length": 4}})"),
                        "data.sequence_length: expected at least 5");
  expect_one_line_error(error_of(R"({"model": {"type": "bert", "n_head": 3}})"), "model.n_embd: expected a multiple");
  expect_one_line_error(error_of(R"({"model": {"type": "bert"}, "data": {"mlm_probability": 0}})"),
                        "data.mlm_probability");
  expect_one_line_error(error_of(R"({"model": {"type": "bert"}, "activation_checkpointing": {"policy": "auto"}})"),
                        "activation_checkpointing.policy: expected \"none\", \"selective\" or \"full\" with model.type "
                        "\"bert\", found \"auto\"");
  // The flops profiler's FLOPs model is the GPT's: noted once, not refused.
  const TrainConfig profiled =
      parse_config(R"({"model": {"type": "bert"}, "flops_profiler": {"enabled": true, "profile_step": 3}})", {}, 1);
  for (const std::string key : {"flops_profiler.enabled", "flops_profiler.profile_step"})
    EXPECT_TRUE(std::any_of(profiled.notes.begin(), profiled.notes.end(), [&](const std::string& n) {
      return n.starts_with(key + " has no effect: ");
    })) << key;
  EXPECT_TRUE(parse_config(R"({"flops_profiler": {"enabled": true}})", {}, 1).notes.empty());
}

// DeepSpeed 0.19 reads data_types.keep_in_fp32_modules ("auto" or a list of name patterns):
// accepted in both forms (inert: zerotrain's models have no buffers), anything else refused.
TEST(ConfigKeys, KeepInFp32ModulesTakesAutoOrAListOfNames) {
  for (const char* value : {R"("auto")", R"(["norm", "rotary"])", "[]"}) {
    SCOPED_TRACE(value);
    const auto c = zt::parse_config(std::string(R"({"data_types": {"keep_in_fp32_modules": )") + value + "}}", {}, 1);
    for (const std::string& w : c.warnings) EXPECT_EQ(w.find("keep_in_fp32_modules"), std::string::npos) << w;
  }
  for (const char* value : {"3", R"("everything")", "[1]"}) {
    SCOPED_TRACE(value);
    expect_one_line_error(any_error_of([&] {
                            zt::parse_config(std::string(R"({"data_types": {"keep_in_fp32_modules": )") + value + "}}",
                                             {}, 1);
                          }),
                          "data_types.keep_in_fp32_modules: expected \"auto\" or a list of strings");
  }
}

// Python's json writes Infinity and NaN (Accelerate writes steps_per_print: Infinity, DeepSpeed's
// "never"): that one key takes it, any other non-finite number is refused with its key, and the
// words inside strings or comments are left alone.
TEST(Config, StepsPerPrintInfinityMeansNeverAndOtherNonFiniteNumbersAreRefused) {
  const TrainConfig c = parse_config(
      "{\"steps_per_print\": Infinity, // Infinity in a comment\n"
      " \"zero_optimization\": {\"offload_optimizer\": {\"nvme_path\": \"/x/Infinity NaN\"}}}", {}, 1);
  EXPECT_EQ(c.steps_per_print, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, "/x/Infinity NaN");
  EXPECT_EQ(parse_config("", {"steps_per_print=Infinity"}, 1).steps_per_print, std::numeric_limits<int64_t>::max());
  auto says = [](const std::string& json, const std::string& expected) {
    const std::string message = error_of(json);
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  };
  says("{\"optimizer\": {\"params\": {\"lr\": NaN}}}", "optimizer.params.lr: expected a finite number, found NaN");
  says("{\"steps_per_print\": -Infinity}", "steps_per_print: expected a finite number, found -Infinity");
  says("{\"gradient_clipping\": Infinityx}", "invalid JSON");
}
