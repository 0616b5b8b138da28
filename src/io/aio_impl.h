// The I/O engine's internals shared by its parts (aio.h): the ticket ring and the block requests
// the I/O threads take from it (aio_queue.cpp), and the threads' loops, pread/pwrite
// (aio_posix.cpp) and io_uring (aio_uring.cpp). Every source including this one is compiled with
// the same ZT_HAVE_IO_URING, so that AioEngine::Impl has one layout.
#pragma once
#ifdef ZT_HAVE_IO_URING
#include <liburing.h>
#endif

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io/aio.h"

namespace zt::io {

using Clock = std::chrono::steady_clock;
enum class Op : unsigned char { Read, Write };

inline const char* verb(Op op) { return op == Op::Read ? "reading" : "writing"; }

inline std::string describe_errno(int error) { return fmt::format("{} (errno {})", std::strerror(error), error); }

struct TicketState {
  int64_t id = 0;
  Op op = Op::Read;
  int file = 0;
  int64_t offset = 0, bytes = 0;
  char* data = nullptr;
  int64_t dispatched = 0;  // bytes handed to I/O threads so far
  int outstanding = 0;     // requests in flight
  bool done = false, reported = false;
  // The first failure: errno, the failed request, and for a short transfer what it moved (-1: not short).
  int error = 0;
  int64_t fail_offset = 0, fail_length = 0, fail_transferred = -1;
};

// One block request, in a slot an I/O thread allocated when it started.
struct Request {
  int64_t ticket = 0;
  Op op = Op::Read;
  int fd = -1;
  char* data = nullptr;
  int64_t offset = 0, length = 0;
  int injected = 0;  // errno of an injected failure, 0 for none
  bool short_once = false;  // an injected short transfer: the first call moves half the bytes
};

// pread/pwrite of the request's bytes from `done` on. A call may move fewer bytes than asked (a
// buffered file system may), so the rest is asked for again until all have moved; returns the
// request's length, the bytes moved before the end of the file (reported as a short transfer),
// or -errno.
int64_t transfer_blocking(const Request& r, int64_t done = 0);

struct AioEngine::Impl {
  AioOptions options;
  std::shared_ptr<IoFaults> faults;
  bool use_uring = false;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // I/O threads wait here for tickets
  std::condition_variable done_cv;  // callers wait here for tickets to finish
  // Tickets [head, tail) live at ring[id & (size - 1)]; ids below head are done. A done ticket
  // leaves the ring once every ticket before it is done, waited for or not, so the ring holds
  // only what is in flight or queued behind it; a failure nobody has been told of yet moves to
  // `unreported` until wait() or wait_all() reports it.
  std::vector<TicketState> ring;
  std::map<int64_t, TicketState> unreported;
  int64_t head = 1, tail = 1;
  int64_t next_dispatch = 1;  // no ticket below this has bytes left to hand out
  int64_t pending = 0;        // tickets not done yet
  bool stopping = false;

  struct File {
    std::filesystem::path path;
    int fd = -1;
    int64_t size = 0;
  };
  std::vector<File> files;
  bool said_no_direct = false;

  Stats totals;
  int reads_in_flight = 0, writes_in_flight = 0;
  Clock::time_point reads_since, writes_since;

  std::vector<std::thread> threads;
#ifdef ZT_HAVE_IO_URING
  std::vector<io_uring> rings;
#endif

  void say(const std::string& line) const {
    if (options.log) {
      options.log(line);
    } else {
      std::cerr << "zerotrain: note: " << line << std::endl;
    }
  }

  TicketState& at(int64_t id) { return ring[size_t(id) & (ring.size() - 1)]; }
  const TicketState& at(int64_t id) const { return ring[size_t(id) & (ring.size() - 1)]; }

  void grow_ring() {
    std::vector<TicketState> bigger(ring.size() * 2);
    for (int64_t id = head; id < tail; ++id) bigger[size_t(id) & (bigger.size() - 1)] = at(id);
    ring.swap(bigger);
  }

  void advance_head() {
    for (; head < tail && at(head).done; ++head)
      if (at(head).error != 0 && !at(head).reported) unreported.emplace(head, at(head));
    next_dispatch = std::max(next_dispatch, head);
  }

  // Under mu: the next block request into `r`; false when there is none (or the engine stops).
  bool take(Request& r);

  // Under mu: the result of a request taken with take(); `result` is bytes moved or -errno.
  // Returns whether its ticket finished.
  bool complete(const Request& r, int64_t result);

  IoError failure(const TicketState& t) const;

  // Validates and queues a ticket; the I/O threads split it into requests.
  Ticket issue(Op op, int file, int64_t offset, const void* data, int64_t bytes);

  // An I/O thread of the pread/pwrite backend.
  void posix_loop();

#ifdef ZT_HAVE_IO_URING
  // An I/O thread of the io_uring backend, on its own ring.
  void uring_loop(io_uring& ring_);

  // Submits the `count` prepared entries (the last ones of taken[0, end)); returns how many the
  // kernel did not consume (0 on success). A hard failure of io_uring_enter
  // (not EINTR/EAGAIN/EBUSY, which are retried) leaves entries in the submission queue that the
  // kernel may or may not have consumed; this thread then stops submitting (waiting for
  // completions submits nothing) and does its remaining requests with pread/pwrite. The requests
  // of this batch that were not consumed complete with the error.
  int submit(io_uring& ring_, int count, const std::vector<int>& taken, size_t end,
             std::vector<std::pair<int, int64_t>>& results);
#endif
};

}  // namespace zt::io
