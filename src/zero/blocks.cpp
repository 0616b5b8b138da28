#include "zerotrain/blocks.h"

#include <torch/nn/module.h>

#include <mutex>
#include <vector>

#include "zerotrain/error.h"

namespace zt {
namespace {

std::mutex registry_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> marked;  // expired entries are pruned on use
BlockRunner* active_runner = nullptr;

}  // namespace

void mark_block(const std::shared_ptr<torch::nn::Module>& module) {
  if (!module) throw ConfigError("mark_block: expected a module, found a null pointer");
  std::lock_guard lock(registry_mutex);
  std::erase_if(marked, [](const auto& weak) { return weak.expired(); });
  for (const auto& weak : marked)
    if (weak.lock() == module) return;
  marked.push_back(module);
}

bool is_marked_block(const torch::nn::Module& module) {
  std::lock_guard lock(registry_mutex);
  for (const auto& weak : marked)
    if (auto m = weak.lock(); m.get() == &module) return true;
  return false;
}

at::Tensor run_block(torch::nn::Module& module, const at::Tensor& x, const BlockFunction& fn) {
  BlockRunner* runner = active_runner;
  if (runner != nullptr)
    if (int block = runner->block_of(module); block >= 0) return runner->run(block, x, fn);
  return fn(x);
}

void install_block_runner(BlockRunner* runner) {
  std::lock_guard lock(registry_mutex);
  if (runner != nullptr && active_runner != nullptr && active_runner != runner)
    throw Error("stage 3: another engine with sharded parameters is alive in this process; one at a time is supported");
  active_runner = runner;
}

}  // namespace zt
