#include "zerotrain/models/tensor_parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "zerotrain/zero/blocks.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

// The layers of zerotrain/models/tensor_parallel.h (docs/tensor_parallel.md).

namespace zt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Communicator& group_of(const std::shared_ptr<Communicator>& group, const char* who) {
  if (!group) throw ConfigError(std::string(who) + ": expected a tensor group's communicator, found a null pointer");
  return *group;
}

// The engine counts a split parameter's slices once each over the group (zerotrain/zero/blocks.h); a
// group of one splits nothing.
void mark_split(const at::Tensor& parameter, const std::shared_ptr<Communicator>& group, int dim) {
  if (group->world_size() > 1) mark_tensor_split(parameter, {group, dim, 1});
}

// An all-reduce of a copy (the collectives take contiguous buffers of their own).
at::Tensor summed(const at::Tensor& x, Communicator& group, ReduceOp op, const char* label) {
  at::Tensor flat = x.contiguous().clone();
  if (group.world_size() > 1) group.all_reduce(flat.view({-1}), op, label).wait();
  return flat;
}

at::Tensor gathered_last_dim(const at::Tensor& x, Communicator& group) {
  const int64_t T = group.world_size();
  if (T == 1) return x;
  // Gathered rank after rank as [T, ...x], then each rank's piece moved to its place in the last dim.
  at::Tensor mine = x.contiguous();
  at::Tensor all = torch::empty({T * mine.numel()}, mine.options());
  group.all_gather(mine.view({-1}), all, "tensor_parallel.gather").wait();
  std::vector<int64_t> shape = {T};
  for (int64_t d : mine.sizes()) shape.push_back(d);
  return torch::cat(all.view(shape).unbind(0), -1);
}

at::Tensor my_slice_last_dim(const at::Tensor& x, Communicator& group) {
  const int64_t T = group.world_size();
  const int64_t n = x.size(-1) / T;
  return x.narrow(-1, n * group.rank(), n).contiguous();
}

// Keeps the group alive in an autograd node until its backward ran.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(std::shared_ptr<Communicator> g) : group(std::move(g)) {}
  std::shared_ptr<Communicator> group;
};

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::shared_ptr<Communicator> group) {
    ctx->saved_data["keep"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(std::move(group)));
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["keep"].toCapsule());
    return {summed(grads[0], *holder->group, ReduceOp::Sum, "tensor_parallel.copy.backward"), at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const std::shared_ptr<Communicator>& group) {
    return summed(x, *group, ReduceOp::Sum, "tensor_parallel.reduce");
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherFromGroup : torch::autograd::Function<GatherFromGroup> {
  using Holder = GroupHolder;
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::shared_ptr<Communicator> group) {
    at::Tensor whole = gathered_last_dim(x, *group);
    ctx->saved_data["keep"] = c10::IValue::make_capsule(c10::make_intrusive<Holder>(std::move(group)));
    return whole;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<Holder>(ctx->saved_data["keep"].toCapsule());
    return {my_slice_last_dim(grads[0], *holder->group), at::Tensor()};
  }
};

// The size of this rank's slice of a dimension of `whole` elements.
int64_t split_size(int64_t whole, Communicator& group, const std::string& what) {
  const int64_t T = group.world_size();
  if (whole % T != 0)
    throw ConfigError(what + ": expected a size divisible by the tensor group's " + std::to_string(T) +
                      " ranks, found " + std::to_string(whole));
  return whole / T;
}

// torch::nn::Linear's initialisation of a whole [out, in] weight and [out] bias.
std::pair<at::Tensor, at::Tensor> linear_init(int64_t in, int64_t out, bool bias) {
  at::NoGradGuard no_grad;
  at::Tensor w = torch::empty({out, in});
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  at::Tensor b;
  if (bias) {
    const double bound = in > 0 ? 1.0 / std::sqrt(double(in)) : 0.0;
    b = torch::empty({out});
    torch::nn::init::uniform_(b, -bound, bound);
  }
  return {w, b};
}

void check_whole(const at::Tensor& t, std::vector<int64_t> expected, const std::string& what) {
  if (!t.defined() || t.sizes().vec() != expected)
    throw ConfigError(what + ": expected shape " + c10::str(c10::IntArrayRef(expected)) + ", found " +
                      (t.defined() ? c10::str(t.sizes()) : std::string("none")));
}

}  // namespace

at::Tensor copy_to_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group) {
  group_of(group, "copy_to_tensor_group");
  return CopyToGroup::apply(x, group);
}

int64_t tensor_group_size(const std::shared_ptr<Communicator>& group) { return group ? group->world_size() : 1; }

at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const std::shared_ptr<Communicator>& group) {
  if (!group) return torch::nn::functional::linear(x, weight, bias);
  at::Tensor y = reduce_from_tensor_group(torch::nn::functional::linear(x, weight), group);
  return bias.defined() ? y + bias : y;
}

void keep_tensor_slice(at::Tensor& parameter, const std::shared_ptr<Communicator>& group, int dim, int parts) {
  at::NoGradGuard no_grad;
  const int64_t T = group->world_size(), r = group->rank();
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& part : parameter.chunk(parts, dim)) {
    const int64_t n = part.size(dim) / T;
    pieces.push_back(part.narrow(dim, n * r, n));
  }
  parameter.set_data(torch::cat(pieces, dim).contiguous().clone());
  mark_tensor_split(parameter, TensorSplit{group, dim, parts});
}

at::Tensor reduce_from_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group) {
  group_of(group, "reduce_from_tensor_group");
  return ReduceFromGroup::apply(x, group);
}

at::Tensor gather_from_tensor_group(const at::Tensor& x, const std::shared_ptr<Communicator>& group) {
  group_of(group, "gather_from_tensor_group");
  return GatherFromGroup::apply(x, group);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, bool with_bias,
                                                   std::shared_ptr<Communicator> group, bool gather_output)
    : in_features(in), out_features(out), group_(std::move(group)), gather_output_(gather_output) {
  Communicator& g = group_of(group_, "ColumnParallelLinear");
  const int64_t rows = split_size(out, g, "ColumnParallelLinear out_features");
  auto [w, b] = linear_init(in, out, with_bias);
  weight = register_parameter("weight", w.narrow(0, rows * g.rank(), rows).clone());
  mark_split(weight, group_, 0);
  if (with_bias) {
    bias = register_parameter("bias", b.narrow(0, rows * g.rank(), rows).clone());
    mark_split(bias, group_, 0);
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = torch::nn::functional::linear(copy_to_tensor_group(x, group_), weight, bias);
  return gather_output_ ? gather_from_tensor_group(y, group_) : y;
}

void ColumnParallelLinearImpl::load_whole(const at::Tensor& w, const at::Tensor& b) {
  at::NoGradGuard no_grad;
  check_whole(w, {out_features, in_features}, "ColumnParallelLinear weight");
  const int64_t rows = weight.size(0);
  weight.copy_(w.narrow(0, rows * group_->rank(), rows));
  if (bias.defined()) {
    check_whole(b, {out_features}, "ColumnParallelLinear bias");
    bias.copy_(b.narrow(0, rows * group_->rank(), rows));
  }
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, bool with_bias, std::shared_ptr<Communicator> group)
    : in_features(in), out_features(out), group_(std::move(group)) {
  Communicator& g = group_of(group_, "RowParallelLinear");
  const int64_t columns = split_size(in, g, "RowParallelLinear in_features");
  auto [w, b] = linear_init(in, out, with_bias);
  weight = register_parameter("weight", w.narrow(1, columns * g.rank(), columns).contiguous());
  mark_split(weight, group_, 1);
  if (with_bias) bias = register_parameter("bias", b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) { return row_parallel_linear(x, weight, bias, group_); }

void RowParallelLinearImpl::load_whole(const at::Tensor& w, const at::Tensor& b) {
  at::NoGradGuard no_grad;
  check_whole(w, {out_features, in_features}, "RowParallelLinear weight");
  const int64_t columns = weight.size(1);
  weight.copy_(w.narrow(1, columns * group_->rank(), columns));
  if (bias.defined()) {
    check_whole(b, {out_features}, "RowParallelLinear bias");
    bias.copy_(b);
  }
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, std::shared_ptr<Communicator> group)
    : num_embeddings(vocab), embedding_dim(dim), group_(std::move(group)) {
  Communicator& g = group_of(group_, "VocabParallelEmbedding");
  const int64_t rows = split_size(vocab, g, "VocabParallelEmbedding num_embeddings");
  begin_ = rows * g.rank();
  end_ = begin_ + rows;
  at::Tensor whole;
  {
    at::NoGradGuard no_grad;
    whole = torch::empty({vocab, dim});
    torch::nn::init::normal_(whole);  // torch::nn::Embedding's initialisation
  }
  weight = register_parameter("weight", whole.narrow(0, begin_, rows).clone());
  mark_split(weight, group_, 0);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return vocab_parallel_lookup(ids, weight, begin_, group_);
}

at::Tensor vocab_parallel_lookup(const at::Tensor& ids, const at::Tensor& local_weight, int64_t begin,
                                 const std::shared_ptr<Communicator>& group) {
  group_of(group, "vocab_parallel_lookup");
  // Ids outside this rank's rows look up row 0 and are zeroed: the sum over the group has every
  // id's row exactly once.
  const int64_t end = begin + local_weight.size(0);
  const at::Tensor outside = (ids < begin).logical_or(ids >= end);
  const at::Tensor local = (ids - begin).masked_fill(outside, 0);
  at::Tensor rows = torch::nn::functional::embedding(local, local_weight);
  rows = rows.masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_tensor_group(rows, group);
}

void VocabParallelEmbeddingImpl::load_whole(const at::Tensor& w) {
  at::NoGradGuard no_grad;
  check_whole(w, {num_embeddings, embedding_dim}, "VocabParallelEmbedding weight");
  weight.copy_(w.narrow(0, begin_, end_ - begin_));
}

namespace {

// loss_i = log sum_j exp(z_ij) - z_i,t(i), with the max, the sum and the target's logit each
// all-reduced over the group; backward: softmax - one-hot, on this rank's slice only.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  using Holder = GroupHolder;
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            std::shared_ptr<Communicator> group, int64_t ignore_index) {
    Communicator& g = *group;
    const int64_t local_vocab = logits.size(1);
    const int64_t begin = local_vocab * g.rank();
    at::Tensor z = logits.to(torch::kFloat32);
    const at::Tensor max = summed(std::get<0>(z.max(1)), g, ReduceOp::Max, "tensor_parallel.ce.max");
    at::Tensor e = (z - max.unsqueeze(1)).exp();
    const at::Tensor sum = summed(e.sum(1), g, ReduceOp::Sum, "tensor_parallel.ce.sum");
    const at::Tensor valid = targets.ne(ignore_index);
    const at::Tensor mine = (targets >= begin).logical_and(targets < begin + local_vocab).logical_and(valid);
    const at::Tensor local_target = (targets - begin).masked_fill(mine.logical_not(), 0);
    at::Tensor target_logit = z.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0.0);
    target_logit = summed(target_logit, g, ReduceOp::Sum, "tensor_parallel.ce.target");
    const at::Tensor per_row = (sum.log() + max - target_logit).masked_fill(valid.logical_not(), 0.0);
    const at::Tensor count = valid.sum().to(torch::kFloat32);
    e.div_(sum.unsqueeze(1));  // the softmax of this rank's slice
    ctx->save_for_backward({e, local_target, mine, valid, count});
    ctx->saved_data["dtype"] = c10::IValue(static_cast<int64_t>(logits.scalar_type()));
    ctx->saved_data["keep"] = c10::IValue::make_capsule(c10::make_intrusive<Holder>(std::move(group)));
    return per_row.sum() / count;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    const at::Tensor& local_target = saved[1];
    const at::Tensor& mine = saved[2];
    const at::Tensor& valid = saved[3];
    grad.scatter_add_(1, local_target.unsqueeze(1), -mine.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(valid.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grads[0] / saved[4]);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const std::shared_ptr<Communicator>& group, int64_t ignore_index) {
  group_of(group, "vocab_parallel_cross_entropy");
  if (local_logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != local_logits.size(0))
    throw ConfigError("vocab_parallel_cross_entropy: expected logits [N, V / T] and targets [N], found " +
                      c10::str(local_logits.sizes()) + " and " + c10::str(targets.sizes()));
  return VocabParallelCrossEntropy::apply(local_logits, targets, group, ignore_index);
}

namespace {

struct TrackedRng {
  uint64_t seed = 2718;
  std::vector<std::pair<c10::Device, at::Tensor>> states;
};
TrackedRng& tracked_rng() {
  static TrackedRng rng;
  return rng;
}

}  // namespace

void seed_tensor_parallel_rng(uint64_t seed) {
  tracked_rng().seed = seed;
  tracked_rng().states.clear();
}

at::Tensor with_tensor_parallel_rng(c10::Device device, const std::function<at::Tensor()>& fn) {
  TrackedRng& rng = tracked_rng();
  at::Generator generator = at::globalContext().defaultGenerator(device);
  at::Tensor own;
  // An index, not an iterator: what fn runs may track another device's state meanwhile.
  size_t slot = size_t(std::find_if(rng.states.begin(), rng.states.end(),
                                    [&](const auto& s) { return s.first == device; }) -
                       rng.states.begin());
  {
    // Not held while fn runs: its kernels lock the generator themselves.
    std::lock_guard lock(generator.mutex());
    own = generator.get_state();
    if (slot == rng.states.size()) {
      generator.set_current_seed(rng.seed);
      rng.states.emplace_back(device, generator.get_state());
    }
    generator.set_state(rng.states[slot].second);
  }
  auto put_back = [&](bool keep) {
    std::lock_guard lock(generator.mutex());
    if (keep && slot < rng.states.size() && rng.states[slot].first == device)
      rng.states[slot].second = generator.get_state();
    generator.set_state(own);
  };
  at::Tensor out;
  try {
    out = fn();
  } catch (...) {
    put_back(false);
    throw;
  }
  put_back(true);
  return out;
}

TensorParallelRngStates tensor_parallel_rng_states() {
  TensorParallelRngStates s;
  s.seed = tracked_rng().seed;
  for (const auto& [device, state] : tracked_rng().states) s.states.emplace_back(device, state.clone());
  return s;
}

void set_tensor_parallel_rng_states(const TensorParallelRngStates& states) {
  tracked_rng().seed = states.seed;
  tracked_rng().states.clear();
  for (const auto& [device, state] : states.states) tracked_rng().states.emplace_back(device, state.clone());
}

}  // namespace zt
