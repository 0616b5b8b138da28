// The state of an issued collective (comm/process_group.h) and the handle over it: the bounded
// wait, the message that says who waited for what, and the flight recorder's record of the end.
#include <fmt/format.h>

#include <ATen/ATen.h>
#include <algorithm>
#include <cstdio>
#include <string>

#include "comm/process_group.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/error.h"

namespace zt {
namespace comm_detail {

// c10 errors carry a C++ backtrace and Gloo prefixes a source location; keep the sentence.
std::string first_line(const char* what) {
  std::string s = what;
  s = s.substr(0, s.find('\n'));
  if (!s.empty() && s.front() == '[') {
    size_t close = s.find("] ");
    if (close != std::string::npos) s = s.substr(close + 2);
  }
  return s;
}

// The failure that made the communicator unusable, followed by what led to it, in the rank's log.
void dump_flight_recorder(const FlightRecorder& recorder, const std::string& error) {
  std::string text = "zerotrain comm: " + error + "\n" + recorder.dump();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

}  // namespace comm_detail

using comm_detail::Clock;
using comm_detail::dump_flight_recorder;
using comm_detail::first_line;
using comm_detail::seconds;

std::string CollectiveHandle::State::describe() const {
  return fmt::format("{} '{}' (seq {}{}{})", kind, label, sequence, size_text.empty() ? "" : ", ", size_text);
}

void CollectiveHandle::State::wait() {
  std::lock_guard lock(mutex);
  if (done) {
    if (!error.empty()) throw CommError(error);
    return;
  }
  if (!works.empty()) {
    auto start = Clock::now();
    try {
      // One deadline for the whole collective, however many backend operations it took.
      for (auto& work : works) {
        if (stream_ordered) {
          work->wait();
          continue;
        }
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(start + timeout - Clock::now());
        work->wait(std::max(left, std::chrono::milliseconds(1)));
      }
    } catch (const std::exception& e) {
      double waited = std::chrono::duration<double>(Clock::now() - start).count();
      std::string reason = first_line(e.what());
      bool timed_out = waited >= 0.9 * seconds(timeout) || reason.find("imed out") != std::string::npos;
      if (timed_out) {
        error = fmt::format(
            "{} timed out after {:.1f} s in {}: waiting for the other ranks to enter the same collective "
            "(a rank that skipped it, issued collectives in another order, or is stuck elsewhere)",
            who, seconds(timeout), describe());
      } else {
        error = fmt::format("{} failed in {} after {:.1f} s: {} (another rank may have exited or failed)", who,
                            describe(), waited, reason);
      }
      recorder->finished(sequence, timed_out ? CollectiveState::TimedOut : CollectiveState::Failed);
      if (failure->record(error)) dump_flight_recorder(*recorder, error);
      done = true;
      throw CommError(error);
    }
  }
  if (finalize) {
    at::NoGradGuard no_grad;
    finalize();
  }
  finalize = nullptr;
  keep_alive.clear();
  done = true;
  recorder->finished(sequence, CollectiveState::Completed);
  log_completion();
}

void CollectiveHandle::State::log_completion() {
  if (logger)
    logger->record(kind, label, message_bytes,
                   std::chrono::duration<double, std::milli>(Clock::now() - issued_at).count());
}

bool CollectiveHandle::State::is_completed() {
  std::lock_guard lock(mutex);
  if (done) return true;
  for (auto& work : works) {
    if (!work->isCompleted()) return false;
  }
  return true;
}

CollectiveHandle::CollectiveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

void CollectiveHandle::wait() {
  if (state_) state_->wait();
}

bool CollectiveHandle::is_completed() const { return !state_ || state_->is_completed(); }

const std::string& CollectiveHandle::label() const {
  static const std::string empty;
  return state_ ? state_->label : empty;
}

std::uint64_t CollectiveHandle::sequence() const { return state_ ? state_->sequence : 0; }

std::string_view CollectiveHandle::kind() const { return state_ ? std::string_view(state_->kind) : std::string_view(); }

}  // namespace zt
