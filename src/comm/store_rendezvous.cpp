// The rendezvous at rank 0's TCP store (docs/comm.md "Rendezvous"): the store on a loopback-only
// socket for local runs or on the socket the launcher handed down, generations that keep
// successive communicators' peers apart, and the count of arrivals.
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "comm/process_group.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

using comm_detail::Clock;
using comm_detail::first_line;
using comm_detail::is_loopback;
using comm_detail::seconds;

// Listening socket on the loopback address for rank 0's store: a local run must not be
// reachable from the network (TCPStore on its own binds every interface).
int listen_on_loopback(const RendezvousInfo& info) {
  bool v6 = info.master_addr == "::1";
  int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw CommError(fmt::format("rank 0/{}: socket() failed: {}", info.world_size, std::strerror(errno)));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (v6) {
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_loopback;
    addr.sin6_port = htons(uint16_t(info.master_port));
    rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(uint16_t(info.master_port));
    rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  if (rc != 0 || listen(fd, 128) != 0) {
    int err = errno;
    close(fd);
    throw CommError(fmt::format("rank 0/{}: cannot listen on {}:{} for the rendezvous: {} (is another job using "
                                "MASTER_PORT={}?)",
                                info.world_size, info.master_addr, info.master_port, std::strerror(err),
                                info.master_port));
  }
  return fd;
}

// The launcher's socket is one per process: the first store takes it (and owns it from then
// on); a later communicator in the same process binds the port itself as without a launcher.
bool take_handed_down_socket() {
  static std::atomic<bool> taken{false};
  return !taken.exchange(true);
}

// The socket the launcher handed down must be what it claims: listening, on MASTER_PORT.
int checked_handed_down_socket(const RendezvousInfo& info) {
  const int fd = info.listen_fd;
  int listening = 0;
  socklen_t len = sizeof(listening);
  sockaddr_storage addr{};
  socklen_t addr_len = sizeof(addr);
  int port = -1;
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &addr_len) == 0) {
    if (addr.ss_family == AF_INET) port = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6) port = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  }
  if (!listening || port != info.master_port)
    throw CommError(fmt::format("rank 0/{}: ZT_RENDEZVOUS_LISTEN_FD={}: expected a socket listening on MASTER_PORT={}, "
                                "found {}",
                                info.world_size, fd, info.master_port,
                                port < 0 ? std::string("no socket")
                                         : fmt::format("{} on port {}", listening ? "a listening socket" : "a socket not listening", port)));
  // Not passed on to whatever this rank starts.
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
}

// This process's count of rendezvous at host:port, this one included.
int next_generation(const std::string& host, int port) {
  static std::mutex mu;
  static std::map<std::string, int> counts;
  std::lock_guard lock(mu);
  return ++counts[host + ":" + std::to_string(port)];
}

// Counts this rank in and waits until every rank of `info` has arrived at `store`, or `deadline`.
void wait_for_arrivals(c10d::Store& store, const RendezvousInfo& info, const std::string& where,
                       Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string key = "zt/rendezvous/arrived";
  try {
    int64_t arrived = store.add(key, 1);
    while (arrived < info.world_size) {
      if (Clock::now() > deadline) {
        throw CommError(fmt::format(
            "rank {}/{} timed out after {:.1f} s at the rendezvous at {}: {} of {} ranks arrived; waiting for the "
            "others (are all ranks started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)",
            info.rank, info.world_size, seconds(timeout), where, arrived, info.world_size));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      arrived = store.add(key, 0);
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(fmt::format("rank {}/{}: rendezvous at {} failed: {}", info.rank, info.world_size, where,
                                first_line(e.what())));
  }
}

}  // namespace

namespace comm_detail {

c10::intrusive_ptr<c10d::Store> rendezvous(const RendezvousInfo& info, std::chrono::milliseconds timeout) {
  bool local = is_loopback(info.master_addr);
  std::string host = info.master_addr == "localhost" ? "127.0.0.1" : info.master_addr;
  std::string where = fmt::format("{}:{} ({} rendezvous)", host, info.master_port, info.source);
  c10d::TCPStoreOptions so;
  so.port = uint16_t(info.master_port);
  so.isServer = info.rank == 0 && !info.agent_store;
  so.numWorkers = size_t(info.world_size);
  so.waitWorkers = false;  // we wait ourselves below, with a message that counts arrivals
  so.timeout = timeout;
  if (so.isServer && info.listen_fd >= 0 && take_handed_down_socket()) {
    so.masterListenFd = checked_handed_down_socket(info);  // the store takes the socket
  } else if (so.isServer && local) {
    so.masterListenFd = listen_on_loopback(info);
  }

  // A process that makes several communicators on one port (one after another) meets its peers
  // at each in turn: the n-th store of rank 0 is stamped with generation n, and a rank making its
  // n-th communicator that reaches a store of an earlier one (rank 0 has not closed it yet) lets
  // go and connects again. Without this a rank running ahead joined the old store, counted as
  // arrived there and hung in the new group (docs/comm.md "Rendezvous").
  const int generation = next_generation(host, info.master_port);
  const std::string generation_key = "zt/rendezvous/generation";
  const auto deadline = Clock::now() + timeout;
  c10::intrusive_ptr<c10d::Store> store;
  std::string last_failure;
  while (true) {
    try {
      // A later attempt waits only for what is left of the timeout.
      so.timeout = std::max(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      store = c10::make_intrusive<c10d::TCPStore>(host, so);
      if (info.agent_store) break;  // torchrun's store: this process's n-th communicator uses its own prefix (below)
      if (so.isServer) {
        store->set(generation_key, std::to_string(generation));
        break;
      }
      const std::vector<uint8_t> value = store->get(generation_key);
      const int found = std::atoi(std::string(value.begin(), value.end()).c_str());
      if (found == generation) break;
      if (found > generation)
        throw CommError(fmt::format("rank {}/{}: the rendezvous store at {} serves rank 0's communicator number {}, "
                                    "this is this rank's number {} (do all ranks create their communicators in the "
                                    "same order?)",
                                    info.rank, info.world_size, where, found, generation));
      last_failure = fmt::format("reached rank 0's communicator number {}, expected {}", found, generation);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      if (so.isServer)
        throw CommError(fmt::format("rank {}/{}: could not {} rendezvous store at {} within {:.1f} s: {}", info.rank,
                                    info.world_size, so.isServer ? "start the" : "reach rank 0's", where,
                                    seconds(timeout), first_line(e.what())));
      last_failure = first_line(e.what());
    }
    store.reset();
    if (Clock::now() > deadline)
      throw CommError(fmt::format("rank {}/{}: could not reach rank 0's rendezvous store at {} within {:.1f} s: {}",
                                  info.rank, info.world_size, where, seconds(timeout), last_failure));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  store->setTimeout(timeout);  // what later waits on the store (the group's set-up) may use
  // One store serves every communicator of the job (and torchrun's own keys): each generation
  // meets under its own prefix, so that arrivals and Gloo's keys of an earlier one do not count.
  if (info.agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>("zt/communicator" + std::to_string(generation), store);

  wait_for_arrivals(*store, info, where, deadline, timeout);
  return store;
}

}  // namespace comm_detail
}  // namespace zt
