#include "io/faults.h"

#include <cerrno>
#include <charconv>
#include <cstdlib>

#include "zerotrain/error.h"

namespace zt::io {

IoFaults::IoFaults(Kind kind_, int k_) : kind(kind_), k(k_) {}

int IoFaults::next_read_error() {
  const int n = ++reads_;
  if (kind != Kind::Read || n != k) return 0;
  hit_ = true;
  return EIO;
}

int IoFaults::next_write_error(bool* short_transfer) {
  const int n = ++writes_;
  if (kind == Kind::ShortWrite && n == k) {
    hit_ = true;
    if (short_transfer) *short_transfer = true;
    return 0;
  }
  if (kind == Kind::DiskFull && n >= k) {
    hit_ = true;
    return ENOSPC;
  }
  if (kind != Kind::Write || n != k) return 0;
  hit_ = true;
  return EIO;
}

std::shared_ptr<IoFaults> parse_io_faults(const std::string& text, const std::string& variable) {
  const auto bad = [&] {
    return zt::ConfigError(variable + "='" + text +
                           "': expected read:K, write:K, full:K or short:K with K a request number >= 1");
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) throw bad();
  const std::string what = text.substr(0, colon), number = text.substr(colon + 1);
  IoFaults::Kind kind;
  if (what == "read") {
    kind = IoFaults::Kind::Read;
  } else if (what == "write") {
    kind = IoFaults::Kind::Write;
  } else if (what == "full") {
    kind = IoFaults::Kind::DiskFull;
  } else if (what == "short") {
    kind = IoFaults::Kind::ShortWrite;
  } else {
    throw bad();
  }
  int k = 0;
  const auto [end, error] = std::from_chars(number.data(), number.data() + number.size(), k);
  if (number.empty() || error != std::errc() || end != number.data() + number.size() || k < 1) throw bad();
  return std::make_shared<IoFaults>(kind, k);
}

std::shared_ptr<IoFaults> io_faults_from_environment() {
  const char* value = std::getenv("ZT_IO_FAULT");
  if (value == nullptr || *value == '\0') return nullptr;
  return parse_io_faults(value, "ZT_IO_FAULT");
}

}  // namespace zt::io
