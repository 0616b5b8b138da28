// BERT and the Llama split over a tensor group (zerotrain/models/bert.h, llama.h): on the 2-D grid
// (T = 2 × DP = 1 and T = 2 × DP = 2) at ZeRO stages 0-3 the losses, gradient norms and every
// parameter's slice after 6 steps with clipping active equal the unsplit model trained with data
// parallelism alone on the same batches: BERT with the NSP head, pre- and post-LayerNorm; the
// Llama with grouped-query attention, biases on q, k, v and o, tied and untied heads. The MLM
// logits are this rank's vocabulary slice; with dropout (seeded as the trainer seeds) BERT's
// replicated weights stay equal across the tensor group; sizes T does not divide are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "support/multirank.h"
#include "support/tensor_split.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/data/data.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/data/bert_data.h"
#include "zerotrain/models/llama.h"
#include "zerotrain/models/tensor_parallel.h"

namespace {

using zt::testing::is_rank_process;
using zt::testing::run_ranks;
using zt::testing::slice_of;

constexpr int kSteps = 6;
constexpr int64_t kGlobalBatch = 4, kTokens = 32;

const zt::TokenDataset& corpus() {
  static const zt::TokenDataset data = zt::TokenDataset::from_text(zt::embedded_corpus());
  return data;
}

zt::TrainConfig config_for(int stage, int data_world) {
  return zt::parse_config(R"({"train_micro_batch_size_per_gpu": )" + std::to_string(kGlobalBatch / data_world) +
                              R"(, "gradient_accumulation_steps": 1, "gradient_clipping": 0.3,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
      "zero_optimization": {"stage": )" + std::to_string(stage) +
                              R"(, "reduce_bucket_size": 20000, "stage3_param_persistence_threshold": 200}})",
                          {}, data_world);
}

struct Trace {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> parameters;  // after the last step
};

// kSteps steps of `model` with the engine over `data`; loss_at(step) is this rank's loss of the
// step (each data-parallel rank its share of the step's global batch, every rank of a tensor group
// the same rows, whatever the grid).
Trace train(const std::shared_ptr<torch::nn::Module>& model, const zt::TrainConfig& config,
            const std::shared_ptr<zt::Communicator>& data, const std::function<at::Tensor(int)>& loss_at) {
  zt::Engine engine(model, config, data);
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor loss = loss_at(step);
    at::Tensor global = loss.detach().reshape({1}).to(torch::kDouble);
    data->all_reduce(global, zt::ReduceOp::Avg, "test.loss").wait();
    trace.losses.push_back(global.item<double>());
    engine.backward(loss);
    const zt::StepResult result = engine.step();
    EXPECT_TRUE(result.stepped);
    trace.norms.push_back(result.grad_norm);
  }
  for (const auto& item : model->named_parameters()) trace.parameters[item.key()] = engine.master_parameter(item.key());
  return trace;
}

// The steps of BERT on the sentence pairs of the embedded corpus.
Trace train_bert(zt::Bert model, const zt::TrainConfig& config, const std::shared_ptr<zt::Communicator>& data) {
  zt::SentencePairOptions options;
  options.max_length = kTokens;
  zt::SentencePairSampler sampler(corpus(), options, kGlobalBatch / data->world_size(), data->world_size(),
                                  data->rank(), 5);
  zt::MlmMasker masker({}, zt::BertSpecialTokens{256}, 5);
  return train(model.ptr(), config, data, [&](int step) { return model->losses(sampler.batch(step, 0, masker)).total; });
}

// The split run against the unsplit one: losses and gradient norms within 2e-5 with clipping
// active, every parameter the slice of the unsplit one's it should be (1e-4). Returns how many
// parameters were split.
int expect_split_run_equals(const Trace& trace, const Trace& reference,
                            std::map<std::string, std::optional<zt::TensorSplit>>& splits) {
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(trace.losses[step], reference.losses[step], 2e-5 * reference.losses[step]) << "step " << step;
    EXPECT_NEAR(trace.norms[step], reference.norms[step], 2e-5 * reference.norms[step]) << "step " << step;
  }
  EXPECT_GT(reference.norms[0], 0.3) << "clipping is active, so the norm decides the update";
  int sliced = 0;
  for (const auto& [name, value] : trace.parameters) {
    const at::Tensor whole = reference.parameters.at(name);
    const at::Tensor expected = splits[name] ? slice_of(whole, *splits[name]) : whole;
    sliced += splits[name] ? 1 : 0;
    EXPECT_EQ(value.sizes(), expected.sizes()) << name;
    if (value.sizes() != expected.sizes()) continue;
    EXPECT_TRUE(torch::allclose(value, expected, 1e-4, 3e-4))
        << name << ": largest difference " << (value - expected).abs().max().item<double>();
  }
  return sliced;
}

zt::BertConfig shape(bool pre_layer_norm) {
  zt::BertConfig c = zt::bert_preset("bert-tiny");
  c.next_sentence = true;
  c.pre_layer_norm = pre_layer_norm;
  return c;
}

void split_equals_unsplit(const zt::ProcessGrid& grid, int stage, bool pre_layer_norm) {
  SCOPED_TRACE("stage " + std::to_string(stage) + (pre_layer_norm ? ", pre-LN" : ", post-LN"));
  const zt::TrainConfig config = config_for(stage, grid.data->world_size());
  auto build = [&](const std::shared_ptr<zt::Communicator>& tensor) {
    torch::manual_seed(23);
    std::optional<zt::ShardedConstruction> sharded;
    if (config.zero.shard_parameters) sharded.emplace(grid.data->rank(), grid.data->world_size());
    return zt::Bert(shape(pre_layer_norm), tensor);
  };
  const Trace reference = train_bert(build(nullptr), config, grid.data);
  zt::Bert split = build(grid.tensor);
  std::map<std::string, std::optional<zt::TensorSplit>> splits;
  for (const auto& item : split->named_parameters()) splits[item.key()] = zt::tensor_split_of(item.value());
  const Trace trace = train_bert(split, config, grid.data);
  // The word embeddings and the MLM bias; per layer query, key, value (weight and bias), the
  // attention output's weight, intermediate (weight and bias) and the output's weight.
  EXPECT_EQ(expect_split_run_equals(trace, reference, splits), 2 + 10 * shape(pre_layer_norm).n_layer);
}

TEST(TensorParallelBert, SplitEqualsUnsplitAtEveryStage) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    for (int stage : {0, 1, 2, 3}) split_equals_unsplit(grid, stage, false);
    split_equals_unsplit(grid, 2, true);
    return;
  }
  for (int world : {2, 4}) {
    auto r = run_ranks(world, "TensorParallelBert.SplitEqualsUnsplitAtEveryStage", {{"ZT_COMM_TIMEOUT_SECONDS", "120"}},
                       std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << "T = 2 x DP = " << world / 2 << ":\n" << r.describe();
  }
}

// The logits are this rank's vocabulary slice; with dropout the ranks of a tensor group keep equal
// replicated weights (the masks of the replicated activations agree); bad sizes are refused by
// name.
TEST(TensorParallelBert, SlicedLogitsDropoutAndBadSizes) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    zt::BertConfig c = shape(false);
    c.dropout = 0.1;
    torch::manual_seed(3);
    zt::Bert model(c, grid.tensor);
    const at::Tensor rows = torch::randn({5, c.hidden});
    EXPECT_EQ(model->mlm_logits(rows).sizes(), (std::vector<int64_t>{5, c.vocab_size / 2}));
    // An id no rank's rows hold is refused, not looked up as zeros.
    try {
      model->forward(torch::full({1, 4}, c.vocab_size, torch::kLong));
      ADD_FAILURE() << "an id outside the vocabulary must be refused";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("input_ids must be in [0, vocab_size=260)"), std::string::npos) << e.what();
    }
    zt::Engine engine(model.ptr(), config_for(1, grid.data->world_size()), grid.data);
    zt::SentencePairOptions options;
    options.max_length = kTokens;
    zt::SentencePairSampler sampler(corpus(), options, 2, 1, 0, 5);
    zt::MlmMasker masker({}, zt::BertSpecialTokens{256}, 5);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(100 + step);  // the same replicated masks on every rank, as the trainer seeds
      zt::seed_tensor_parallel_rng(900 + step + 7 * uint64_t(grid.tensor->rank()));
      engine.backward(model->losses(sampler.batch(step, 0, masker)).total);
      engine.step();
    }
    for (const auto& item : model->named_parameters()) {
      if (zt::tensor_split_of(item.value())) continue;
      at::Tensor mine = item.value().detach().clone(), others = mine.clone();
      grid.tensor->all_reduce(others, zt::ReduceOp::Max, "test.replicated").wait();
      EXPECT_TRUE(torch::equal(mine, others)) << item.key() << " drifted apart across the tensor group";
    }
    for (auto field : {&zt::BertConfig::n_head, &zt::BertConfig::vocab_size, &zt::BertConfig::intermediate}) {
      zt::BertConfig odd = shape(false);
      odd.*field += 1;
      if (field == &zt::BertConfig::n_head) odd.n_head = 1, odd.hidden = 64;
      try {
        zt::Bert bad(odd, grid.tensor);
        ADD_FAILURE() << "an odd size must be refused";
      } catch (const zt::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("is not divisible by the tensor group's 2 ranks"), std::string::npos)
            << e.what();
      }
    }
    return;
  }
  auto r = run_ranks(2, "TensorParallelBert.SlicedLogitsDropoutAndBadSizes", {{"ZT_COMM_TIMEOUT_SECONDS", "120"}},
                     std::chrono::seconds(120));
  EXPECT_TRUE(r.all_succeeded()) << r.describe();
}

// ---- the Llama ------------------------------------------------------------------------------

// The steps of the Llama on random tokens of the step (each data-parallel rank its rows).
Trace train_llama(zt::Llama model, const zt::TrainConfig& config, const std::shared_ptr<zt::Communicator>& data) {
  const int64_t micro = kGlobalBatch / data->world_size();
  return train(model.ptr(), config, data, [&](int step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
    const at::Tensor tokens = torch::randint(0, 256, {kGlobalBatch, kTokens + 1}, gen, torch::kLong)
                                  .narrow(0, data->rank() * micro, micro);
    return model->loss(tokens.narrow(1, 0, kTokens), tokens.narrow(1, 1, kTokens));
  });
}

void llama_split_equals_unsplit(const zt::ProcessGrid& grid, int stage, bool tied) {
  SCOPED_TRACE("Llama, stage " + std::to_string(stage) + (tied ? ", tied head" : ", untied head"));
  const zt::TrainConfig config = config_for(stage, grid.data->world_size());
  zt::LlamaConfig shape;  // llama-tiny: 4 query heads over 2 kv heads
  shape.attention_bias = true;
  shape.tie_word_embeddings = tied;
  auto build = [&](const std::shared_ptr<zt::Communicator>& tensor) {
    torch::manual_seed(29);
    std::optional<zt::ShardedConstruction> sharded;
    if (config.zero.shard_parameters) sharded.emplace(grid.data->rank(), grid.data->world_size());
    return zt::Llama(shape, tensor);
  };
  const Trace reference = train_llama(build(nullptr), config, grid.data);
  zt::Llama split = build(grid.tensor);
  std::map<std::string, std::optional<zt::TensorSplit>> splits;
  for (const auto& item : split->named_parameters()) splits[item.key()] = zt::tensor_split_of(item.value());
  const Trace trace = train_llama(split, config, grid.data);
  // The embedding and (untied) the head; per layer q, k, v (weight and bias), o's weight, gate,
  // up and down's weights.
  EXPECT_EQ(expect_split_run_equals(trace, reference, splits), (tied ? 1 : 2) + 10 * shape.num_hidden_layers);
}

TEST(TensorParallelLlama, SplitEqualsUnsplitAtEveryStage) {
  if (is_rank_process()) {
    at::set_num_threads(1);
    auto world = zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
    const zt::ProcessGrid grid = zt::make_process_grid(world, 2);
    for (int stage : {0, 1, 2, 3}) llama_split_equals_unsplit(grid, stage, false);
    llama_split_equals_unsplit(grid, 2, true);
    zt::LlamaConfig odd;
    odd.num_key_value_heads = 1;
    try {
      zt::Llama bad(odd, grid.tensor);
      ADD_FAILURE() << "one kv head cannot split in two";
    } catch (const zt::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("num_key_value_heads 1 is not divisible by the tensor group's 2 ranks"),
                std::string::npos)
          << e.what();
    }
    return;
  }
  for (int world : {2, 4}) {
    auto r = run_ranks(world, "TensorParallelLlama.SplitEqualsUnsplitAtEveryStage", {{"ZT_COMM_TIMEOUT_SECONDS", "120"}},
                       std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << "T = 2 x DP = " << world / 2 << ":\n" << r.describe();
  }
}

}  // namespace
