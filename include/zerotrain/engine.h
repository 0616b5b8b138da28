// The training engine: what a user adds to an existing LibTorch loop.
//
//   auto comm   = zt::make_communicator(zt::rendezvous_from_environment(), {});
//   auto config = zt::load_config("config.json", {}, comm->world_size());
//   zt::Engine engine(model.ptr(), config, comm);          // replaces the torch::optim optimizer
//   for (...) {
//     auto loss = model->forward(...);
//     engine.backward(loss);                               // replaces loss.backward()
//     engine.step();                                       // replaces optimizer.step()/zero_grad()
//   }
//
// Contract
// - The engine owns the trainable parameters' storage from construction on: every trainable
//   parameter's data and gradient become views into flat arenas (one allocation per role,
//   docs/architecture.md "memory"); the user keeps using the model as before. Frozen
//   parameters (requires_grad false) get neither gradient nor optimizer memory.
// - At construction rank 0's parameter values are broadcast so every rank starts equal.
// - backward(loss) divides the loss by gradient_accumulation_steps before differentiating, so
//   the gradient of an optimizer step is the mean over all micro-batches of all ranks; this is
//   the engine's one scaling of the loss and it is stated here so it is never a surprise.
// - step() is a no-op (returns stepped=false) except on the last micro-step of an accumulation
//   window, where it completes the gradient reduction, clips by the global norm, applies the
//   optimizer with the learning rate of the schedule, and zeroes the gradients.
// - Not thread-safe: drive one engine from one thread. Every rank must call backward()/step()
//   the same number of times in the same order (they run collectives).
#pragma once
#include <cstdint>
#include <memory>

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}

namespace zt {

class Communicator;
struct TrainConfig;

// Bytes of long-lived model state held by this rank, by role (design §2 vocabulary).
struct ModelStateBytes {
  int64_t parameters = 0;        // working parameters (all trainable ones, this rank's copy)
  int64_t gradients = 0;         // gradient arena
  int64_t optimizer_states = 0;  // master weights (when separate) and optimizer moments
  int64_t total() const { return parameters + gradients + optimizer_states; }
};

struct StepResult {
  bool boundary = false;     // this call ended an accumulation window
  bool stepped = false;      // the optimizer was applied
  bool skipped = false;      // a non-finite gradient made every rank skip this step
  double grad_norm = 0.0;    // global gradient norm before clipping (boundary only)
  double lr = 0.0;           // learning rate used (boundary only)
};

class Engine {
 public:
  Engine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
         std::shared_ptr<Communicator> comm);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void backward(const at::Tensor& loss);
  StepResult step();

  // True when the next backward() is the last micro-step of its accumulation window.
  bool next_backward_is_boundary() const;
  int64_t global_step() const;     // optimizer steps taken (skipped ones included)
  int64_t skipped_steps() const;
  double learning_rate() const;    // for the next optimizer step
  ModelStateBytes model_state_bytes() const;
  Communicator& communicator() const;
  const TrainConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zt
