#include "launch/job_control.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "zerotrain/error.h"

namespace zt {
namespace {

using Clock = std::chrono::steady_clock;

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string where(const JobControlOptions& o) { return o.master_addr + ":" + std::to_string(o.master_port); }

std::string seconds(std::chrono::milliseconds d) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f s", double(d.count()) / 1000.0);
  return buffer;
}

// "code|message" in the store.
JobFailure parse_failure(const std::string& text) {
  JobFailure f;
  const size_t bar = text.find('|');
  f.code = bar == std::string::npos ? 1 : std::max(1, std::atoi(text.substr(0, bar).c_str()));
  f.message = bar == std::string::npos ? text : text.substr(bar + 1);
  return f;
}

}  // namespace

int listen_on_address(const std::string& address, int port, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found); rc != 0)
    throw ConfigError("launch: --master-addr '" + address + "': cannot resolve it (" + ::gai_strerror(rc) + ")");
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0)
    throw Error("launch: cannot listen on " + address + ":" + service + ": " + last_error +
                (port > 0 ? " (is another job using this port, or is the address not this machine's?)" : ""));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

JobControl::JobControl(const JobControlOptions& options) : options_(options) {
  const int N = options.nnodes, me = options.node_rank;
  c10d::TCPStoreOptions so;
  so.port = uint16_t(options.master_port);
  so.isServer = me == 0;
  so.waitWorkers = false;
  so.timeout = options.join_timeout;
  if (so.isServer) {
    int control_port = 0;
    so.masterListenFd = listen_on_address(options.master_addr, options.master_port, &control_port);
    rendezvous_fd_ = listen_on_address(options.master_addr, 0, &rendezvous_port_);
  }
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(options.master_addr, so);
    if (so.isServer) {
      store_->set(key("rendezvous_port"), bytes_of(std::to_string(rendezvous_port_)));
    } else {
      rendezvous_port_ = std::atoi(text_of(store_->get(key("rendezvous_port"))).c_str());
    }
    store_->set(key("joined/" + std::to_string(me)), bytes_of("1"));
    store_->add(key("joined"), 1);
  } catch (const c10::Error& e) {
    if (rendezvous_fd_ >= 0) ::close(rendezvous_fd_);
    throw Error("launch: node " + std::to_string(me) + " of " + std::to_string(N) +
                (me == 0 ? ": cannot serve the job's control store at " : ": cannot reach node 0's launcher at ") +
                where(options) + " within " + seconds(options.join_timeout) + ": " + e.what_without_backtrace());
  }
  // Every launcher waits for all: ranks started before a node exists would only time out later.
  const auto deadline = Clock::now() + options.join_timeout;
  while (true) {
    int64_t joined = 0;
    try {
      joined = store_->add(key("joined"), 0);
    } catch (const c10::Error& e) {
      // Node 0 gave up (its own join timeout) or is gone.
      if (rendezvous_fd_ >= 0) ::close(rendezvous_fd_);
      throw Error("launch: node " + std::to_string(me) + ": lost the job's control store at " + where(options) +
                  " while waiting for the other nodes to join: " + e.what_without_backtrace());
    }
    if (joined >= N) break;
    if (Clock::now() >= deadline) {
      std::string missing;
      try {
        for (int k = 0; k < N; ++k)
          if (!store_->check({key("joined/" + std::to_string(k))})) missing += (missing.empty() ? "" : ", ") + std::to_string(k);
      } catch (const c10::Error&) {
        missing = "unknown (node 0's store is gone)";
      }
      if (rendezvous_fd_ >= 0) ::close(rendezvous_fd_);
      throw Error("launch: node " + std::to_string(me) + ": " + std::to_string(joined) + " of " + std::to_string(N) +
                  " nodes joined at " + where(options) + " within " + seconds(options.join_timeout) +
                  "; missing node(s) " + missing + " (started with the same --nnodes, --master-addr and --master-port?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  last_heartbeat_.assign(size_t(N), std::string());
  heartbeat_changed_.assign(size_t(N), Clock::now());
}

JobControl::~JobControl() {
  if (rendezvous_fd_ >= 0) ::close(rendezvous_fd_);
}

std::string JobControl::key(const std::string& name) const { return "zt/launch/" + name; }

int JobControl::take_rendezvous_socket() {
  const int fd = rendezvous_fd_;
  rendezvous_fd_ = -1;
  return fd;
}

std::optional<JobFailure> JobControl::read_failure() {
  if (failure_seen_ || !store_->check({key("failure")})) return std::nullopt;
  failure_seen_ = true;
  return parse_failure(text_of(store_->get(key("failure"))));
}

std::optional<JobFailure> JobControl::poll() {
  if (store_lost_) return std::nullopt;
  const auto now = Clock::now();
  try {
    if (now - last_beat_ >= options_.heartbeat_interval) {
      last_beat_ = now;
      store_->set(key("heartbeat/" + std::to_string(options_.node_rank)), bytes_of(std::to_string(++beats_)));
      if (options_.node_rank == 0) {
        // A node that stopped beating before it finished has failed: its launcher was killed or
        // its machine is gone, and its ranks with it.
        for (int k = 1; k < options_.nnodes; ++k) {
          if (store_->check({key("done/" + std::to_string(k))})) continue;
          const std::string hb = key("heartbeat/" + std::to_string(k));
          const std::string value = store_->check({hb}) ? text_of(store_->get(hb)) : std::string();
          if (value != last_heartbeat_[size_t(k)]) {
            last_heartbeat_[size_t(k)] = value;
            heartbeat_changed_[size_t(k)] = now;
          } else if (now - heartbeat_changed_[size_t(k)] >= options_.heartbeat_timeout && !failure_seen_) {
            const JobFailure silent{1, "node " + std::to_string(k) + " stopped responding: no heartbeat from its launcher for " +
                                           seconds(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               now - heartbeat_changed_[size_t(k)])) +
                                           " (launcher killed, or machine gone)"};
            if (report_failure(silent)) return silent;
          }
        }
      }
    }
    return read_failure();
  } catch (const std::exception& e) {
    store_lost_ = true;
    failure_seen_ = true;
    return JobFailure{1, "lost the job's control store at " + where(options_) +
                             " (node 0's launcher is gone): " + (dynamic_cast<const c10::Error*>(&e)
                                                                      ? dynamic_cast<const c10::Error&>(e).what_without_backtrace()
                                                                      : e.what())};
  }
}

bool JobControl::report_failure(const JobFailure& failure) {
  if (store_lost_) return false;
  try {
    // The first report wins: compareSet writes only where nothing was, and returns what is there.
    const std::vector<uint8_t> mine = bytes_of(std::to_string(failure.code) + "|" + failure.message);
    if (store_->compareSet(key("failure"), {}, mine) != mine) return false;
    failure_seen_ = true;  // not to be read back as another node's
    return true;
  } catch (const std::exception&) {
    store_lost_ = true;
    return false;
  }
}

std::optional<JobFailure> JobControl::finish(int code) {
  if (store_lost_) return std::nullopt;
  std::optional<JobFailure> failure;
  try {
    store_->set(key("done/" + std::to_string(options_.node_rank)), bytes_of(std::to_string(code)));
    if (options_.node_rank != 0) return read_failure();
    // Node 0 serves the store until every node has finished (or fallen silent, which poll() turns
    // into a failure that ends the wait too).
    while (true) {
      bool all_done = true;
      for (int k = 1; k < options_.nnodes && all_done; ++k) all_done = store_->check({key("done/" + std::to_string(k))});
      if (auto f = poll(); f && !failure) failure = f;
      if (all_done || store_lost_) break;
      if (failure_seen_ && store_->check({key("failure")})) {
        // A failure is known to everyone; a silent node will not finish.
        bool silent = false;
        const auto now = Clock::now();
        for (int k = 1; k < options_.nnodes; ++k)
          if (!store_->check({key("done/" + std::to_string(k))}) && now - heartbeat_changed_[size_t(k)] >= options_.heartbeat_timeout)
            silent = true;
        if (silent) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    store_lost_ = true;
  }
  return failure;
}

}  // namespace zt
