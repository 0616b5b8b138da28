// Activation checkpointing: gradients with recomputation equal those without, bitwise, with
// dropout, at every ZeRO stage and world size; the options of the activation_checkpointing block.
#include <gtest/gtest.h>

#include <optional>

#include "support/multirank.h"
#include "zerotrain/models/activation_checkpointing.h"
#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt.h"

namespace {

using zt::Recompute;
using zt::testing::is_rank_process;
using zt::testing::run_ranks;

zt::GPTConfig tiny_with_dropout(int64_t loss_chunk_tokens = 0) {
  auto c = zt::gpt_preset("tiny");
  c.dropout = 0.1;
  c.loss_chunk_tokens = loss_chunk_tokens;
  return c;
}

zt::GPTImpl::Checkpointing policy(Recompute r) {
  zt::GPTImpl::Checkpointing c;
  c.recompute = r;
  return c;
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || (a.sizes() == b.sizes() && torch::equal(a, b)));
}

// Every gradient each parameter receives, in arrival order (tensor hooks fire once per gradient
// autograd delivers to the parameter).
struct GradientLog {
  std::vector<std::vector<torch::Tensor>> per_parameter;
  void attach(torch::nn::Module& model) {
    auto params = model.parameters();
    per_parameter.assign(params.size(), {});
    for (size_t i = 0; i < params.size(); ++i)
      params[i].register_hook([this, i](const torch::Tensor& g) { per_parameter[i].push_back(g.clone()); });
  }
};

void expect_same_gradients(const GradientLog& a, const GradientLog& b, const std::string& what) {
  ASSERT_EQ(a.per_parameter.size(), b.per_parameter.size()) << what;
  for (size_t i = 0; i < a.per_parameter.size(); ++i) {
    ASSERT_EQ(a.per_parameter[i].size(), b.per_parameter[i].size()) << what << ": parameter " << i << " hook calls";
    for (size_t k = 0; k < a.per_parameter[i].size(); ++k)
      EXPECT_TRUE(bitwise_equal(a.per_parameter[i][k], b.per_parameter[i][k]))
          << what << ": parameter " << i << " gradient " << k;
  }
}

// Two micro-batches accumulated into .grad, plain autograd, dropout on; the generator is not
// reseeded between them, so a recomputation that disturbed it would show.
struct PlainRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;
  GradientLog log;
};

PlainRun plain_run(const zt::GPTImpl::Checkpointing& settings, int64_t loss_chunk_tokens = 0) {
  torch::manual_seed(3);
  zt::GPT model(tiny_with_dropout(loss_chunk_tokens));
  model->set_checkpointing(settings);
  model->train();
  PlainRun run;
  run.log.attach(*model);
  for (int micro = 0; micro < 2; ++micro) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + micro);
    auto tokens = torch::randint(0, 256, {2, 33}, gen, torch::kLong);
    auto loss = model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32));
    loss.backward();
    run.losses.push_back(loss.item<double>());
  }
  for (auto& p : model->parameters()) run.grads.push_back(p.grad().clone());
  return run;
}

}  // namespace

TEST(ActivationCheckpointing, PlainGradientsEqualBitwiseWithDropout) {
  // Whole and in chunks of 16 of the 64 tokens (full recomputation checkpoints each chunk).
  for (int64_t chunk : {0, 16}) {
  const PlainRun reference = plain_run(policy(Recompute::None), chunk);
  for (Recompute r : {Recompute::Full, Recompute::Selective}) {
    for (int64_t n : {0, 1}) {
      auto settings = policy(r);
      settings.number_checkpoints = n;
      const std::string what = std::string(zt::to_string(r)) + " number_checkpoints " + std::to_string(n) +
                               " loss chunk " + std::to_string(chunk);
      const PlainRun run = plain_run(settings, chunk);
      EXPECT_EQ(run.losses, reference.losses) << what;
      ASSERT_EQ(run.grads.size(), reference.grads.size());
      for (size_t i = 0; i < run.grads.size(); ++i)
        EXPECT_TRUE(bitwise_equal(run.grads[i], reference.grads[i])) << what << " parameter " << i;
      expect_same_gradients(reference.log, run.log, what);
    }
  }
  }
}

TEST(ActivationCheckpointing, ChunkedLossEqualsTheWholeOneUpToRounding) {
  const PlainRun whole = plain_run(policy(Recompute::None), 0);
  for (int64_t chunk : {7, 16, 64, 1000}) {
    const PlainRun chunked = plain_run(policy(Recompute::Full), chunk);
    for (size_t i = 0; i < whole.losses.size(); ++i)
      EXPECT_NEAR(chunked.losses[i], whole.losses[i], 1e-6 * whole.losses[i]) << "chunk " << chunk;
    for (size_t i = 0; i < whole.grads.size(); ++i)
      EXPECT_LE((chunked.grads[i] - whole.grads[i]).abs().max().item<double>(),
                1e-5 * whole.grads[i].abs().max().item<double>() + 1e-9)
          << "chunk " << chunk << " parameter " << i;
  }
  // Ignored targets (-100) are left out of the mean, as cross_entropy's default does.
  torch::manual_seed(3);
  zt::GPT a(tiny_with_dropout(0));
  torch::manual_seed(3);
  zt::GPT b(tiny_with_dropout(5));
  a->eval();
  b->eval();
  torch::NoGradGuard no_grad;
  auto idx = torch::randint(0, 256, {2, 12}, torch::kLong);
  auto targets = idx.clone();
  targets.index_put_({0, torch::indexing::Slice(0, 4)}, -100);
  const double whole_loss = a->loss(idx, targets).item<double>();
  EXPECT_NEAR(b->loss(idx, targets).item<double>(), whole_loss, 1e-6 * whole_loss);
}

TEST(ActivationCheckpointing, DropoutMakesGradientsDependOnTheGenerator) {
  // The comparison above is meaningful only if dropout draws from the generator the
  // checkpoints restore: shifting that generator changes the gradients.
  torch::manual_seed(3);
  zt::GPT model(tiny_with_dropout());
  model->train();
  auto tokens = torch::randint(0, 256, {2, 33}, torch::kLong);
  auto run_once = [&] {
    model->zero_grad();
    model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32)).backward();
    return model->parameters()[2].grad().clone();
  };
  torch::manual_seed(10);
  auto a = run_once();
  torch::manual_seed(11);
  auto b = run_once();
  EXPECT_FALSE(torch::equal(a, b));
}

TEST(ActivationCheckpointing, FullKeepsOnlyBlockInputsAndRecomputesOnce) {
  torch::manual_seed(3);
  zt::GPT model(tiny_with_dropout());
  auto settings = policy(Recompute::Full);
  settings.profile = true;
  model->set_checkpointing(settings);
  model->train();
  auto tokens = torch::randint(0, 256, {2, 33}, torch::kLong);
  for (int i = 0; i < 3; ++i) {
    auto loss = model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32));
    loss.backward();
  }
  const auto timings = model->checkpoint_timings();
  ASSERT_EQ(timings.size(), 2u);
  for (const auto& t : timings) {
    EXPECT_EQ(t.forward_calls, 3);
    EXPECT_EQ(t.recomputations, 3);
    EXPECT_GT(t.forward_seconds, 0);
    EXPECT_GT(t.recompute_seconds, 0);
  }
  // Evaluation runs each block once, plainly.
  {
    torch::NoGradGuard no_grad;
    model->eval();
    model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32));
  }
  EXPECT_EQ(model->checkpoint_timings()[0].forward_calls, 3);
}

TEST(ActivationCheckpointing, SecondBackwardThroughACheckpointIsAnError) {
  torch::manual_seed(3);
  zt::GPT model(zt::gpt_preset("tiny"));
  model->set_checkpointing(policy(Recompute::Full));
  auto tokens = torch::randint(0, 256, {1, 9}, torch::kLong);
  auto loss = model->loss(tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8));
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    FAIL() << "expected zt::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backward ran a second time"), std::string::npos) << e.what();
  } catch (const zt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backward ran a second time"), std::string::npos) << e.what();
  }
}

TEST(ActivationCheckpointing, BlockWhoseInputNeedsNoGradientStillTrainsItsWeights) {
  torch::manual_seed(1);
  auto linear = torch::nn::Linear(8, 8);
  auto x = torch::randn({4, 8});  // data: no gradient
  auto plain = linear(x).square().sum();
  plain.backward();
  auto expected = linear->weight.grad().clone();
  linear->zero_grad();
  auto y = zt::run_checkpointed_block(*linear, x, [l = linear.ptr()](const torch::Tensor& in) { return l->forward(in); });
  ASSERT_TRUE(y.requires_grad());
  y.square().sum().backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), expected));
}

TEST(ActivationCheckpointing, RecomputeInBackwardFreesTheTensorAndRestoresIt) {
  torch::manual_seed(1);
  auto h = torch::randn({16, 32}, torch::requires_grad());
  auto w = torch::randn({8, 32}, torch::requires_grad());
  auto reference = [&] {
    auto a = torch::gelu(h, "tanh");
    return torch::nn::functional::linear(a, w).sum();
  };
  reference().backward();
  auto gh = h.grad().clone(), gw = w.grad().clone();
  h.mutable_grad().reset();
  w.mutable_grad().reset();
  auto a = torch::gelu(h, "tanh");
  auto y = torch::nn::functional::linear(a, w);
  y = zt::recompute_in_backward(y, a, [h](torch::Tensor& into) { at::gelu_out(into, h.detach(), "tanh"); });
  EXPECT_EQ(a.storage().nbytes(), 0u) << "freed after the projection read it";
  y.sum().backward();
  EXPECT_TRUE(torch::equal(h.grad(), gh));
  EXPECT_TRUE(torch::equal(w.grad(), gw));
}

// The refilled memory lives only as long as the saved tensors that read it: freed when their
// nodes have run, not at the end of backward (a chunked loss would otherwise hold every chunk's
// log-softmax at once).
TEST(ActivationCheckpointing, RecomputedMemoryIsFreedOnceItsReadersHaveRun) {
  torch::manual_seed(1);
  auto h = torch::randn({16, 32}, torch::requires_grad());
  auto w = torch::randn({8, 32}, torch::requires_grad());
  c10::weak_intrusive_ptr<c10::StorageImpl> weak = c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(nullptr);
  torch::Tensor y;
  {
    auto a = torch::gelu(h, "tanh");
    weak = a.storage().getWeakStorageImpl();
    y = zt::recompute_in_backward(torch::nn::functional::linear(a, w), a,
                                  [h](torch::Tensor& into) { at::gelu_out(into, h.detach(), "tanh"); });
  }
  // h's gradient is computed after the projection's backward (which read the refilled tensor)
  // while the graph, and the node that refilled it, are still alive.
  bool freed_during_backward = false;
  h.register_hook([&](const torch::Tensor&) { freed_during_backward = weak.expired(); });
  y.sum().backward();
  EXPECT_TRUE(freed_during_backward);
}

TEST(ActivationCheckpointing, ContiguousArenaAllocatesOnceAndCpuCheckpointingIsTheIdentityOnCpu) {
  const PlainRun reference = plain_run(policy(Recompute::Full));
  auto settings = policy(Recompute::Full);
  settings.contiguous_memory = true;
  settings.keep_inputs_on_host = true;
  settings.synchronize_boundary = true;
  torch::manual_seed(3);
  zt::GPT model(tiny_with_dropout());
  model->set_checkpointing(settings);
  model->train();
  std::vector<double> losses;
  for (int micro = 0; micro < 2; ++micro) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + micro);
    auto tokens = torch::randint(0, 256, {2, 33}, gen, torch::kLong);
    auto loss = model->loss(tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32));
    loss.backward();
    losses.push_back(loss.item<double>());
  }
  EXPECT_EQ(losses, reference.losses);
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i].grad(), reference.grads[i])) << i;
  const auto stats = model->checkpoint_arena_stats();
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->slots, 2);
  EXPECT_EQ(stats->buffer_allocations, 1) << "sized by the first step, reused by the second";
  EXPECT_EQ(stats->stores, 4);
  EXPECT_EQ(stats->overflows, 0);
  EXPECT_EQ(stats->slot_bytes, 2 * 32 * 64 * 4);
}

TEST(ActivationCheckpointing, ArenaOverflowsWhenAllSlotsAreHeld) {
  zt::CheckpointArena arena(1);
  auto a = torch::ones({4});
  auto [stored, slot] = arena.store(a);
  EXPECT_TRUE(torch::equal(stored, a));
  EXPECT_NE(stored.data_ptr(), a.data_ptr());
  auto [second, none] = arena.store(a * 2);
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(arena.stats().overflows, 1);
  slot.reset();
  auto [third, again] = arena.store(a * 3);
  EXPECT_NE(again, nullptr);
  EXPECT_EQ(third.data_ptr(), stored.data_ptr()) << "the freed slot is reused";
  EXPECT_EQ(arena.stats().buffer_allocations, 1);
}

TEST(ActivationCheckpointing, NumberOfCheckpointsSpreadsEvenlyAndIsChecked) {
  auto c = zt::gpt_preset("tiny");
  c.n_layer = 6;
  zt::GPT model(c);
  auto settings = policy(Recompute::Full);
  settings.number_checkpoints = 2;
  model->set_checkpointing(settings);
  std::vector<int64_t> chosen;
  for (int64_t i = 0; i < 6; ++i)
    if (model->is_checkpointed(i)) chosen.push_back(i);
  EXPECT_EQ(chosen, (std::vector<int64_t>{2, 5}));  // every third block
  settings.number_checkpoints = 7;
  EXPECT_THROW(model->set_checkpointing(settings), zt::ConfigError);
  settings.number_checkpoints = -1;
  EXPECT_THROW(model->set_checkpointing(settings), zt::ConfigError);
}

// ---- with the engine, at every stage and world size --------------------------------------------

namespace {

std::shared_ptr<zt::Communicator> rank_communicator() {
  // Up to three ranks share two cores: one intra-op thread each.
  at::set_num_threads(1);
  return zt::make_communicator(zt::rendezvous_from_environment(), zt::comm_options_from_environment());
}

struct EngineRun {
  std::vector<double> losses, norms;
  GradientLog log;
  int64_t peak_gathered = 0;
};

EngineRun engine_run(std::shared_ptr<zt::Communicator> comm, int stage, Recompute recompute, int steps) {
  const int rank = comm->rank(), world = comm->world_size();
  const std::string json = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05, "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )" + std::to_string(stage) +
                           R"(, "reduce_bucket_size": 5000, "overlap_comm": true,
    "stage3_param_persistence_threshold": 0}})";
  const auto config = zt::parse_config(json, {}, world);
  torch::manual_seed(7);
  std::optional<zt::ShardedConstruction> sharded;
  if (stage == 3) sharded.emplace(rank, world);
  zt::GPT model(tiny_with_dropout(/*loss_chunk_tokens=*/16));  // two chunks of the 32 tokens
  sharded.reset();
  model->set_checkpointing(policy(recompute));
  model->train();
  zt::Engine engine(model.ptr(), config, comm);
  EngineRun run;
  run.log.attach(*model);
  for (int step = 0; step < steps; ++step) {
    double sum = 0;
    zt::StepResult r;
    for (int a = 0; a < 2; ++a) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 10 * step + a);
      auto tokens = torch::randint(0, 256, {2, 17}, gen, torch::kLong);
      auto loss = model->loss(tokens.narrow(1, 0, 16), tokens.narrow(1, 1, 16));
      sum += loss.item<double>();
      engine.backward(loss);
      r = engine.step();
    }
    run.losses.push_back(sum);
    run.norms.push_back(r.grad_norm);
  }
  run.peak_gathered = engine.diagnostics().peak_gathered_parameter_bytes;
  return run;
}

}  // namespace

// Losses, gradient norms and every gradient each parameter received over 10 steps of 2
// micro-steps, bitwise, for full and selective recomputation against none, at stages 0-3 on
// `world` ranks.
void expect_engine_bitwise(int world) {
  const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  if (is_rank_process()) {
    auto comm = rank_communicator();
    for (int stage = 0; stage <= 3; ++stage) {
      const EngineRun reference = engine_run(comm, stage, Recompute::None, 10);
      for (Recompute r : {Recompute::Full, Recompute::Selective}) {
        const std::string what = "stage " + std::to_string(stage) + " " + zt::to_string(r) + " on " +
                                 std::to_string(comm->world_size()) + " rank(s)";
        const EngineRun run = engine_run(comm, stage, r, 10);
        EXPECT_EQ(run.losses, reference.losses) << what;
        EXPECT_EQ(run.norms, reference.norms) << what;
        expect_same_gradients(reference.log, run.log, what);
        // Stage 3: the recomputation gathers the block once more, within the same live budget.
        EXPECT_EQ(run.peak_gathered, reference.peak_gathered) << what;
      }
    }
    return;
  }
  auto r = run_ranks(world, "ActivationCheckpointing." + name, {{"ZT_COMM_TIMEOUT_SECONDS", "60"}},
                     std::chrono::seconds(240));
  EXPECT_TRUE(r.all_succeeded()) << world << " rank(s):\n" << r.describe();
}

TEST(ActivationCheckpointing, EngineGradientsEqualBitwiseOnOneRank) { expect_engine_bitwise(1); }
TEST(ActivationCheckpointing, EngineGradientsEqualBitwiseOnTwoRanks) { expect_engine_bitwise(2); }
TEST(ActivationCheckpointing, EngineGradientsEqualBitwiseOnThreeRanks) { expect_engine_bitwise(3); }
