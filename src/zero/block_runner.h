// The engine's side of run_block (zerotrain/zero/blocks.h): the runner a stage-3 engine installs for
// the blocks it owns, which run_block then calls. Internal; not installed.
#pragma once
#include <memory>
#include <vector>

#include "zerotrain/zero/blocks.h"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}

namespace zt {

// What run_block calls when a stage-3 engine owns a module; implemented by the engine. Several
// engines may be alive in one process, each owning the blocks of its own model.
class BlockRunner {
 public:
  virtual ~BlockRunner() = default;
  virtual at::Tensor run(int block, const at::Tensor& x, const BlockFunction& fn) = 0;
  virtual std::vector<at::Tensor> run_outputs(int block, const BlockOutputsFunction& fn) = 0;
};
// Makes `runner` run `modules` (modules[i] is its block i); throws zt::Error when one of them
// belongs to another installed runner.
void install_block_runner(BlockRunner* runner, const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
// Forgets `runner`. Its modules keep no parameter data (the engine held it): run_block on one of
// them throws zt::Error from then on instead of reading freed memory.
void remove_block_runner(BlockRunner* runner);
// True when an installed runner owns `module`.
bool has_block_runner(const torch::nn::Module& module);

}  // namespace zt
