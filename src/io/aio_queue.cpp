// The ticket ring of the I/O engine (aio_impl.h): tickets queued by the caller, split into block
// requests that the I/O threads take and post back, all under the engine's one lock.
#include "io/aio_impl.h"

#include <algorithm>

namespace zt::io {

bool AioEngine::Impl::take(Request& r) {
  if (stopping) return false;
  while (next_dispatch < tail) {
    TicketState& t = at(next_dispatch);
    if (t.dispatched < t.bytes && t.error == 0) {
      const int64_t length = std::min(options.block_size, t.bytes - t.dispatched);
      r.ticket = t.id;
      r.op = t.op;
      r.fd = files[size_t(t.file)].fd;
      r.data = t.data + t.dispatched;
      r.offset = t.offset + t.dispatched;
      r.length = length;
      r.injected = 0;
      r.short_once = false;
      if (faults) r.injected = t.op == Op::Read ? faults->next_read_error() : faults->next_write_error(&r.short_once);
      t.dispatched += length;
      ++t.outstanding;
      ++totals.requests;
      const auto now = Clock::now();
      if (t.op == Op::Read) {
        if (reads_in_flight++ == 0) reads_since = now;
      } else if (writes_in_flight++ == 0) {
        writes_since = now;
      }
      return true;
    }
    ++next_dispatch;
  }
  return false;
}

bool AioEngine::Impl::complete(const Request& r, int64_t result) {
  const auto now = Clock::now();
  if (r.op == Op::Read) {
    if (--reads_in_flight == 0) totals.read_seconds += std::chrono::duration<double>(now - reads_since).count();
  } else if (--writes_in_flight == 0) {
    totals.write_seconds += std::chrono::duration<double>(now - writes_since).count();
  }
  TicketState& t = at(r.ticket);
  if (result > 0) (r.op == Op::Read ? totals.bytes_read : totals.bytes_written) += result;
  // Of several failed requests of one ticket, the first in the file is reported: the same
  // message whatever order the requests finished in.
  if (result != r.length && (t.error == 0 || r.offset < t.fail_offset)) {
    t.error = result < 0 ? int(-result) : EIO;
    t.fail_transferred = result < 0 ? -1 : result;
    t.fail_offset = r.offset;
    t.fail_length = r.length;
  }
  --t.outstanding;
  if (t.outstanding == 0 && (t.dispatched == t.bytes || t.error != 0)) {
    t.done = true;
    --pending;
    return true;
  }
  return false;
}

IoError AioEngine::Impl::failure(const TicketState& t) const {
  const std::string& path = files[size_t(t.file)].path.string();
  std::string what = describe_errno(t.error);
  if (t.fail_transferred >= 0)
    what = fmt::format("short {}, {} of {} bytes transferred: {}", t.op == Op::Read ? "read" : "write",
                       t.fail_transferred, t.fail_length, what);
  return IoError(fmt::format("{} '{}' at offset {} ({} bytes): {}", verb(t.op), path, t.fail_offset,
                             t.fail_length, what),
                 t.error);
}

AioEngine::Ticket AioEngine::Impl::issue(Op op, int file, int64_t offset, const void* data, int64_t bytes) {
  Impl& d = *this;
  Ticket id;
  {
    std::lock_guard lock(d.mu);
    if (file < 0 || size_t(file) >= d.files.size())
      throw zt::Error(fmt::format("AioEngine: {} file handle {}: no such file (open() returned 0 to {})", verb(op),
                                  file, int64_t(d.files.size()) - 1));
    const auto& f = d.files[size_t(file)];
    if (f.fd < 0)
      throw zt::Error(fmt::format("AioEngine: {} '{}': the file was closed", verb(op), f.path.string()));
    const auto address = reinterpret_cast<uintptr_t>(data);
    if (offset < 0 || bytes < 0 || offset % kAlignment != 0 || bytes % kAlignment != 0 || address % kAlignment != 0)
      throw zt::Error(fmt::format(
          "{} '{}': offset {}, length {} and buffer address {:#x} must each be a multiple of {} (O_DIRECT)",
          verb(op), f.path.string(), offset, bytes, address, kAlignment));
    if (offset + bytes > f.size)
      throw zt::Error(fmt::format("{} '{}' at offset {} ({} bytes): beyond the file's size of {} bytes", verb(op),
                                  f.path.string(), offset, bytes, f.size));
    d.advance_head();  // retire the done tickets nobody waited for
    if (d.tail - d.head == int64_t(d.ring.size())) d.grow_ring();
    id = d.tail++;
    TicketState& t = d.at(id);
    t = TicketState{};
    t.id = id;
    t.op = op;
    t.file = file;
    t.offset = offset;
    t.bytes = bytes;
    t.data = static_cast<char*>(const_cast<void*>(data));
    if (bytes == 0) {
      t.done = true;
    } else {
      ++d.pending;
    }
  }
  if (bytes > 0) d.work_cv.notify_all();
  return id;
}

}  // namespace zt::io
