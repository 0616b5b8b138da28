// The loop a user writes without zerotrain: the same GPT, torch::optim::AdamW, LibTorch's default
// allocation behaviour, 2 intra-op threads. Prints one JSON line with tokens/s. Compared side by
// side with `zerotrain train` by bench/train_speed.sh (results in docs/benchmarks.md).
#include <fmt/format.h>

#include <chrono>

#include "zerotrain/data/data.h"
#include "zerotrain/models/gpt.h"

int main(int argc, char** argv) {
  const std::string preset = argc > 1 ? argv[1] : "gpt2-124m";
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 4;
  const int64_t seq = argc > 3 ? std::atoll(argv[3]) : 64;
  const int warmup = argc > 4 ? std::atoi(argv[4]) : 2;
  const int steps = argc > 5 ? std::atoi(argv[5]) : 8;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 2;
  at::set_num_threads(threads);

  torch::manual_seed(1);
  zt::GPT model(zt::gpt_preset(preset));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.0));
  zt::ByteTokenizer tokenizer;
  auto data = zt::TokenDataset::from_text(zt::embedded_corpus(), tokenizer);
  zt::DistributedSampler sampler(data, seq, batch, 1, 0, 1);

  using clock = std::chrono::steady_clock;
  clock::time_point start;
  double last_loss = 0;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) start = clock::now();
    auto b = sampler.batch(step, 0);
    optimizer.zero_grad();
    auto loss = model->loss(b.inputs, b.targets);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    last_loss = loss.item<double>();
  }
  const double seconds = std::chrono::duration<double>(clock::now() - start).count();
  fmt::print("{{\"program\": \"plain_libtorch_loop\", \"preset\": \"{}\", \"threads\": {}, \"steps\": {}, "
             "\"seconds_per_step\": {:.4f}, \"tokens_per_second\": {:.1f}, \"final_loss\": {:.4f}}}\n",
             preset, threads, steps, seconds / steps, double(batch * seq * steps) / seconds, last_loss);
}
