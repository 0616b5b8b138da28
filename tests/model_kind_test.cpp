// The model interface (zerotrain/models/model_kind.h): each model.type's kind gives the shape,
// figures and data of its model, builds it, and the built model's loss is the model's own.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "zerotrain/config/bert_config.h"
#include "zerotrain/config/config.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/config/llama_config.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"
#include "zerotrain/models/model_kind.h"

namespace {

zt::TrainConfig config_of(const std::string& type) {
  return zt::parse_config(R"({"model": {"type": ")" + type + R"("}, "train_micro_batch_size_per_gpu": 2})", {}, 1);
}

TEST(ModelKind, EachTypeGivesItsModelsShapeAndDataKind) {
  const zt::TrainConfig gpt_config = config_of("gpt"), bert_config = config_of("bert"), llama_config = config_of("llama");
  const auto gpt = zt::make_model_kind(gpt_config);
  const zt::GPTConfig g = zt::gpt_config_of(gpt_config);
  EXPECT_EQ(gpt->data_kind(), zt::DataKind::TokenWindows);
  EXPECT_EQ(gpt->parameters(), zt::gpt_parameter_count(g));
  EXPECT_EQ(gpt->layers(), g.n_layer);
  EXPECT_EQ(gpt->context_length(), g.context_length);
  EXPECT_EQ(gpt->data_vocabulary(), g.vocab_size);

  const auto bert = zt::make_model_kind(bert_config);
  const zt::BertConfig b = zt::bert_config_of(bert_config);
  EXPECT_EQ(bert->data_kind(), zt::DataKind::SentencePairs);
  EXPECT_EQ(bert->parameters(), zt::bert_parameter_count(b));
  EXPECT_EQ(bert->data_vocabulary(), b.vocab_size - 4) << "the content ids, before [CLS], [SEP], [MASK], [PAD]";
  EXPECT_EQ(bert->sentence_pair_specials().content_vocab, b.vocab_size - 4);
  EXPECT_NE(bert->batch_note().find("of the content positions predicted"), std::string::npos);

  const auto llama = zt::make_model_kind(llama_config);
  const zt::LlamaConfig l = zt::llama_config_of(llama_config);
  EXPECT_EQ(llama->data_kind(), zt::DataKind::TokenWindows);
  EXPECT_EQ(llama->parameters(), zt::llama_parameter_count(l));
  EXPECT_EQ(llama->context_length(), l.max_position_embeddings);
  EXPECT_EQ(llama->carried_hf_config(), "") << "a preset has no config.json to carry";
  EXPECT_THROW(gpt->sentence_pair_specials(), zt::Error);
}

TEST(ModelKind, TheEstimateModelsTheDecodersAndSaysWhyNotTheBert) {
  const zt::TrainConfig gpt_config = config_of("gpt");
  const auto figures = zt::estimate_figures_of(gpt_config, 1);
  ASSERT_TRUE(figures.has_value());
  EXPECT_EQ(figures->parameters, zt::gpt_parameter_count(zt::gpt_config_of(gpt_config)));
  EXPECT_EQ(figures->sequence_length, zt::gpt_config_of(gpt_config).context_length) << "data.sequence_length 0";
  EXPECT_TRUE(zt::estimate_figures_of(config_of("llama"), 1).has_value());
  EXPECT_FALSE(zt::estimate_figures_of(config_of("bert"), 1).has_value());
  EXPECT_EQ(zt::make_model_kind(config_of("bert"))->estimate_gap(), "the memory estimate models the GPT and the Llama");
  // The GPT splits its heads and vocabulary evenly over a tensor group, or not at all.
  const int64_t heads = zt::gpt_config_of(gpt_config).n_head;
  EXPECT_FALSE(zt::estimate_figures_of(gpt_config, int(heads) + 1).has_value());
  EXPECT_TRUE(zt::make_model_kind(gpt_config)->profiles_flops(1));
  EXPECT_FALSE(zt::make_model_kind(config_of("llama"))->profiles_flops(1));
}

TEST(ModelKind, TheBuiltModelsLossIsTheModelsOwn) {
  const zt::TrainConfig config = config_of("gpt");
  const auto kind = zt::make_model_kind(config);
  torch::manual_seed(3);
  const auto built = kind->build(nullptr);
  torch::manual_seed(3);
  zt::GPT reference(zt::gpt_config_of(config));
  zt::Batch batch;
  batch.inputs = torch::randint(0, kind->data_vocabulary(), {2, 8}, torch::kLong);
  batch.targets = torch::randint(0, kind->data_vocabulary(), {2, 8}, torch::kLong);
  built->module()->eval();
  reference->eval();
  EXPECT_EQ(built->loss(batch).item<double>(), reference->loss(batch.inputs, batch.targets).item<double>());
  EXPECT_THROW(built->loss(zt::BertBatch{}), zt::Error) << "a GPT handed BERT's sentence pairs";
}

TEST(ModelKind, AnUnknownTypeNamesTheKnownOnes) {
  zt::TrainConfig config = config_of("gpt");
  config.model.type = "mamba";
  try {
    zt::make_model_kind(config);
    FAIL() << "no error";
  } catch (const zt::ConfigError& e) {
    EXPECT_STREQ(e.what(), "model.type: expected one of gpt, bert, llama, found \"mamba\"");
  }
  EXPECT_EQ(zt::model_kind_types(), (std::vector<std::string>{"gpt", "bert", "llama"}));
}

}  // namespace
