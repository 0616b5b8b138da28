// The Llama-family decoder (zerotrain/models/llama.h) against transformers' LlamaForCausalLM and
// Qwen2ForCausalLM on the same weights (tests/support/llama_oracle.py), its configuration's checks
// and its parameter count. transformers comes from scripts/python_deps.sh; the comparisons skip,
// naming the reason, only when it cannot be imported.
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "support/multirank.h"
#include "support/process.h"
#include "support/transformers.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/llama.h"

namespace {

using zt::testing::make_temp_dir;

struct Oracle {
  std::map<std::string, torch::Tensor> state;
  torch::Tensor ids, logits;
  double loss = 0;
};

// transformers' model of `spec` (see tests/support/llama_oracle.py), run on its random ids.
Oracle run_oracle(const nlohmann::json& spec) {
  const std::string out = make_temp_dir("llama_oracle") + "/oracle.pt";
  auto r = zt::testing::run_transformers_script("llama_oracle.py", {out, spec.dump()});
  if (r.exit_code != 0) throw std::runtime_error("llama_oracle.py failed: " + r.output);
  std::ifstream f(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto dict = torch::pickle_load(bytes).toGenericDict();
  Oracle o;
  for (const auto& item : dict.at("state").toGenericDict()) o.state[item.key().toStringRef()] = item.value().toTensor();
  o.ids = dict.at("ids").toTensor();
  o.logits = dict.at("logits").toTensor();
  o.loss = dict.at("loss").toTensor().item<double>();
  return o;
}

// Copies the oracle's parameters into `model` by name; every name on both sides must match.
void load_by_name(zt::Llama& model, const Oracle& o) {
  torch::NoGradGuard no_grad;
  std::set<std::string> ours;
  for (auto& p : model->named_parameters()) {
    ours.insert(p.key());
    auto found = o.state.find(p.key());
    ASSERT_NE(found, o.state.end()) << "transformers has no parameter " << p.key();
    ASSERT_EQ(found->second.sizes(), p.value().sizes()) << p.key();
    p.value().copy_(found->second);
  }
  for (const auto& [name, value] : o.state) EXPECT_TRUE(ours.count(name)) << "our model has no parameter " << name;
}

struct Case {
  const char* name;
  const char* model_class;  // "llama" or "qwen2"
  zt::LlamaConfig config;
  nlohmann::json transformers_config;
};

zt::LlamaConfig small(int64_t kv_heads, bool tied) {
  zt::LlamaConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

nlohmann::json transformers_config(const zt::LlamaConfig& c) {
  nlohmann::json rope = {{"rope_type", c.rope_scaling.type}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.type != "default") rope["factor"] = c.rope_scaling.factor;
  if (c.rope_scaling.type == "llama3") {
    rope["low_freq_factor"] = c.rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = c.rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  }
  nlohmann::json j = {{"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads}, {"num_key_value_heads", c.num_key_value_heads},
                      {"max_position_embeddings", c.max_position_embeddings}, {"rms_norm_eps", c.rms_norm_eps},
                      {"tie_word_embeddings", c.tie_word_embeddings}, {"rope_parameters", rope}};
  if (c.head_dim > 0) j["head_dim"] = c.head_dim;
  if (c.attention_bias) j["attention_bias"] = true;
  if (c.mlp_bias) j["mlp_bias"] = true;
  return j;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  {
    auto c = small(2, false);  // grouped-query attention, untied head
    out.push_back({"gqa_untied", "llama", c, transformers_config(c)});
  }
  {
    auto c = small(1, true);  // one kv head, tied head, Llama 3's rope scaling, head_dim given
    c.head_dim = 16;
    c.rope_theta = 500000.0;
    c.rope_scaling = zt::RopeScaling{"llama3", 8.0, 1.0, 4.0, 16};
    out.push_back({"tied_llama3_rope", "llama", c, transformers_config(c)});
  }
  {
    auto c = small(4, false);  // multi-head attention with biases everywhere, linear rope scaling
    c.attention_bias = true;
    c.mlp_bias = true;
    c.rope_scaling.type = "linear";
    c.rope_scaling.factor = 2.0;
    out.push_back({"biases_linear_rope", "llama", c, transformers_config(c)});
  }
  {
    auto c = small(2, false);  // Qwen2: bias on q, k and v only
    c.qkv_bias = true;
    c.rope_theta = 1000000.0;
    auto j = transformers_config(c);
    j["use_sliding_window"] = false;
    out.push_back({"qwen2_qkv_bias", "qwen2", c, j});
  }
  return out;
}

class LlamaAgainstTransformers : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaAgainstTransformers, LogitsAndLossEqualTransformersOnTheSameWeights) {
  REQUIRE_TRANSFORMERS();
  const Case& c = GetParam();
  const Oracle o = run_oracle({{"class", c.model_class}, {"config", c.transformers_config}, {"batch", 2}, {"seq", 24}});
  torch::manual_seed(0);
  zt::Llama model(c.config);
  model->eval();
  EXPECT_EQ(zt::llama_parameter_count(c.config),
            [&] { int64_t n = 0; for (auto& p : model->parameters()) n += p.numel(); return n; }());
  load_by_name(model, o);
  torch::NoGradGuard no_grad;
  auto logits = model->forward(o.ids);
  ASSERT_EQ(logits.sizes(), o.logits.sizes());
  const double max_diff = (logits - o.logits).abs().max().item<double>();
  EXPECT_LT(max_diff, 2e-5) << "largest logit difference from transformers";
  // transformers shifts the labels inside; ours takes the targets already shifted.
  const int64_t T = o.ids.size(1);
  const double loss = model->loss(o.ids.narrow(1, 0, T - 1), o.ids.narrow(1, 1, T - 1)).item<double>();
  EXPECT_NEAR(loss, o.loss, 1e-5 * o.loss);
}

INSTANTIATE_TEST_SUITE_P(Llama, LlamaAgainstTransformers, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(LlamaConfig, BadShapesAreConfigErrorsNamingTheField) {
  auto expect = [](zt::LlamaConfig c, const std::string& field) {
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << field;
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  zt::LlamaConfig c;
  c.num_key_value_heads = 3;  // 4 heads
  expect(c, "num_key_value_heads");
  c = {};
  c.head_dim = 15;
  expect(c, "head_dim");
  c = {};
  c.rope_scaling.type = "yarn";
  expect(c, "rope_scaling.rope_type");
  c = {};
  c.rope_scaling = zt::RopeScaling{"llama3", 8.0, 4.0, 1.0, 16};
  expect(c, "rope_scaling.high_freq_factor");
  EXPECT_THROW(zt::llama_preset("llama-7b-typo"), zt::ConfigError);
}

TEST(Llama, BadInputIsAConfigErrorAndSelectiveRecomputationIsRefused) {
  zt::Llama model(zt::llama_preset("llama-tiny"));
  EXPECT_THROW(model->forward(torch::full({1, 4}, 256, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(torch::zeros({1, 129}, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(torch::zeros({1, 4}, torch::kFloat)), zt::ConfigError);
  zt::CheckpointingSettings selective;
  selective.recompute = zt::Recompute::Selective;
  EXPECT_THROW(model->set_checkpointing(selective), zt::ConfigError);
}

TEST(Llama, FullRecomputationGivesTheSameGradients) {
  auto grads = [](bool checkpointed) {
    torch::manual_seed(3);
    zt::Llama model(zt::llama_preset("llama-tiny"));
    if (checkpointed) {
      zt::CheckpointingSettings full;
      full.recompute = zt::Recompute::Full;
      model->set_checkpointing(full);
    }
    auto ids = torch::randint(0, 256, {2, 12}, torch::kLong);
    model->loss(ids.narrow(1, 0, 11), ids.narrow(1, 1, 11)).backward();
    std::vector<torch::Tensor> out;
    for (auto& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  auto plain = grads(false), recomputed = grads(true);
  ASSERT_EQ(plain.size(), recomputed.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], recomputed[i])) << "parameter " << i;
}

TEST(LlamaConfig, PresetParameterCounts) {
  // Llama 3.2 1B: 1,235,814,400 parameters (tied embeddings).
  EXPECT_EQ(zt::llama_parameter_count(zt::llama_preset("llama-1b")), 1235814400);
  torch::manual_seed(0);
  zt::Llama tiny(zt::llama_preset("llama-tiny"));
  int64_t n = 0;
  for (auto& p : tiny->parameters()) n += p.numel();
  EXPECT_EQ(n, zt::llama_parameter_count(zt::llama_preset("llama-tiny")));
}

// The tiny Llama trained by the engine on this rank's batches: the mean loss of each step.
std::vector<double> train_llama(int stage, bool sharded_construction, bool checkpointing) {
  auto comm = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
  const int rank = comm->rank(), world = comm->world_size();
  const std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0}})";
  const auto config = zt::parse_config(json, {}, world);
  torch::manual_seed(11);
  std::optional<zt::ShardedConstruction> sharded;
  if (sharded_construction) sharded.emplace(rank, world);
  zt::Llama model(zt::llama_preset("llama-tiny"));
  sharded.reset();
  if (checkpointing) {
    zt::CheckpointingSettings full;
    full.recompute = zt::Recompute::Full;
    model->set_checkpointing(full);
  }
  zt::Engine engine(model.ptr(), config, comm);
  std::vector<double> losses;
  for (int step = 0; step < 4; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + step);
    auto ids = torch::randint(0, 256, {2, 17}, gen, torch::kLong);
    auto loss = model->loss(ids.narrow(1, 0, 16), ids.narrow(1, 1, 16));
    losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  return losses;
}

}  // namespace

// Every ZeRO stage applies to the Llama through its marked blocks: stages 2 and 3 (the latter
// built sharded, and with full recomputation) train as stage 0 does on 2 ranks.
TEST(LlamaEngine, StagesTwoAndThreeEqualStageZeroOnTwoRanks) {
  if (zt::testing::is_rank_process()) {
    const auto reference = train_llama(0, false, false);
    for (auto [stage, sharded, recompute] : {std::tuple{2, false, false}, {3, true, false}, {3, false, true}}) {
      const auto run = train_llama(stage, sharded, recompute);
      ASSERT_EQ(run.size(), reference.size());
      for (size_t i = 0; i < run.size(); ++i)
        EXPECT_NEAR(run[i], reference[i], 1e-5 * std::abs(reference[i]))
            << "stage " << stage << (sharded ? " built sharded" : "") << (recompute ? " recomputing" : "") << ", step " << i;
    }
    return;
  }
  auto r = zt::testing::run_ranks(2, "LlamaEngine.StagesTwoAndThreeEqualStageZeroOnTwoRanks",
                                  {{"ZT_COMM_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(240));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}
