#include "zerotrain/data.h"

namespace zt {

BatchPrefetcher::BatchPrefetcher(Producer make, int64_t first_index)
    : make_(std::move(make)), index_(first_index), requested_(true) {
  worker_ = std::thread([this] { run(); });
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();  // an in-flight make() finishes first; its result is dropped
}

int64_t BatchPrefetcher::next_index() const {
  std::lock_guard lock(mu_);
  return index_;
}

void BatchPrefetcher::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || requested_; });
    if (stop_) return;
    requested_ = false;
    const int64_t index = index_;
    lock.unlock();  // the producer runs unlocked: this is the overlap with the caller's step
    std::optional<Batch> result;
    std::exception_ptr error;
    try {
      result = make_(index);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    ready_ = std::move(result);
    error_ = error;
    cv_.notify_all();
  }
}

Batch BatchPrefetcher::next() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return ready_.has_value() || error_ != nullptr; });
  if (error_) {
    // Retry the same index on the following call; start it now so the retry overlaps too.
    auto error = std::exchange(error_, nullptr);
    requested_ = true;
    lock.unlock();
    cv_.notify_all();
    std::rethrow_exception(error);
  }
  Batch batch = std::move(*ready_);
  ready_.reset();
  ++index_;
  requested_ = true;
  lock.unlock();
  cv_.notify_all();
  return batch;
}

}  // namespace zt
