// The pread/pwrite backend of the I/O engine (aio_impl.h): each I/O thread transfers one block
// request at a time; io_uring's threads also use transfer_blocking() for what the ring cannot do.
#include "io/aio_impl.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace zt::io {

int64_t transfer_blocking(const Request& r, int64_t done) {
  bool first = true;
  while (done < r.length) {
    int64_t ask = r.length - done;
    // An injected short transfer: about half, still aligned for O_DIRECT.
    if (first && r.short_once) ask = std::max<int64_t>(kAlignment, ask / 2 / kAlignment * kAlignment);
    first = false;
    const ssize_t n = r.op == Op::Read ? ::pread(r.fd, r.data + done, size_t(ask), off_t(r.offset + done))
                                       : ::pwrite(r.fd, r.data + done, size_t(ask), off_t(r.offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -int64_t(errno);
    }
    if (n == 0) break;  // the end of the file: nothing more will come
    done += n;
  }
  return done;
}

void AioEngine::Impl::posix_loop() {
  Request r;
  for (;;) {
    {
      std::unique_lock lock(mu);
      while (!take(r)) {
        if (stopping) return;
        work_cv.wait(lock);
      }
    }
    const int64_t result = r.injected != 0 ? -int64_t(r.injected) : transfer_blocking(r);
    bool finished;
    {
      std::lock_guard lock(mu);
      finished = complete(r, result);
    }
    if (finished) done_cv.notify_all();
  }
}

}  // namespace zt::io
