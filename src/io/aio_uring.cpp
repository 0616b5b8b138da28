// The io_uring backend of the I/O engine (aio_impl.h): each I/O thread keeps up to queue_depth
// block requests in flight on its own ring, falling back to pread/pwrite for what the ring cannot do.
#include "io/aio_impl.h"

#ifdef ZT_HAVE_IO_URING

#include <cerrno>
#include <numeric>

namespace zt::io {

// long: one I/O thread's cycle (take requests, prepare and submit them, reap, complete) over the
// request slots it owns
void AioEngine::Impl::uring_loop(io_uring& ring_) {
  const int depth = options.queue_depth;
  std::vector<Request> slots(static_cast<size_t>(depth));
  std::vector<int> free_slots(static_cast<size_t>(depth));
  std::iota(free_slots.rbegin(), free_slots.rend(), 0);
  std::vector<int> taken, retry;
  std::vector<std::pair<int, int64_t>> results;
  taken.reserve(size_t(depth));
  retry.reserve(size_t(depth));
  results.reserve(size_t(depth));
  int in_flight = 0;       // submitted to the ring, not yet reaped
  bool ring_failed = false;  // after a submission error the ring is no longer used (see below)

  for (;;) {
    taken.swap(retry);
    retry.clear();
    {
      std::unique_lock lock(mu);
      for (;;) {
        // Without overlap_events a batch is submitted and then reaped in full before the next.
        if (options.overlap_events || in_flight == 0) {
          while (!free_slots.empty() && take(slots[size_t(free_slots.back())])) {
            taken.push_back(free_slots.back());
            free_slots.pop_back();
          }
        }
        if (!taken.empty() || in_flight > 0) break;
        if (stopping) return;
        work_cv.wait(lock);
      }
    }

    int batch = 0;
    for (size_t i = 0; i < taken.size(); ++i) {
      const int s = taken[i];
      const Request& r = slots[size_t(s)];
      if (r.injected != 0 || r.short_once || ring_failed) {
        results.emplace_back(s, r.injected != 0 ? -int64_t(r.injected) : transfer_blocking(r));
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr && batch > 0) {
        const int unconsumed = submit(ring_, batch, taken, i, results);
        in_flight -= unconsumed;
        ring_failed = unconsumed > 0;
        batch = 0;
        if (!ring_failed) sqe = io_uring_get_sqe(&ring_);
      }
      if (sqe == nullptr || ring_failed) {  // cannot happen with depth slots; stay correct anyway
        results.emplace_back(s, transfer_blocking(r));
        continue;
      }
      if (r.op == Op::Read) {
        io_uring_prep_read(sqe, r.fd, r.data, unsigned(r.length), __u64(r.offset));
      } else {
        io_uring_prep_write(sqe, r.fd, r.data, unsigned(r.length), __u64(r.offset));
      }
      io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(uintptr_t(s)));
      ++in_flight;
      ++batch;
      if (options.single_submit) {
        const int unconsumed = submit(ring_, batch, taken, i + 1, results);
        in_flight -= unconsumed;
        ring_failed = unconsumed > 0;
        batch = 0;
      }
    }
    if (batch > 0) {
      const int unconsumed = submit(ring_, batch, taken, taken.size(), results);
      in_flight -= unconsumed;
      ring_failed = unconsumed > 0;
    }
    taken.clear();

    if (in_flight > 0 && results.empty()) {
      const unsigned want = options.overlap_events ? 1u : unsigned(in_flight);
      io_uring_cqe* cqe = nullptr;
      int rc;
      do {
        rc = io_uring_wait_cqe_nr(&ring_, &cqe, want);
      } while (rc == -EINTR || rc == -EAGAIN);
    }
    unsigned cq_head, reaped = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&ring_, cq_head, cqe) {
      const int s = int(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqe)));
      ++reaped;
      if (cqe->res == -EAGAIN || cqe->res == -EINTR) {
        retry.push_back(s);  // transient: issue the same request again
      } else if (cqe->res > 0 && cqe->res < slots[size_t(s)].length) {
        // A short transfer: the rest is moved here (pread/pwrite), as the fallback does.
        results.emplace_back(s, transfer_blocking(slots[size_t(s)], int64_t(cqe->res)));
      } else {
        results.emplace_back(s, int64_t(cqe->res));
      }
    }
    io_uring_cq_advance(&ring_, reaped);
    in_flight -= int(reaped);

    if (!results.empty()) {
      bool finished = false;
      {
        std::lock_guard lock(mu);
        for (const auto& [s, result] : results) {
          finished |= complete(slots[size_t(s)], result);
          free_slots.push_back(s);
        }
      }
      results.clear();
      if (finished) done_cv.notify_all();
    }
  }
}

int AioEngine::Impl::submit(io_uring& ring_, int count, const std::vector<int>& taken, size_t end,
                              std::vector<std::pair<int, int64_t>>& results) {
  int left = count;
  while (left > 0) {
    const int rc = io_uring_submit(&ring_);
    if (rc > 0) {
      left -= rc;
      continue;
    }
    if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY || rc == 0) {
      if (rc != -EINTR) std::this_thread::sleep_for(std::chrono::microseconds(50));
      continue;
    }
    // The last `left` prepared entries of the batch were not consumed.
    size_t i = end;
    for (int failed = 0; failed < left && i > 0;) {
      --i;
      results.emplace_back(taken[i], int64_t(rc));
      ++failed;
    }
    say(fmt::format("io_uring_submit failed: {}; this I/O thread continues with pread/pwrite",
                    describe_errno(-rc)));
    return left;
  }
  return 0;
}

}  // namespace zt::io

#endif  // ZT_HAVE_IO_URING
