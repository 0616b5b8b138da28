// What the communicator's files share: the state of an issued collective behind a
// CollectiveHandle, the failure that makes a communicator unusable, and the rendezvous at rank 0's
// store. Internal to the communicator (communicator.cpp, collective_handle.cpp,
// store_rendezvous.cpp).
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/Tensor.h>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/flight_recorder.h"
#include "zerotrain/comm/comm.h"

namespace zt {

class CommsLogger;  // zerotrain/comm/comms_logger.h

namespace comm_detail {

using Clock = std::chrono::steady_clock;

inline double seconds(std::chrono::milliseconds ms) { return double(ms.count()) / 1000.0; }

// c10 errors carry a C++ backtrace and Gloo prefixes a source location; keep the sentence.
std::string first_line(const char* what);

// The first failure makes the communicator unusable: a timed-out Gloo context may still have
// operations in flight, and later collectives would pair with the wrong peers' messages.
struct FailureState {
  std::mutex mutex;
  std::string first_error;
  // True for the first failure only (the one that dumps the flight recorder).
  bool record(const std::string& error) {
    std::lock_guard lock(mutex);
    if (!first_error.empty()) return false;
    first_error = error;
    return true;
  }
  std::string get() {
    std::lock_guard lock(mutex);
    return first_error;
  }
};

// The failure that made the communicator unusable, followed by what led to it, in the rank's log.
void dump_flight_recorder(const FlightRecorder& recorder, const std::string& error);

inline bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// Meets the other ranks of `info` at rank 0's TCP store (docs/comm.md "Rendezvous"); throws
// zt::CommError, with how many ranks arrived, when they do not all arrive within `timeout`.
c10::intrusive_ptr<c10d::Store> rendezvous(const RendezvousInfo& info, std::chrono::milliseconds timeout);

}  // namespace comm_detail

struct CollectiveHandle::State {
  std::string kind;
  std::string label;
  std::uint64_t sequence = 0;
  std::string size_text;  // "1000 float elements", "from rank 0", ...
  std::string who;  // "rank 1/2", or "rank 1/2 of group 'node' (rank 3 of the job)"
  std::chrono::milliseconds timeout{0};
  std::vector<c10::intrusive_ptr<c10d::Work>> works;  // empty when nothing was sent (world of one)
  // NCCL (device tensors): wait() orders the caller's current stream after the collective instead
  // of blocking the host; NCCL's watchdog enforces the timeout (docs/comm.md "CUDA").
  bool stream_ordered = false;
  std::vector<at::Tensor> keep_alive;   // the caller's tensors and our temporaries
  std::function<void()> finalize;       // emulation steps after the transfer
  std::shared_ptr<comm_detail::FailureState> failure;
  std::shared_ptr<FlightRecorder> recorder;
  // Set only for collectives the comms logger records; then issued_at is the issue time.
  std::shared_ptr<CommsLogger> logger;
  comm_detail::Clock::time_point issued_at;
  std::uint64_t message_bytes = 0;  // as the comms logger counts them

  std::mutex mutex;
  bool done = false;
  std::string error;

  std::string describe() const;
  void wait();
  void log_completion();
  bool is_completed();
};

}  // namespace zt
