// Uses the installed headers and library: parses a configuration, builds the engine on a tiny
// model in one process and takes one step.
#include <torch/torch.h>

#include <cstdio>

#include "zerotrain/comm/comm.h"
#include "zerotrain/config/config.h"
#include "zerotrain/zero/engine.h"
#include "zerotrain/version.h"

int main() {
  auto config = zt::parse_config(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})", {}, 1);
  zt::RendezvousInfo single;
  single.master_port = 0;
  auto comm = zt::make_communicator(single, zt::CommOptions{});
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 1);
  zt::Engine engine(model, config, comm);
  auto before = model->weight.clone();
  engine.backward(model->forward(torch::ones({2, 4})).sum());
  auto result = engine.step();
  const bool changed = !torch::equal(before, model->weight);
  std::printf("zerotrain %s consumer: stepped=%d changed=%d\n", zt::version(), result.stepped, changed);
  return result.stepped && changed ? 0 : 1;
}
