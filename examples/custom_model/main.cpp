// A plain LibTorch training loop for the user's own model, changed to train with zerotrain.
// Every changed line is marked "zerotrain:"; the rest is what the user already had.
//
// Run on 2 local ranks:  zerotrain launch --nproc 2 -- build/bin/custom_model_example [config.json]
// or under torchrun --no-python / srun / mpirun (the rank variables come from the environment).
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "zerotrain/zero/blocks.h"  // zerotrain: (stage 3 only)
#include "zerotrain/comm/comm.h"    // zerotrain:
#include "zerotrain/config/config.h"  // zerotrain:
#include "zerotrain/zero/engine.h"  // zerotrain:

// The user's own model: a small residual MLP regressing a fixed random function.
struct RegressorImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr}, hidden{nullptr}, out{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  RegressorImpl(int64_t features, int64_t width) {
    in = register_module("in", torch::nn::Linear(features, width));
    hidden = register_module("hidden", torch::nn::Linear(width, width));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    out = register_module("out", torch::nn::Linear(width, 1));
    // zerotrain: (stage 3 only) the modules whose parameters are gathered together; each marked
    // after its parameters hold their initial values. Unmarked ones (norm) stay whole.
    zt::mark_block(in.ptr());
    zt::mark_block(hidden.ptr());
    zt::mark_block(out.ptr());
  }
  torch::Tensor forward(torch::Tensor x) {
    // zerotrain: (stage 3 only) each marked module runs through zt::run_block.
    auto h = torch::gelu(zt::run_block(*in, x, [&](const torch::Tensor& t) { return in(t); }));
    h = h + torch::gelu(zt::run_block(*hidden, norm(h), [&](const torch::Tensor& t) { return hidden(t); }));
    return zt::run_block(*out, h, [&](const torch::Tensor& t) { return out(t); }).squeeze(-1);
  }
};
TORCH_MODULE(Regressor);

int main(int argc, char** argv) try {
  const int64_t features = 16, micro_batch = 32, steps = 60;
  auto comm = zt::make_communicator(zt::rendezvous_from_environment(),   // zerotrain:
                                    zt::comm_options_from_environment({}));
  std::string config_json = R"({"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}, "gradient_clipping": 1.0})";
  auto config = argc > 1 ? zt::load_config(argv[1], {}, comm->world_size())          // zerotrain:
                         : zt::parse_config(config_json, {}, comm->world_size());    // zerotrain:

  torch::manual_seed(7);
  std::optional<zt::ShardedConstruction> sharded;  // zerotrain: (stage 3 only) build already sharded
  if (config.zero.shard_parameters) sharded.emplace(comm->rank(), comm->world_size());  // zerotrain:
  Regressor model(features, 64);
  sharded.reset();  // zerotrain:
  auto target_weights = torch::randn({features});
  // Before: torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  zt::Engine engine(model.ptr(), config, comm);  // zerotrain: replaces the optimizer

  torch::manual_seed(100 + comm->rank());  // each rank draws its own data
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    auto x = torch::randn({micro_batch, features});
    auto y = torch::sin(x.matmul(target_weights));
    auto loss = torch::mse_loss(model->forward(x), y);
    // Before: optimizer.zero_grad(); loss.backward(); optimizer.step();
    engine.backward(loss);  // zerotrain:
    engine.step();          // zerotrain:
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    if (comm->rank() == 0 && (step % 10 == 0 || step + 1 == steps))
      std::printf("step %lld loss %.5f\n", static_cast<long long>(step), loss.item<double>());
  }
  if (comm->rank() == 0) std::printf("first loss %.5f final loss %.5f\n", first, last);
  return last < first ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "custom_model_example: error: %s\n", e.what());
  return 1;
}
