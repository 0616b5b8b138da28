// on_every_rank (checkpoint/checkpoint.h): a rank-wide agreement on whether a piece of work
// succeeded everywhere, which the checkpoint's save and load steps and the engine's pre-flight
// checks run after each step.
#include <ATen/ATen.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {

CheckpointGroup::CheckpointGroup(Communicator& comm) : data_(&comm) {}
CheckpointGroup::CheckpointGroup(Communicator& data, Communicator& tensor) : data_(&data), tensor_(&tensor) {}
int CheckpointGroup::tensor_rank() const { return tensor_ ? tensor_->rank() : 0; }
int CheckpointGroup::tensor_size() const { return tensor_ ? tensor_->world_size() : 1; }
int CheckpointGroup::rank() const { return data_->rank() * tensor_size() + tensor_rank(); }
int CheckpointGroup::world_size() const { return data_->world_size() * tensor_size(); }

void CheckpointGroup::all_reduce(at::Tensor& tensor, ReduceOp op, const std::string& what) {
  data_->all_reduce(tensor, op, what).wait();
  if (tensor_) tensor_->all_reduce(tensor, op, what).wait();
}

// Every tensor group broadcasts from the source's tensor rank (the source's own group holds the
// value then), and every data-parallel group from the source's data rank.
void CheckpointGroup::broadcast(at::Tensor& tensor, int source, const std::string& what) {
  if (tensor_) tensor_->broadcast(tensor, source % tensor_size(), what).wait();
  data_->broadcast(tensor, source / tensor_size(), what).wait();
}

// Runs `work` on this rank; every rank learns whether all succeeded, and all throw if one failed
// (so that no rank waits in a later collective for one that gave up). The failing rank's message
// and error type reach every rank, so that the one rank that prints (rank 0) names the file.
void on_every_rank(CheckpointGroup comm, const std::string& what, const std::function<void()>& work) {
  std::exception_ptr error;
  try {
    work();
  } catch (...) {
    error = std::current_exception();
  }
  at::Tensor failed = at::full({1}, error ? double(comm.rank() + 1) : 0.0, at::kDouble);
  comm.all_reduce(failed, ReduceOp::Max, "checkpoint." + what);
  const int source = int(failed.item<double>()) - 1;
  if (source < 0) return;
  // The message of the (highest-numbered) failing rank, and whether it was bad input.
  std::string message;
  int kind = 0;  // 0 Error, 1 DataError, 2 ConfigError
  if (comm.rank() == source) {
    try {
      std::rethrow_exception(error);
    } catch (const ConfigError& e) {
      message = e.what(), kind = 2;
    } catch (const DataError& e) {
      message = e.what(), kind = 1;
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    if (message.empty()) message = "unknown error";
  }
  at::Tensor header = at::tensor({int64_t(message.size()), int64_t(kind)}, at::kLong);
  comm.broadcast(header, source, "checkpoint." + what + ".error");
  at::Tensor text = at::zeros({header[0].item<int64_t>()}, at::kByte);
  if (comm.rank() == source) std::memcpy(text.data_ptr(), message.data(), message.size());
  comm.broadcast(text, source, "checkpoint." + what + ".error");
  if (error) std::rethrow_exception(error);
  message.assign(reinterpret_cast<const char*>(text.data_ptr()), size_t(text.numel()));
  message += " (on rank " + std::to_string(source) + ")";
  if (header[1].item<int64_t>() == 2) throw ConfigError(message);
  if (header[1].item<int64_t>() == 1) throw DataError(message);
  throw Error(message);
}

}  // namespace zt
