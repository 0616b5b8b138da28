// Fault injection (comm/faults.h): fails or delays one collective of a real
// communicator, so that tests reach the error paths of the layers above with real ranks.
#include <fmt/format.h>

#include <ATen/core/Tensor.h>
#include <algorithm>
#include <thread>

#include "comm/faults.h"
#include "zerotrain/error.h"

namespace zt {

FaultInjectingCommunicator::FaultInjectingCommunicator(std::shared_ptr<Communicator> inner,
                                                       std::vector<CommFault> faults)
    : inner_(std::move(inner)), faults_(std::move(faults)) {
  if (!inner_) throw ConfigError("comm faults: expected a communicator to wrap, found none");
  for (size_t i = 0; i < faults_.size(); ++i) {
    if (faults_[i].delay.count() < 0)
      throw ConfigError(fmt::format("comm faults: expected a delay >= 0 ms at seq {}, found {} ms",
                                    faults_[i].sequence, faults_[i].delay.count()));
    for (size_t j = 0; j < i; ++j)
      if (faults_[j].sequence == faults_[i].sequence)
        throw ConfigError(fmt::format("comm faults: expected one fault per sequence, found two at seq {}",
                                      faults_[i].sequence));
  }
}

int FaultInjectingCommunicator::rank() const { return inner_->rank(); }
int FaultInjectingCommunicator::world_size() const { return inner_->world_size(); }
std::uint64_t FaultInjectingCommunicator::next_sequence() const { return inner_->next_sequence(); }

void FaultInjectingCommunicator::before(const char* kind, std::string_view label) {
  const std::uint64_t seq = inner_->next_sequence();
  if (!failure_.empty())
    throw CommError(fmt::format("rank {}/{} cannot start {} '{}' (seq {}): the communicator failed earlier: {}",
                                rank(), world_size(), kind, label, seq, failure_));
  issued_.push_back({seq, kind, std::string(label)});
  auto fault = std::find_if(faults_.begin(), faults_.end(), [&](const CommFault& f) { return f.sequence == seq; });
  if (fault == faults_.end()) return;
  if (fault->action == CommFault::Action::Delay) {
    std::this_thread::sleep_for(fault->delay);
    return;
  }
  failure_ = fmt::format("rank {}/{} failed in {} '{}' (seq {}): injected fault", rank(), world_size(), kind, label,
                         seq);
  throw CommError(failure_);
}

CollectiveHandle FaultInjectingCommunicator::all_reduce(at::Tensor flat, ReduceOp op, std::string_view label) {
  before("all_reduce", label);
  return inner_->all_reduce(std::move(flat), op, label);
}

CollectiveHandle FaultInjectingCommunicator::reduce_scatter(at::Tensor input, at::Tensor output, ReduceOp op,
                                                            std::string_view label, InputUse input_use) {
  before("reduce_scatter", label);
  return inner_->reduce_scatter(std::move(input), std::move(output), op, label, input_use);
}

CollectiveHandle FaultInjectingCommunicator::all_gather(at::Tensor input, at::Tensor output, std::string_view label) {
  before("all_gather", label);
  return inner_->all_gather(std::move(input), std::move(output), label);
}

CollectiveHandle FaultInjectingCommunicator::broadcast(at::Tensor tensor, int root, std::string_view label) {
  before("broadcast", label);
  return inner_->broadcast(std::move(tensor), root, label);
}

void FaultInjectingCommunicator::barrier(std::string_view label) {
  before("barrier", label);
  inner_->barrier(label);
}

NodePlacement FaultInjectingCommunicator::placement() const { return inner_->placement(); }

std::shared_ptr<Communicator> FaultInjectingCommunicator::split(int color, std::string_view name) {
  return inner_->split(color, name);
}

std::shared_ptr<CommsLogger> FaultInjectingCommunicator::comms_logger() const { return inner_->comms_logger(); }
void FaultInjectingCommunicator::set_comms_logger(std::shared_ptr<CommsLogger> logger) {
  inner_->set_comms_logger(std::move(logger));
}

}  // namespace zt
