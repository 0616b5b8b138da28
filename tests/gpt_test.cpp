// Reference GPT model: presets, exact parameter count, shapes, causality, weight tying, seeding,
// loss at init and that a few optimizer steps learn.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "zerotrain/data/data.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"

namespace {

using zt::GPT;
using zt::GPTConfig;

// One intra-op thread: these models are tiny, and under a loaded 2-core machine OpenMP workers
// spinning against each other made a 0.3 s test take 7 s.
const bool kSingleThread = [] {
  torch::set_num_threads(1);
  return true;
}();

int64_t numel_of(const std::vector<torch::Tensor>& ps) {
  int64_t n = 0;
  for (const auto& p : ps) n += p.numel();
  return n;
}

TEST(GPTPreset, NamesResolveAndUnknownNameListsValidOnes) {
  const auto names = zt::gpt_preset_names();
  ASSERT_GE(names.size(), 9u);
  for (const auto& n : names) EXPECT_NO_THROW(zt::gpt_preset(n).validate()) << n;
  try {
    zt::gpt_preset("gpt2-big");
    FAIL() << "expected ConfigError";
  } catch (const zt::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("gpt2-big"), std::string::npos) << msg;
    for (const auto& n : names) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
  EXPECT_LT(zt::gpt_parameter_count(zt::gpt_preset("tiny")), 1'000'000);
  const auto s = zt::gpt_preset("small");
  EXPECT_EQ(s.vocab_size, 256);
  EXPECT_EQ(s.context_length, 128);
}

TEST(GPTPreset, AnalyticCountsOfKnownModels) {
  // GPT-2 124M with a tied head, learned positions and biases: the number Hugging Face reports.
  EXPECT_EQ(zt::gpt_parameter_count(zt::gpt_preset("gpt2-124m")), 124'439'808);
  EXPECT_EQ(zt::gpt_parameter_count(zt::gpt_preset("gpt2-350m")), 354'823'168);
  EXPECT_EQ(zt::gpt_parameter_count(zt::gpt_preset("gpt2-774m")), 774'030'080);
  EXPECT_EQ(zt::gpt_parameter_count(zt::gpt_preset("gpt2-1.5b")), 1'557'611'200);
}

TEST(GPTPreset, InvalidConfigIsConfigError) {
  GPTConfig c = zt::gpt_preset("tiny");
  c.n_head = 3;  // 64 % 3 != 0
  EXPECT_THROW(c.validate(), zt::ConfigError);
  EXPECT_THROW(GPT{c}, zt::ConfigError);
  c = zt::gpt_preset("tiny");
  c.n_layer = 0;
  EXPECT_THROW(GPT{c}, zt::ConfigError);
}

TEST(GPTModel, ParameterCountMatchesAnalytic) {
  for (const GPTConfig c : {zt::gpt_preset("tiny"), zt::gpt_preset("small"), GPTConfig{100, 16, 3, 4, 32, 0.1},
                            GPTConfig{50, 8, 1, 1, 8, 0.0}}) {
    GPT model(c);
    EXPECT_EQ(numel_of(model->parameters()), zt::gpt_parameter_count(c));
    EXPECT_EQ(static_cast<int64_t>(model->parameters().size()), 2 + 12 * c.n_layer + 2);
    EXPECT_EQ(static_cast<int64_t>(model->blocks.size()), c.n_layer);
  }
}

TEST(GPTModel, RegistrationOrderIsDeterministic) {
  GPT model(zt::gpt_preset("tiny"));
  auto named = model->named_parameters();
  std::vector<std::string> keys;
  for (const auto& kv : named) keys.push_back(kv.key());
  ASSERT_EQ(keys.size(), 28u);
  EXPECT_EQ(keys[0], "wte.weight");
  EXPECT_EQ(keys[1], "wpe.weight");
  EXPECT_EQ(keys[2], "blocks.0.ln_1.weight");
  EXPECT_EQ(keys[4], "blocks.0.attn.c_attn.weight");
  EXPECT_EQ(keys[13], "blocks.0.mlp.c_proj.bias");
  EXPECT_EQ(keys[14], "blocks.1.ln_1.weight");
  EXPECT_EQ(keys[26], "ln_f.weight");
  EXPECT_EQ(keys[27], "ln_f.bias");
  // The public blocks are the registered modules themselves.
  EXPECT_TRUE(model->blocks[1]->ln_1->weight.is_same(named["blocks.1.ln_1.weight"]));
}

TEST(GPTModel, HeadIsTiedToTokenEmbedding) {
  // V=100 makes the [V, C] shape unique to the embedding/head.
  GPT model(GPTConfig{100, 16, 2, 2, 32, 0.0});
  int count = 0;
  for (const auto& p : model->parameters())
    if (p.sizes() == torch::IntArrayRef({100, 32})) ++count;
  EXPECT_EQ(count, 1);
  auto idx = torch::randint(0, 100, {1, 4}, torch::kLong);
  auto loss = model->forward(idx).sum();
  loss.backward();
  // The embedding weight receives gradient for every row through the head, not only the used ids.
  auto g = model->wte->weight.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_EQ((g.abs().sum(1) > 0).sum().item<int64_t>(), 100);
}

TEST(GPTModel, InitStatistics) {
  torch::manual_seed(0);
  GPT model(zt::gpt_preset("small"));
  auto named = model->named_parameters();
  EXPECT_NEAR(named["wte.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["blocks.0.attn.c_attn.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["blocks.0.mlp.c_proj.weight"].std().item<double>(), 0.02 / std::sqrt(8.0), 0.001);
  EXPECT_EQ(named["blocks.0.attn.c_attn.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(named["ln_f.weight"], torch::ones({128})));
}

TEST(GPTModel, OutputShapes) {
  GPT model(zt::gpt_preset("tiny"));
  auto idx = torch::randint(0, 256, {3, 17}, torch::kLong);
  auto logits = model->forward(idx);
  EXPECT_EQ(logits.sizes(), torch::IntArrayRef({3, 17, 256}));
  EXPECT_EQ(logits.scalar_type(), torch::kFloat);
  EXPECT_EQ(model->loss(idx, idx).dim(), 0);
  // int32 ids work too; full context length works.
  EXPECT_EQ(model->forward(torch::randint(0, 256, {1, 64}, torch::kInt)).sizes(), torch::IntArrayRef({1, 64, 256}));
}

TEST(GPTModel, BadInputsThrowConfigError) {
  GPT model(zt::gpt_preset("tiny"));
  EXPECT_THROW(model->forward(torch::zeros({1, 65}, torch::kLong)), zt::ConfigError);  // > context_length
  EXPECT_THROW(model->forward(torch::zeros({4}, torch::kLong)), zt::ConfigError);      // 1-D
  EXPECT_THROW(model->forward(torch::zeros({1, 4}, torch::kFloat)), zt::ConfigError);  // not integer
  EXPECT_THROW(model->forward(torch::full({1, 4}, 256, torch::kLong)), zt::ConfigError);  // id >= vocab
  EXPECT_THROW(model->forward(torch::full({1, 4}, -1, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->loss(torch::zeros({1, 4}, torch::kLong), torch::zeros({1, 5}, torch::kLong)), zt::ConfigError);
  try {
    model->forward(torch::zeros({2, 100}, torch::kLong));
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("context_length=64"), std::string::npos) << e.what();
  }
}

TEST(GPTModel, IsCausal) {
  torch::manual_seed(1);
  GPT model(GPTConfig{64, 16, 2, 2, 32, 0.0});
  model->eval();
  auto idx = torch::randint(0, 64, {2, 16}, torch::kLong);
  auto a = model->forward(idx);
  auto changed = idx.clone();
  changed.index_put_({torch::indexing::Slice(), 10}, (idx.index({torch::indexing::Slice(), 10}) + 1) % 64);
  auto b = model->forward(changed);
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::allclose(a.index({Slice(), Slice(0, 10)}), b.index({Slice(), Slice(0, 10)}), 0, 0));
  EXPECT_FALSE(torch::allclose(a.index({Slice(), 10}), b.index({Slice(), 10})));
}

TEST(GPTModel, SeedReproducibility) {
  auto build = [](uint64_t seed) {
    torch::manual_seed(seed);
    return GPT(zt::gpt_preset("tiny"));
  };
  GPT a = build(7), b = build(7), c = build(8);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  bool all_equal = true, any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    all_equal = all_equal && torch::equal(pa[i], pb[i]);
    any_diff = any_diff || !torch::equal(pa[i], pc[i]);
  }
  EXPECT_TRUE(all_equal);
  EXPECT_TRUE(any_diff);
}

TEST(GPTModel, LossAtInitIsNearLogVocab) {
  torch::manual_seed(0);
  GPT model(zt::gpt_preset("tiny"));
  auto idx = torch::randint(0, 256, {4, 64}, torch::kLong);
  auto tgt = torch::randint(0, 256, {4, 64}, torch::kLong);
  EXPECT_NEAR(model->loss(idx, tgt).item<double>(), std::log(256.0), 0.1);
}

TEST(GPTModel, DropoutOnlyInTraining) {
  torch::manual_seed(0);
  GPTConfig c = zt::gpt_preset("tiny");
  c.dropout = 0.5;
  GPT model(c);
  auto idx = torch::randint(0, 256, {2, 8}, torch::kLong);
  model->eval();
  EXPECT_TRUE(torch::equal(model->forward(idx), model->forward(idx)));
  model->train();
  EXPECT_FALSE(torch::equal(model->forward(idx), model->forward(idx)));
}

TEST(GPTModel, BlockWrapperSeesEveryBlockInOrder) {
  GPT model(zt::gpt_preset("tiny"));
  auto idx = torch::randint(0, 256, {1, 8}, torch::kLong);
  auto plain = model->forward(idx);
  std::vector<int64_t> seen;
  model->set_block_wrapper([&](int64_t i, const zt::GPTImpl::BlockFn& run, const torch::Tensor& x) {
    seen.push_back(i);
    return run(x);
  });
  EXPECT_TRUE(torch::equal(model->forward(idx), plain));
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1}));
}

TEST(GPTModel, AdamStepsLowerTheLoss) {
  torch::manual_seed(0);
  GPT model(zt::gpt_preset("tiny"));
  auto idx = torch::randint(0, 256, {2, 32}, torch::kLong);
  auto tgt = torch::roll(idx, -1, 1);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  const double first = model->loss(idx, tgt).item<double>();
  double last = first;
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    auto loss = model->loss(idx, tgt);
    loss.backward();
    opt.step();
    last = loss.item<double>();
  }
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

// The embedded corpus is learnable by a small byte-level model: the promise data.h makes.
// Returns {first loss, mean of the last 10 losses}.
std::pair<double, double> train_on_corpus(const GPTConfig& c, int64_t batch, int64_t seq_len, int steps, double lr) {
  torch::manual_seed(0);
  auto data = zt::TokenDataset::from_text(zt::embedded_corpus());
  GPT model(c);
  zt::DistributedSampler sampler(data, seq_len, batch, 1, 0, 1234);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.0));
  double first = 0, tail = 0;
  for (int step = 0; step < steps; ++step) {
    auto b = sampler.batch(step, 0);
    opt.zero_grad();
    auto loss = model->loss(b.inputs, b.targets);
    loss.backward();
    opt.step();
    const double l = loss.item<double>();
    if (step == 0) first = l;
    if (step >= steps - 10) tail += l / 10;
    if (step % 25 == 0 || step == steps - 1) std::printf("  step %3d loss %.3f\n", step, l);
  }
  return {first, tail};
}

TEST(GPTModel, TinyModelLearnsEmbeddedCorpus) {
  auto [first, last] = train_on_corpus(zt::gpt_preset("tiny"), 16, 64, 200, 3e-3);
  EXPECT_GT(first, 5.0);
  EXPECT_LT(last, 2.5) << "first " << first << " last " << last;
}

}  // namespace

// The GPT-3 shapes of the single-GPU offload benchmark (docs/gpu.md) at context 1024.
TEST(GPTPreset, Gpt3ShapesAtContext1024) {
  const auto small = zt::gpt_preset("gpt3-2.7b");
  EXPECT_EQ(small.n_layer, 32);
  EXPECT_EQ(small.n_embd, 2560);
  EXPECT_EQ(small.n_head, 32);
  EXPECT_EQ(small.context_length, 1024);
  EXPECT_EQ(small.vocab_size, 50257);
  EXPECT_EQ(zt::gpt_parameter_count(small), 2'648'931'840);
  EXPECT_EQ(zt::gpt_parameter_count(zt::gpt_preset("gpt3-6.7b")), 6'654'210'048);
  const auto large = zt::gpt_preset("gpt3-13b");
  EXPECT_EQ(large.n_layer, 40);
  EXPECT_EQ(large.n_embd, 5120);
  EXPECT_EQ(large.n_head, 40);
  EXPECT_EQ(zt::gpt_parameter_count(large), 12'848'143'360);
}
