// Configuration: DeepSpeed defaults (design §5), the batch triple (§8.12), the support matrix
// (§8.14), overrides, sources, and one clear message per malformed input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/process.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"

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
  EXPECT_EQ(c.train.retain_freed_memory, "never");
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
  const auto F = ValueSource::File, D = ValueSource::Derived, Def = ValueSource::Default;
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
       2, 4, 2, 1, D, F, D},
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
      {R"({"completely_unrelated": 1})", {}, "unknown key 'completely_unrelated' (valid keys at the top level:"},
      {R"({"optimizer": 3})", {}, "optimizer: expected an object (a block of settings), found 3"},
      // Wrong types and ranges name the dotted key, the expectation and the value found.
      {R"({"optimizer": {"params": {"lr": "fast"}}})", {},
       "optimizer.params.lr: expected a positive number, found \"fast\""},
      {R"({"optimizer": {"params": {"lr": 0}}})", {}, "optimizer.params.lr: expected a positive number, found 0"},
      {R"({"optimizer": {"params": {"lr": -1e-3}}})", {}, "optimizer.params.lr: expected a positive number"},
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
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})", {},
       "scheduler.params.warmup_type: expected one of \"log\", \"linear\", found \"cosine\""},
      {R"({"train": {"retain_freed_memory": "sometimes"}})", {},
       "train.retain_freed_memory: expected one of \"auto\", \"always\", \"never\", found \"sometimes\""},
      {R"({"scheduler": {"type": "WarmupCosine"}})", {}, "did you mean \"WarmupCosineLR\"?"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -3}}})", {},
       "scheduler.params.warmup_num_steps: expected a non-negative integer, found -3"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}})", {},
       "scheduler.params.cos_min_ratio: not a parameter of WarmupLR"},
      {R"({"scheduler": {"params": {"warmup_num_steps": 10}}})", {}, "scheduler.type is not set"},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 50, "total_num_steps": 40}}})", {},
       "scheduler.params.total_num_steps: expected more than the warm-up steps (50) for WarmupCosineLR, found 40"},
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.01}}})", {},
       "scheduler.params.warmup_max_lr: expected a number >= warmup_min_lr"},
      {R"({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 2}}})", {},
       "scheduler.params.cos_min_ratio: expected a number in [0, 1], found 2"},
      {R"({"fp16": {"loss_scale_window": 0}})", {}, "fp16.loss_scale_window: expected a positive integer, found 0"},
      {R"({"data": {"source": "parquet"}})", {}, "data.source: expected one of \"embedded\", \"bin\", \"text\""},
      {R"({"data": {"source": "bin"}})", {}, "data.path: required when data.source is \"bin\""},
      {R"({"data": {"val_fraction": 1.0}})", {}, "data.val_fraction: expected a number in [0, 1), found 1.0"},
      {R"({"train": {"steps": 0}})", {}, "train.steps: expected a positive integer, found 0"},
      {R"({"comm": {"timeout_seconds": 0}})", {}, "comm.timeout_seconds: expected a positive number, found 0"},
      {R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", {},
       "optimizer.params.adam_w_mode: false contradicts optimizer.type \"AdamW\""},
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
      {R"({"zero_optimization": {"stage": 2, "contiguous_gradients": false}})", {},
       "zero_optimization.contiguous_gradients = false is not supported"},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {},
       "fp16.enabled and bf16.enabled are both true"},
      {R"({"optimizer": {"type": "OneBitLamb"}})", {},
       "optimizer.type \"OneBitLamb\" is not supported yet (supported: Adam, AdamW, Lamb, SGD)"},
      {R"({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})", {},
       "optimizer.params.momentum: not a parameter of Adam"},
      {R"({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})", {},
       "optimizer.params.betas: not a parameter of SGD"},
      {R"({"optimizer": {"type": "Lamb", "params": {"min_coeff": 2, "max_coeff": 1}}})", {},
       "optimizer.params.min_coeff 2 is greater than max_coeff 1"},
      {R"({"optimizer": {"type": "SGD", "params": {"nesterov": true}}})", {},
       "optimizer.params.nesterov: needs momentum > 0 and dampening 0"},
      {R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})", {},
       "scheduler.type \"OneCycle\" is not supported yet"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", {},
       "zero_optimization.offload_optimizer.device = \"cpu\" is not supported yet (only the default \"none\" is "
       "accepted)"},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -1}})", {},
       "zero_optimization.stage3_param_persistence_threshold"},
      {R"({"activation_checkpointing": {"partition_activations": true}})", {},
       "activation_checkpointing.partition_activations = true is not supported yet"},
      // Overrides: same checks, same messages.
      {"{}", {"zero_optimisation.stage=1"}, "unknown key 'zero_optimisation' — did you mean 'zero_optimization'?"},
      {"{}", {"zero_optimization.stag=1"},
       "unknown key 'zero_optimization.stag' — did you mean 'zero_optimization.stage'?"},
      {"{}", {"optimizer.params.lr=fast"}, "optimizer.params.lr: expected a positive number, found \"fast\""},
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

}  // namespace
