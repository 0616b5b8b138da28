// Collectives through a shared-memory segment for ranks on one machine (docs/comm.md "Shared
// memory"): CPU tensors are copied through small per-rank slots that every rank maps, instead of
// through Gloo's loopback sockets. Internal to the communicator.
//
// Contract
// - connect() is a collective of the group over its store: every rank calls it at the same point.
//   It returns a transport on every rank or on none (null: some rank could not map the segment,
//   e.g. the ranks are on different machines), so the ranks always agree on the path.
// - Collectives run on one worker thread per transport, in the order they were issued; every rank
//   must issue the same collectives in the same order (as with Gloo). The issuing methods are
//   driven by one thread at a time; the returned Work may be waited from any thread.
// - The caller's tensors (CPU, contiguous) must stay untouched until the Work has completed.
// - Failures: a peer that does not arrive within the timeout, or whose process has exited, fails
//   the collective (Work::wait throws, naming the peer); every later collective then fails at once.
//   Nothing waits forever: each wait is bounded by the timeout and ends when the transport is
//   destroyed.
// - The segment's name is removed as soon as every rank has mapped it: nothing is left in
//   /dev/shm whatever ends the job.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "zerotrain/comm/comm.h"

namespace zt {

class SharedMemoryTransport {
 public:
  // Bytes per rank and per buffer that one round of a collective moves (two buffers per rank).
  static constexpr int64_t kSlotBytes = int64_t(1) << 20;

  // `who` names this rank in messages ("rank 1/2").
  static std::unique_ptr<SharedMemoryTransport> connect(c10d::Store& store, int rank, int world,
                                                         std::chrono::milliseconds timeout, std::string who);
  ~SharedMemoryTransport();
  SharedMemoryTransport(const SharedMemoryTransport&) = delete;
  SharedMemoryTransport& operator=(const SharedMemoryTransport&) = delete;

  // The operations of comm.h's Communicator, with the same shapes. Reductions of every floating
  // dtype (bf16/fp16 accumulate in fp32 when more than two ranks add up) and of integers (Sum and
  // Max); they sum in rank order, so every rank gets the same bits.
  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor flat, ReduceOp op);
  // Whether all_reduce / reduce_scatter take this dtype and operation (else the caller uses Gloo).
  static bool reduces(at::ScalarType dtype, ReduceOp op);
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor input, at::Tensor output, ReduceOp op);
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor input, at::Tensor output);
  c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor tensor, int root);

  struct Segment;  // the mapping and its layout (shared_memory.cpp)
  struct Worker;

 private:
  SharedMemoryTransport(std::unique_ptr<Segment> segment, int rank, int world, std::chrono::milliseconds timeout,
                        std::string who);
  std::unique_ptr<Segment> segment_;
  std::unique_ptr<Worker> worker_;
};

}  // namespace zt
