// Fault injection for communication: a Communicator that forwards to another one, except that
// it fails or delays the collective with a given sequence number. For tests of what the layers
// above do when a collective fails or is late (the engine, the trainer), on real ranks. Internal;
// not installed.
//
// Contract
// - Sequence numbers are the inner communicator's: a fault "at k" applies to the collective the
//   inner communicator would number k (inner->next_sequence() == k when it is issued), whatever
//   its kind, barrier included.
// - Fail: the collective throws zt::CommError when issued, naming this rank, the world size, the
//   kind, label and sequence, and that the failure was injected. Nothing reaches the inner
//   communicator. From then on the wrapper is unusable, as comm.h promises for a real failure:
//   every later collective throws zt::CommError at once, quoting the first error. (Inject the
//   same fault on every rank, or the peers wait for the collective until their timeout.)
// - Delay: the wrapper sleeps for `delay` before issuing the collective; the result is that of
//   the inner communicator. The peers wait for this rank meanwhile, as for a slow rank.
// - Threads: as Communicator (one issuing thread); issued() may be called from that thread.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zerotrain/comm/comm.h"

namespace zt {

struct CommFault {
  enum class Action { Fail, Delay };
  std::uint64_t sequence = 0;
  Action action = Action::Fail;
  std::chrono::milliseconds delay{0};  // for Delay
};

class FaultInjectingCommunicator final : public Communicator {
 public:
  // Throws zt::ConfigError for a null `inner`, a negative delay or two faults at one sequence.
  FaultInjectingCommunicator(std::shared_ptr<Communicator> inner, std::vector<CommFault> faults);

  struct Issued {
    std::uint64_t sequence;
    std::string kind;
    std::string label;
  };
  // Every collective issued through this wrapper (also the failed one), in order.
  const std::vector<Issued>& issued() const { return issued_; }

  int rank() const override;
  int world_size() const override;
  std::uint64_t next_sequence() const override;
  CollectiveHandle all_reduce(at::Tensor flat, ReduceOp op, std::string_view label) override;
  CollectiveHandle reduce_scatter(at::Tensor input, at::Tensor output, ReduceOp op, std::string_view label,
                                  InputUse input_use = InputUse::Preserve) override;
  CollectiveHandle all_gather(at::Tensor input, at::Tensor output, std::string_view label) override;
  CollectiveHandle broadcast(at::Tensor tensor, int root, std::string_view label) override;
  void barrier(std::string_view label) override;
  // The inner communicator's; a group split from it carries no faults.
  NodePlacement placement() const override;
  std::shared_ptr<Communicator> split(int color, std::string_view name) override;
  // The inner communicator's.
  std::shared_ptr<CommsLogger> comms_logger() const override;
  void set_comms_logger(std::shared_ptr<CommsLogger> logger) override;

 private:
  // Applies the fault (if any) for the collective about to be issued; throws on Fail.
  void before(const char* kind, std::string_view label);

  std::shared_ptr<Communicator> inner_;
  std::vector<CommFault> faults_;
  std::vector<Issued> issued_;
  std::string failure_;
};

}  // namespace zt
