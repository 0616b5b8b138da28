// Reference BERT: presets and parameter counts, the encoder (padding mask, post- and pre-LN,
// checkpointing), the MLM loss projecting only the masked rows against the full projection, the
// masking statistics and the sentence pairs, and ZeRO stages 1-3 against stage 0 on 1-3 ranks
// with AdamW and LAMB.
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include "support/multirank.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/data/data.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/bert.h"
#include "zerotrain/data/bert_data.h"

namespace {

namespace fs = std::filesystem;
using zt::Bert;
using zt::BertBatch;
using zt::BertConfig;
using zt::testing::is_rank_process;
using zt::testing::run_ranks;

// One intra-op thread: the models are tiny and the machine small (as tests/gpt_test.cpp).
const bool kSingleThread = [] {
  torch::set_num_threads(1);
  return true;
}();

const zt::BertSpecialTokens kBytes{256};

int64_t numel_of(const std::vector<torch::Tensor>& ps) {
  int64_t n = 0;
  for (const auto& p : ps) n += p.numel();
  return n;
}

const zt::TokenDataset& corpus() {
  static const zt::TokenDataset data = zt::TokenDataset::from_text(zt::embedded_corpus());
  return data;
}

zt::SentencePairOptions pair_options(int64_t max_length) {
  zt::SentencePairOptions o;
  o.max_length = max_length;
  return o;
}

BertConfig tiny(bool next_sentence = true, bool pre_layer_norm = false) {
  auto c = zt::bert_preset("bert-tiny");
  c.next_sentence = next_sentence;
  c.pre_layer_norm = pre_layer_norm;
  return c;
}

// A masked batch of B pairs of T tokens from the embedded corpus.
BertBatch corpus_batch(int64_t B, int64_t T, int64_t step = 0, uint64_t seed = 1) {
  zt::SentencePairSampler sampler(corpus(), pair_options(T), B, 1, 0, seed);
  zt::MlmMasker masker({}, kBytes, seed);
  return sampler.batch(step, 0, masker);
}

// ---- presets and counts --------------------------------------------------------------------

TEST(BertPreset, NamesResolveAndUnknownNameListsValidOnes) {
  const auto names = zt::bert_preset_names();
  ASSERT_EQ(names, (std::vector<std::string>{"bert-tiny", "bert-base", "bert-large"}));
  for (const auto& n : names) EXPECT_NO_THROW(zt::bert_preset(n).validate()) << n;
  try {
    zt::bert_preset("bert-huge");
    FAIL() << "expected ConfigError";
  } catch (const zt::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bert-huge"), std::string::npos) << msg;
    for (const auto& n : names) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
  const auto t = zt::bert_preset("bert-tiny");
  EXPECT_EQ(t.vocab_size, kBytes.vocab_size());
  EXPECT_EQ(t.max_positions, 128);
  const auto base = zt::bert_preset("bert-base");
  EXPECT_EQ(base.n_layer, 12);
  EXPECT_EQ(base.hidden, 768);
  EXPECT_EQ(base.n_head, 12);
  EXPECT_EQ(base.intermediate, 3072);
  EXPECT_EQ(base.vocab_size, 30522);
  EXPECT_EQ(base.max_positions, 512);
  EXPECT_FALSE(base.pre_layer_norm);
  const auto large = zt::bert_preset("bert-large");
  EXPECT_EQ(large.n_layer, 24);
  EXPECT_EQ(large.hidden, 1024);
  EXPECT_EQ(large.n_head, 16);
  EXPECT_EQ(large.intermediate, 4096);
}

// The published figures: Hugging Face's BertModel (embeddings, layers, pooler) has 109,482,240
// parameters for bert-base-uncased and 335,141,888 for bert-large-uncased; BertForPreTraining
// adds the MLM transform and output bias and the NSP classifier (110,106,428 for bert-base,
// 336,226,108 for bert-large).
TEST(BertPreset, AnalyticCountsOfPublishedModels) {
  const auto base = zt::bert_parameter_counts(zt::bert_preset("bert-base"));
  EXPECT_EQ(base.embeddings + base.layers + base.pooler, 109'482'240);
  EXPECT_EQ(base.total(), 110'106'428);
  EXPECT_EQ(zt::bert_parameter_count(zt::bert_preset("bert-base")), 110'106'428);
  const auto large = zt::bert_parameter_counts(zt::bert_preset("bert-large"));
  EXPECT_EQ(large.embeddings + large.layers + large.pooler, 335'141'888);
  EXPECT_EQ(large.total(), 336'226'108);
  EXPECT_LT(zt::bert_parameter_count(zt::bert_preset("bert-tiny")), 200'000);
}

TEST(BertPreset, InvalidConfigIsConfigErrorNamingTheField) {
  BertConfig c = tiny();
  c.n_head = 3;  // 64 % 3 != 0
  try {
    c.validate();
    FAIL() << "expected ConfigError";
  } catch (const zt::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("config.hidden (64)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("config.n_head (3)"), std::string::npos) << msg;
  }
  EXPECT_THROW(Bert{c}, zt::ConfigError);
  for (auto field : {&BertConfig::n_layer, &BertConfig::intermediate, &BertConfig::type_vocab_size}) {
    c = tiny();
    c.*field = 0;
    EXPECT_THROW(Bert{c}, zt::ConfigError);
  }
  c = tiny();
  c.layer_norm_eps = 0;
  EXPECT_THROW(c.validate(), zt::ConfigError);
  c = tiny();
  c.dropout = 1.0;
  EXPECT_THROW(c.validate(), zt::ConfigError);
}

// ---- the model -------------------------------------------------------------------------------

TEST(BertModel, ParameterCountMatchesAnalytic) {
  for (bool nsp : {false, true})
    for (bool pre : {false, true}) {
      const auto c = tiny(nsp, pre);
      Bert model(c);
      EXPECT_EQ(numel_of(model->parameters()), zt::bert_parameter_count(c)) << nsp << pre;
      EXPECT_EQ(model->nsp.is_empty(), !nsp);
      EXPECT_EQ(model->final_norm.is_empty(), !pre);
    }
  // bert-base built for real: ~110M parameters, the module agrees with the formula.
  Bert base(zt::bert_preset("bert-base"));
  EXPECT_EQ(numel_of(base->parameters()), 110'106'428);
}

TEST(BertModel, RegistrationOrderAndBlocks) {
  Bert model(tiny(true, true));
  std::vector<std::string> keys;
  for (const auto& kv : model->named_parameters()) keys.push_back(kv.key());
  ASSERT_EQ(keys.size(), 5u + 2 * 16 + 2 + 5 + 4);
  EXPECT_EQ(keys[0], "embeddings.word_embeddings.weight");
  EXPECT_EQ(keys[1], "embeddings.position_embeddings.weight");
  EXPECT_EQ(keys[2], "embeddings.token_type_embeddings.weight");
  EXPECT_EQ(keys[3], "embeddings.layer_norm.weight");
  EXPECT_EQ(keys[5], "layers.0.attention.query.weight");
  EXPECT_EQ(keys[11], "layers.0.attention.output.weight");
  EXPECT_EQ(keys[13], "layers.0.attention_norm.weight");
  EXPECT_EQ(keys[15], "layers.0.intermediate.weight");
  EXPECT_EQ(keys[20], "layers.0.output_norm.bias");
  EXPECT_EQ(keys[21], "layers.1.attention.query.weight");
  EXPECT_EQ(keys[37], "final_norm.weight");
  // A module's own parameters come before its children's in LibTorch.
  EXPECT_EQ(keys[39], "mlm.bias");
  EXPECT_EQ(keys[40], "mlm.dense.weight");
  EXPECT_EQ(keys[42], "mlm.layer_norm.weight");
  EXPECT_EQ(keys[44], "nsp.pooler.weight");
  EXPECT_EQ(keys.back(), "nsp.classifier.bias");
  // Every trainable parameter is under exactly one marked block.
  EXPECT_TRUE(zt::is_marked_block(*model->embeddings));
  for (const auto& layer : model->layers) EXPECT_TRUE(zt::is_marked_block(*layer));
  EXPECT_TRUE(zt::is_marked_block(*model->final_norm));
  EXPECT_TRUE(zt::is_marked_block(*model->mlm));
  EXPECT_TRUE(zt::is_marked_block(*model->nsp));
  EXPECT_FALSE(zt::is_marked_block(*model));
}

TEST(BertModel, InitStatisticsAndSeed) {
  auto build = [](uint64_t seed) {
    torch::manual_seed(seed);
    return Bert(tiny());
  };
  Bert a = build(3), b = build(3), c = build(4);
  auto named = a->named_parameters();
  EXPECT_NEAR(named["embeddings.word_embeddings.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(named["layers.0.intermediate.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_EQ(named["layers.0.attention.query.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(named["mlm.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(named["layers.1.output_norm.weight"], torch::ones({64})));
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  bool equal = true, differ = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    equal = equal && torch::equal(pa[i], pb[i]);
    differ = differ || !torch::equal(pa[i], pc[i]);
  }
  EXPECT_TRUE(equal);
  EXPECT_TRUE(differ);
}

TEST(BertModel, ShapesAndBadInputs) {
  Bert model(tiny());
  auto ids = torch::randint(0, 260, {3, 17}, torch::kLong);
  EXPECT_EQ(model->forward(ids).sizes(), torch::IntArrayRef({3, 17, 64}));
  EXPECT_EQ(model->forward(torch::zeros({1, 128}, torch::kInt)).sizes(), torch::IntArrayRef({1, 128, 64}));
  EXPECT_THROW(model->forward(torch::zeros({1, 129}, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(torch::zeros({4}, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(torch::zeros({1, 4}, torch::kFloat)), zt::ConfigError);
  EXPECT_THROW(model->forward(torch::full({1, 4}, 260, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(ids, torch::full({3, 17}, 2, torch::kLong)), zt::ConfigError);  // type >= 2
  EXPECT_THROW(model->forward(ids, torch::zeros({3, 16}, torch::kLong)), zt::ConfigError);
  EXPECT_THROW(model->forward(ids, {}, torch::ones({3, 16}, torch::kLong)), zt::ConfigError);

  auto batch = corpus_batch(2, 32);
  EXPECT_TRUE(std::isfinite(model->mlm_loss(batch).item<double>()));
  auto bad = batch;
  bad.masked_positions = batch.masked_positions.clone();
  bad.masked_positions[0] = 64;  // B·T = 64
  try {
    model->mlm_loss(bad);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const zt::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[0, B·T=64)"), std::string::npos) << e.what();
  }
  bad = batch;
  bad.masked_labels = batch.masked_labels.clone().fill_(260);
  EXPECT_THROW(model->mlm_loss(bad), zt::ConfigError);
  bad = batch;
  bad.nsp_labels = torch::Tensor();
  EXPECT_THROW(model->mlm_loss(bad), zt::ConfigError);
  bad = batch;
  bad.nsp_labels = torch::full_like(batch.nsp_labels, 2);
  EXPECT_THROW(model->mlm_loss(bad), zt::ConfigError);
  bad = batch;
  bad.masked_positions = torch::Tensor();
  EXPECT_THROW(model->mlm_loss(bad), zt::ConfigError);
  Bert no_nsp(tiny(false));
  EXPECT_THROW(no_nsp->nsp_logits(torch::zeros({1, 4, 64})), zt::ConfigError);
  bad = batch;
  bad.nsp_labels = torch::Tensor();
  EXPECT_NO_THROW(no_nsp->mlm_loss(bad));
}

// The key-padding mask: what stands on padded positions changes nothing at the others.
TEST(BertModel, PaddingIsMaskedOut) {
  for (bool pre : {false, true}) {
    torch::manual_seed(5);
    Bert model(tiny(true, pre));
    model->eval();
    auto batch = corpus_batch(4, 64);
    auto keep = batch.attention_mask.to(torch::kBool);
    ASSERT_GT((~keep).sum().item<int64_t>(), 0) << "the batch must have padding";
    auto a = model->forward(batch.input_ids, batch.token_type_ids, batch.attention_mask);
    auto changed = torch::where(keep, batch.input_ids, torch::randint(0, 256, batch.input_ids.sizes(), torch::kLong));
    auto b = model->forward(changed, batch.token_type_ids, batch.attention_mask);
    auto rows = keep.unsqueeze(-1).expand_as(a);
    EXPECT_LE((a - b).abs().masked_select(rows).max().item<double>(), 1e-5);
    // Without the mask the padded ids do matter: the mask is what isolates them.
    auto c = model->forward(batch.input_ids, batch.token_type_ids);
    auto d = model->forward(changed, batch.token_type_ids);
    EXPECT_GT((c - d).abs().masked_select(rows).max().item<double>(), 1e-3);
  }
}

// Post-LN and pre-LN both run, differ, and learn (a few Adam steps on one batch).
TEST(BertModel, PostAndPreLayerNormTrain) {
  auto batch = corpus_batch(4, 64);
  std::vector<double> initial;
  for (bool pre : {false, true}) {
    torch::manual_seed(0);
    Bert model(tiny(true, pre));
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
    double first = 0, last = 0;
    for (int i = 0; i < 30; ++i) {
      opt.zero_grad();
      auto loss = model->mlm_loss(batch);
      loss.backward();
      opt.step();
      if (i == 0) first = loss.item<double>();
      last = loss.item<double>();
    }
    initial.push_back(first);
    // At initialisation: ln(260) for the MLM and ln(2) for the NSP, roughly.
    EXPECT_NEAR(first, std::log(260.0) + std::log(2.0), 0.5) << "pre " << pre;
    EXPECT_LT(last, first - 1.0) << "pre " << pre << ": first " << first << " last " << last;
  }
  EXPECT_NE(initial[0], initial[1]);
}

std::vector<torch::Tensor> gradients_of(Bert& model, const std::function<torch::Tensor()>& loss_fn, double* loss) {
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  auto l = loss_fn();
  l.backward();
  *loss = l.item<double>();
  std::vector<torch::Tensor> grads;
  for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

// The MLM loss that projects only the masked rows equals the straightforward full projection, in
// value and in every parameter's gradient, and the decoder saw only the masked rows.
TEST(BertModel, MaskedOnlyProjectionEqualsFullProjection) {
  for (bool nsp : {false, true}) {
    torch::manual_seed(1);
    Bert model(tiny(nsp));
    auto batch = corpus_batch(4, 96, 3);
    const int64_t M = batch.masked_positions.numel(), BT = batch.input_ids.numel();
    double masked_loss = 0, full_loss = 0;
    auto masked = gradients_of(model, [&] { return model->mlm_loss(batch); }, &masked_loss);
    EXPECT_EQ(model->last_projected_rows(), M);
    auto full = gradients_of(model, [&] { return model->mlm_loss_full_projection(batch); }, &full_loss);
    EXPECT_EQ(model->last_projected_rows(), BT);
    EXPECT_LT(M * 5, BT) << "about 15% of the content positions";
    EXPECT_NEAR(masked_loss, full_loss, 1e-6 * std::abs(full_loss)) << "nsp " << nsp;
    ASSERT_EQ(masked.size(), full.size());
    auto names = model->named_parameters();
    for (size_t i = 0; i < masked.size(); ++i) {
      const double scale = std::max(full[i].abs().max().item<double>(), 1e-6);
      EXPECT_LE((masked[i] - full[i]).abs().max().item<double>(), 1e-5 * scale) << names[i].key();
    }
    // The parts: the loss is the MLM mean plus the NSP mean.
    auto parts = model->losses(batch);
    EXPECT_EQ(parts.nsp.defined(), nsp);
    const double sum = parts.mlm.item<double>() + (nsp ? parts.nsp.item<double>() : 0.0);
    EXPECT_NEAR(parts.total.item<double>(), sum, 1e-6 * sum);
  }
}

// Full and selective recomputation give the plain model's gradients (dropout on: the masks are
// drawn again from the saved generator states).
TEST(BertModel, CheckpointedLayersGiveThePlainGradients) {
  auto c = tiny();
  c.dropout = 0.1;
  auto batch = corpus_batch(2, 48);
  std::vector<torch::Tensor> plain;
  for (auto recompute : {zt::Recompute::None, zt::Recompute::Full, zt::Recompute::Selective}) {
    torch::manual_seed(2);
    Bert model(c);
    model->set_checkpointing({.recompute = recompute});
    EXPECT_EQ(model->is_checkpointed(1), recompute != zt::Recompute::None);
    torch::manual_seed(11);
    double loss = 0;
    auto grads = gradients_of(model, [&] { return model->mlm_loss(batch); }, &loss);
    if (plain.empty()) {
      plain = grads;
      continue;
    }
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_TRUE(torch::allclose(grads[i], plain[i], 1e-5, 1e-7)) << zt::to_string(recompute) << " " << i;
  }
  Bert model(c);
  EXPECT_THROW(model->set_checkpointing({.recompute = zt::Recompute::Full, .number_checkpoints = 3}), zt::ConfigError);
}

// ---- masking ---------------------------------------------------------------------------------

TEST(BertData, SpecialTokensFollowTheContentVocabulary) {
  EXPECT_EQ(kBytes.cls(), 256);
  EXPECT_EQ(kBytes.sep(), 257);
  EXPECT_EQ(kBytes.mask(), 258);
  EXPECT_EQ(kBytes.pad(), 259);
  EXPECT_EQ(kBytes.vocab_size(), 260);
  EXPECT_EQ(zt::bert_preset("bert-tiny").vocab_size, kBytes.vocab_size());
}

// Over 1000 batches of 8 pairs of 128 tokens (~135,000 predictions): 15% of the content
// positions are predicted (within 0.3 points: the per-sequence count is rounded), of those 80%
// [MASK], 10% a random id and 10% kept (each within 0.5 points, 4.5 to 6 standard deviations);
// specials and padding never; at least one per sequence.
TEST(BertData, MaskingStatistics) {
  zt::SentencePairSampler sampler(corpus(), pair_options(128), 8, 1, 0, 42);
  zt::MlmMasker masker({}, kBytes, 42);
  int64_t content = 0, predicted = 0, masked = 0, replaced = 0, kept = 0;
  for (int64_t step = 0; step < 1000; ++step) {
    auto original = sampler.pairs(step, 0);
    auto batch = original;
    batch.input_ids = original.input_ids.clone();
    masker.apply(batch, step, sampler.first_global_sample(0));
    auto before = original.input_ids.reshape({-1});
    auto after = batch.input_ids.reshape({-1});
    content += (before < 256).sum().item<int64_t>();
    const auto positions = batch.masked_positions;
    predicted += positions.numel();
    auto was = before.index_select(0, positions), now = after.index_select(0, positions);
    ASSERT_TRUE(torch::equal(was, batch.masked_labels));
    ASSERT_EQ((was >= 256).sum().item<int64_t>(), 0) << "a special token or padding was chosen";
    masked += (now == kBytes.mask()).sum().item<int64_t>();
    kept += (now == was).sum().item<int64_t>();
    replaced += ((now != was) & (now < 256)).sum().item<int64_t>();
    // Nothing else changed, and every row has a prediction.
    auto unchosen = torch::ones_like(before, torch::kBool).index_fill_(0, positions, false);
    ASSERT_TRUE(torch::equal(before.masked_select(unchosen), after.masked_select(unchosen)));
    ASSERT_TRUE(torch::equal(std::get<0>(at::_unique(torch::div(positions, 128, "floor"))), torch::arange(8)));
  }
  const double rate = double(predicted) / double(content);
  const double p_mask = double(masked) / predicted, p_random = double(replaced) / predicted,
               p_keep = double(kept) / predicted;
  std::printf("  %lld predictions of %lld content tokens: rate %.4f, mask %.4f, random %.4f, kept %.4f\n",
              (long long)predicted, (long long)content, rate, p_mask, p_random, p_keep);
  EXPECT_GT(predicted, 100'000);
  EXPECT_NEAR(rate, 0.15, 0.003);
  EXPECT_NEAR(p_mask, 0.8, 0.005);
  // A random id equals the original one time in 256: it then counts as kept.
  EXPECT_NEAR(p_random, 0.1 * 255.0 / 256.0, 0.005);
  EXPECT_NEAR(p_keep, 0.1 + 0.1 / 256.0, 0.005);
  EXPECT_EQ(masked + replaced + kept, predicted);
}

TEST(BertData, MaskingIsAFunctionOfSeedStepAndSample) {
  zt::SentencePairSampler sampler(corpus(), pair_options(64), 4, 1, 0, 7);
  auto mask_with = [&](uint64_t seed, int64_t step) {
    zt::MlmMasker masker({}, kBytes, seed);
    auto b = sampler.pairs(0, 0);
    masker.apply(b, step, 0);
    return b;
  };
  auto a = mask_with(1, 0), b = mask_with(1, 0), c = mask_with(2, 0), d = mask_with(1, 1);
  EXPECT_TRUE(torch::equal(a.input_ids, b.input_ids));
  EXPECT_TRUE(torch::equal(a.masked_positions, b.masked_positions));
  EXPECT_FALSE(torch::equal(a.input_ids, c.input_ids));
  EXPECT_FALSE(torch::equal(a.input_ids, d.input_ids));
  // Options: a cap, and an all-[MASK] masker.
  zt::MlmMasker capped({.probability = 0.5, .mask = 1.0, .random = 0.0, .max_predictions = 3}, kBytes, 1);
  auto e = sampler.pairs(0, 0);
  capped.apply(e, 0, 0);
  EXPECT_EQ(e.masked_positions.numel(), 4 * 3);
  EXPECT_TRUE((e.input_ids.reshape({-1}).index_select(0, e.masked_positions) == kBytes.mask()).all().item<bool>());
  EXPECT_THROW(zt::MlmMasker({.probability = 0.0}, kBytes, 1), zt::ConfigError);
  EXPECT_THROW(zt::MlmMasker({.mask = 0.95, .random = 0.1}, kBytes, 1), zt::ConfigError);
  EXPECT_THROW(zt::MlmMasker({.max_predictions = -1}, kBytes, 1), zt::ConfigError);
  BertBatch wrong;
  wrong.input_ids = torch::zeros({4}, torch::kLong);
  EXPECT_THROW(capped.apply(wrong, 0, 0), zt::ConfigError);
}

// ---- sentence pairs --------------------------------------------------------------------------

bool is_end(char c) { return c == '.' || c == '!' || c == '?' || c == '\n'; }

// A segment is whole sentences, or cut at its budget when it holds no sentence end at all.
bool whole_sentences_or_cut(const std::string& segment) {
  if (is_end(segment.back())) return true;
  for (char c : segment)
    if (is_end(c)) return false;
  return true;
}

// Where the segment after text position p starts (bert_data.h's rule, reach L).
size_t next_segment_start(std::string_view text, size_t p, size_t L) {
  size_t s = p;
  if (p > 0 && !is_end(text[p - 1])) {
    while (s < p + L && s < text.size() && !is_end(text[s])) ++s;
    if (s == p + L || s == text.size()) return p;
    ++s;
  }
  while (s < text.size() && (text[s] == ' ' || text[s] == '\n')) ++s;
  return s;
}

// [CLS] A [SEP] B [SEP] [PAD]…, token types, attention mask, only content ids inside A and B;
// segments are whole sentences unless cut; a true next B is the segment after A in the text; the
// labels are balanced.
TEST(BertData, SentencePairStructureAndBalance) {
  const std::string_view text = zt::embedded_corpus();
  zt::SentencePairSampler sampler(corpus(), pair_options(96), 16, 1, 0, 5);
  int64_t next = 0, total = 0, padded = 0, ends_with_sentence = 0, checked_next = 0;
  for (int64_t step = 0; step < 100; ++step) {
    auto b = sampler.pairs(step, 0);
    ASSERT_EQ(b.input_ids.sizes(), torch::IntArrayRef({16, 96}));
    for (int64_t i = 0; i < 16; ++i) {
      auto ids = b.input_ids[i], types = b.token_type_ids[i], mask = b.attention_mask[i];
      const auto* id = ids.data_ptr<int64_t>();
      ASSERT_EQ(id[0], kBytes.cls());
      std::vector<int64_t> seps;
      for (int64_t t = 0; t < 96; ++t)
        if (id[t] == kBytes.sep()) seps.push_back(t);
      ASSERT_EQ(seps.size(), 2u);
      const int64_t first = seps[0], second = seps[1];
      ASSERT_GE(first, 2) << "A has a token";
      ASSERT_GE(second, first + 2) << "B has a token";
      for (int64_t t = 0; t < 96; ++t) {
        const bool inside = t <= second;
        ASSERT_EQ(mask[t].item<int64_t>(), inside ? 1 : 0);
        ASSERT_EQ(types[t].item<int64_t>(), (t > first && t <= second) ? 1 : 0);
        if (!inside) ASSERT_EQ(id[t], kBytes.pad());
        if (t > 0 && t != first && t != second && inside) ASSERT_LT(id[t], 256);
      }
      padded += second < 95 ? 1 : 0;
      std::string a, bb;
      for (int64_t t = 1; t < first; ++t) a.push_back(char(id[t]));
      for (int64_t t = first + 1; t < second; ++t) bb.push_back(char(id[t]));
      ends_with_sentence += is_end(a.back()) ? 1 : 0;
      EXPECT_TRUE(whole_sentences_or_cut(a)) << a;
      EXPECT_TRUE(whole_sentences_or_cut(bb)) << bb;
      const int64_t label = b.nsp_labels[i].item<int64_t>();
      ASSERT_TRUE(label == 0 || label == 1);
      next += label == 0 ? 1 : 0;
      ++total;
      if (label == 0 && checked_next < 100) {
        // Some occurrence of A is followed by B where the next segment starts.
        bool found = false;
        for (size_t at = text.find(a); at != std::string_view::npos && !found; at = text.find(a, at + 1))
          found = text.substr(next_segment_start(text, at + a.size(), 93), bb.size()) == bb;
        EXPECT_TRUE(found) << "B does not follow A:\nA: " << a << "\nB: " << bb;
        ++checked_next;
      }
    }
  }
  const double share = double(next) / double(total);
  std::printf("  %lld pairs: %.3f true next, %.3f padded, %.3f with A ending a sentence\n", (long long)total, share,
              double(padded) / total, double(ends_with_sentence) / total);
  EXPECT_NEAR(share, 0.5, 0.04);  // 1600 draws: 3 standard deviations
  EXPECT_GT(padded, total / 2) << "whole sentences rarely fill the budget exactly";
  EXPECT_GT(ends_with_sentence, total / 4) << "A is cut at sentence ends where it can";
}

// A rank's micro-batch is its slice of the one-rank micro-batch of the same global batch, masking
// included.
TEST(BertData, GlobalBatchDoesNotDependOnTheWorldSize) {
  zt::MlmMasker masker({}, kBytes, 9);
  zt::SentencePairSampler one(corpus(), pair_options(48), 6, 1, 0, 9);
  for (int64_t micro = 0; micro < 2; ++micro) {
    auto whole = one.batch(4, micro, masker);
    std::vector<torch::Tensor> ids, positions;
    int64_t offset = 0;
    for (int rank = 0; rank < 3; ++rank) {
      zt::SentencePairSampler part(corpus(), pair_options(48), 2, 3, rank, 9);
      auto b = part.batch(4, micro, masker);
      ids.push_back(b.input_ids);
      positions.push_back(b.masked_positions + offset);
      offset += b.input_ids.numel();
      EXPECT_TRUE(torch::equal(b.nsp_labels, whole.nsp_labels.narrow(0, 2 * rank, 2)));
    }
    EXPECT_TRUE(torch::equal(torch::cat(ids), whole.input_ids));
    EXPECT_TRUE(torch::equal(torch::cat(positions), whole.masked_positions));
  }
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("zt_bert_test_" + std::to_string(::getpid()));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// .bin data without sentence ends is cut at lengths; too little data and ids outside the content
// vocabulary are named errors.
TEST(BertData, BinFilesAndTheirErrors) {
  TempDir dir;
  std::vector<uint16_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t('a' + i % 26);
  zt::TokenDataset::write_bin_file(dir / "letters.bin", tokens);
  const auto data = zt::TokenDataset::from_bin_file(dir / "letters.bin");
  zt::SentencePairSampler sampler(data, pair_options(64), 8, 1, 0, 3);
  auto b = sampler.pairs(0, 0);
  // No sentence end anywhere: A and B together fill the 61 content places, so no padding.
  EXPECT_EQ(b.attention_mask.sum().item<int64_t>(), 8 * 64);
  // A true next B continues the alphabet where A stopped.
  for (int64_t i = 0; i < 8; ++i) {
    if (b.nsp_labels[i].item<int64_t>() != 0) continue;
    auto row = b.input_ids[i];
    int64_t first = 0;
    while (row[first].item<int64_t>() != kBytes.sep()) ++first;
    EXPECT_EQ((row[first - 1].item<int64_t>() - 'a' + 1) % 26, row[first + 1].item<int64_t>() - 'a');
  }

  std::vector<uint16_t> few(5 * 61);
  zt::TokenDataset::write_bin_file(dir / "short.bin", few);
  EXPECT_THROW(
      zt::SentencePairSampler(zt::TokenDataset::from_bin_file(dir / "short.bin"), pair_options(64), 1, 1, 0, 0),
      zt::DataError);
  std::vector<uint16_t> wide(5000, 300);
  zt::TokenDataset::write_bin_file(dir / "wide.bin", wide);
  zt::SentencePairSampler bpe(zt::TokenDataset::from_bin_file(dir / "wide.bin"), pair_options(64), 1, 1, 0, 0);
  try {
    bpe.pairs(0, 0);
    ADD_FAILURE() << "expected DataError";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("wide.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ids < 256"), std::string::npos) << e.what();
  }
  // With its own content vocabulary the same data is fine.
  auto options = pair_options(64);
  options.specials.content_vocab = 50257;
  EXPECT_NO_THROW(
      zt::SentencePairSampler(zt::TokenDataset::from_bin_file(dir / "wide.bin"), options, 1, 1, 0, 0).pairs(0, 0));
  EXPECT_THROW(zt::SentencePairSampler(data, pair_options(4), 1, 1, 0, 0), zt::ConfigError);
  EXPECT_THROW(zt::SentencePairSampler(data, pair_options(64), 1, 2, 2, 0), zt::ConfigError);
  zt::MlmMasker other({}, zt::BertSpecialTokens{50257}, 0);
  EXPECT_THROW(sampler.batch(0, 0, other), zt::ConfigError);
}

// ---- ZeRO stages -----------------------------------------------------------------------------

std::shared_ptr<zt::Communicator> rank_communicator() {
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

zt::TrainConfig make_config(int stage, const std::string& optimizer, int world) {
  const std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "optimizer": {"type": ")" + optimizer + R"(", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(stage) +
                           R"(, "overlap_comm": true, "reduce_bucket_size": 20000,
    "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50000,
    "stage3_max_live_parameters": 60000}})";
  return zt::parse_config(json, {}, world);
}

struct RunResult {
  std::vector<double> losses, grad_norms;
  torch::Tensor final_parameters;  // stages 0-2: every trainable parameter, concatenated
  int64_t psi = 0, peak_gathered = 0, prefetched = 0;
  bool released_between_steps = true;  // stage 3: no parameter has storage after a step
};

constexpr int kSteps = 5;

// bert-tiny with NSP from a fixed seed, 5 optimizer steps of 2 micro-steps on this rank's slice
// of the global batch (pairs of 48 tokens from the embedded corpus).
// `reuse_distance`: zero_optimization.stage3_max_reuse_distance.
RunResult train(std::shared_ptr<zt::Communicator> comm, int stage, const std::string& optimizer,
                int64_t reuse_distance = 1'000'000'000) {
  const int rank = comm->rank(), world = comm->world_size();
  torch::manual_seed(7);
  Bert model(tiny());
  auto config = make_config(stage, optimizer, world);
  config.zero.stage3_max_reuse_distance = reuse_distance;
  zt::Engine engine(model.ptr(), config, comm);
  zt::SentencePairSampler sampler(corpus(), pair_options(48), 2, world, rank, 17);
  zt::MlmMasker masker({}, kBytes, 17);
  RunResult result;
  for (int step = 0; step < kSteps; ++step) {
    double loss_sum = 0;
    zt::StepResult r;
    for (int micro = 0; micro < 2; ++micro) {
      auto loss = model->mlm_loss(sampler.batch(step, micro, masker));
      loss_sum += loss.item<double>();
      engine.backward(loss);
      r = engine.step();
    }
    EXPECT_TRUE(r.boundary);
    result.losses.push_back(loss_sum / 2);
    result.grad_norms.push_back(r.grad_norm);
    if (stage == 3)
      for (const auto& p : model->parameters())
        if (p.storage().nbytes() > 0) result.released_between_steps = false;
  }
  if (stage < 3) {
    std::vector<torch::Tensor> flat;
    for (auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
    result.final_parameters = torch::cat(flat);
  }
  result.psi = engine.trainable_parameters();
  result.peak_gathered = engine.diagnostics().peak_gathered_parameter_bytes;
  result.prefetched = engine.diagnostics().prefetched_blocks;
  return result;
}

// As tests/zero_test.cpp's GPT parity: losses and gradient norms within 1e-5 relative, final
// weights within 1e-5; stage 3 gathers and releases the layers: at the default reuse distance
// every block of this small model stays gathered from forward to backward, at distance 0 each is
// released after its use, so the whole model is never live at once.
void expect_stages_equal_stage_zero(const std::string& optimizer) {
  auto comm = rank_communicator();
  const auto reference = train(comm, 0, optimizer);
  for (double loss : reference.losses) EXPECT_TRUE(std::isfinite(loss));
  for (double norm : reference.grad_norms) EXPECT_GT(norm, 0.5) << "clipping must be active on every step";
  EXPECT_LT(reference.losses.back(), reference.losses.front()) << "the reference must learn";
  for (auto [stage, reuse_distance] : {std::pair<int, int64_t>{1, 1'000'000'000}, {2, 1'000'000'000},
                                       {3, 1'000'000'000}, {3, 0}}) {
    const auto run = train(comm, stage, optimizer, reuse_distance);
    const std::string what = optimizer + " stage " + std::to_string(stage) + (reuse_distance == 0 ? " (reuse distance 0)" : "") +
                             " on " + std::to_string(comm->world_size()) + " ranks";
    ASSERT_EQ(run.losses.size(), reference.losses.size());
    for (size_t i = 0; i < run.losses.size(); ++i) {
      EXPECT_LE(std::abs(run.losses[i] - reference.losses[i]) / std::abs(reference.losses[i]), 1e-5)
          << what << " step " << i << ": " << reference.losses[i] << " vs " << run.losses[i];
      EXPECT_NEAR(run.grad_norms[i], reference.grad_norms[i], 1e-5 * reference.grad_norms[i]) << what << " " << i;
    }
    std::printf("  %s: losses %.6f … %.6f, norms %.4f … %.4f, peak gathered %lld of %lld bytes, %lld prefetched\n",
                what.c_str(), run.losses.front(), run.losses.back(), run.grad_norms.front(), run.grad_norms.back(),
                (long long)run.peak_gathered, (long long)run.psi * 4, (long long)run.prefetched);
    if (stage < 3) {
      EXPECT_LE((run.final_parameters - reference.final_parameters).abs().max().item<double>(), 1e-5) << what;
    } else {
      EXPECT_TRUE(run.released_between_steps) << what;
      EXPECT_GT(run.peak_gathered, 0) << what;
      if (reuse_distance == 0) EXPECT_LT(run.peak_gathered, run.psi * 4) << what << ": never the whole model at once";
      else EXPECT_GE(run.peak_gathered, run.psi * 4) << what << ": every block kept from forward to backward";
      EXPECT_GT(run.prefetched, 0) << what << ": the layers are prefetched along the recorded order";
    }
  }
}

void expect_ranks_pass(const std::string& filter) {
  for (int world : {1, 2, 3}) {
    auto r = run_ranks(world, filter, {{"ZT_COMM_TIMEOUT_SECONDS", "60"}}, std::chrono::seconds(240));
    EXPECT_TRUE(r.all_succeeded()) << filter << " on " << world << " ranks failed:\n" << r.describe();
  }
}

}  // namespace

TEST(BertParity, AdamWStagesEqualStageZero) {
  if (is_rank_process()) return expect_stages_equal_stage_zero("AdamW");
  expect_ranks_pass("BertParity.AdamWStagesEqualStageZero");
}

// LAMB's per-tensor trust ratios need the norms of tensors split across ranks.
TEST(BertParity, LambStagesEqualStageZero) {
  if (is_rank_process()) return expect_stages_equal_stage_zero("Lamb");
  expect_ranks_pass("BertParity.LambStagesEqualStageZero");
}
