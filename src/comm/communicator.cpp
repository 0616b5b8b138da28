// Communicator over c10d process groups: Gloo for CPU tensors, NCCL for CUDA tensors (ZT_CUDA).
// Adds what c10d leaves to the caller: a sequence number and label on every collective, a
// bounded wait with a message that says who waited for what, emulations where a backend lacks
// a primitive, and a loopback-only rendezvous for local runs.
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef ZT_CUDA
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1  // the header's contents are guarded by it; the CUDA wheel is built with NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "comm/collective_paths.h"
#include "comm/flight_recorder.h"
#include "comm/node_groups.h"
#include "comm/shared_memory.h"
#include "zerotrain/comm.h"
#include "zerotrain/comms_logger.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds ms) { return double(ms.count()) / 1000.0; }

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

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    default: return c10::toString(t);
  }
}

bool is_low_precision(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

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

// What each backend can do natively. Anything false is emulated (docs/comm.md).
struct BackendCaps {
  bool avg = true;
  bool low_precision_reduce = true;
  bool reduce_scatter = true;
};

// Gloo in LibTorch 2.11 (checked with a probe on 2 ranks): allreduce SUM/AVG/MAX,
// _reduce_scatter_base (also AVG), _allgather_base and broadcast, for float, double, bfloat16
// and float16. Older Gloo (LibTorch 1.13) had no AVG, no bf16 and no reduce-scatter, which is
// why the emulations exist and can be forced with CollectivePaths.
constexpr BackendCaps kGlooCaps{true, true, true};

// The failure that made the communicator unusable, followed by what led to it, in the rank's log.
void dump_flight_recorder(const FlightRecorder& recorder, const std::string& error) {
  std::string text = "zerotrain comm: " + error + "\n" + recorder.dump();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

}  // namespace

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
  std::shared_ptr<FailureState> failure;
  std::shared_ptr<FlightRecorder> recorder;
  // Set only for collectives the comms logger records; then issued_at is the issue time.
  std::shared_ptr<CommsLogger> logger;
  Clock::time_point issued_at;
  std::uint64_t message_bytes = 0;  // as the comms logger counts them

  std::mutex mutex;
  bool done = false;
  std::string error;

  std::string describe() const {
    return fmt::format("{} '{}' (seq {}{}{})", kind, label, sequence, size_text.empty() ? "" : ", ", size_text);
  }

  void wait() {
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

  void log_completion() {
    if (logger)
      logger->record(kind, label, message_bytes,
                     std::chrono::duration<double, std::milli>(Clock::now() - issued_at).count());
  }

  bool is_completed() {
    std::lock_guard lock(mutex);
    if (done) return true;
    for (auto& work : works) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }
};

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

namespace {

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

  const std::string key = "zt/rendezvous/arrived";
  try {
    int64_t arrived = store->add(key, 1);
    while (arrived < info.world_size) {
      if (Clock::now() > deadline) {
        throw CommError(fmt::format(
            "rank {}/{} timed out after {:.1f} s at the rendezvous at {}: {} of {} ranks arrived; waiting for the "
            "others (are all ranks started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)",
            info.rank, info.world_size, seconds(timeout), where, arrived, info.world_size));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      arrived = store->add(key, 0);
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw CommError(fmt::format("rank {}/{}: rendezvous at {} failed: {}", info.rank, info.world_size, where,
                                first_line(e.what())));
  }
  return store;
}

// In the file the launcher named (it survives the rank's death), else in memory. A file that
// cannot be created costs the post-mortem, not the run: say so and keep the ring in memory. A
// communicator of one rank has no peer to wait for or diverge from: its ring stays in memory, and
// the file stays free for the rank's communicator that has peers (make_node_groups makes one-rank
// groups beside it).
std::shared_ptr<FlightRecorder> make_recorder(const RendezvousInfo& info) {
  const char* path = std::getenv(kFlightRecorderFileVariable);
  if (path != nullptr && *path != '\0' && info.world_size > 1) {
    try {
      return std::make_shared<FlightRecorder>(info.rank, info.world_size, path);
    } catch (const std::exception& e) {
      std::string text = fmt::format("zerotrain comm: rank {}: {}; keeping the flight recorder in memory only\n",
                                     info.rank, e.what());
      std::fwrite(text.data(), 1, text.size(), stderr);
    }
  }
  return std::make_shared<FlightRecorder>(info.rank, info.world_size);
}

// The Gloo process group of `info`'s ranks over `store` (on the loopback device when the master
// is loopback, else GLOO_SOCKET_IFNAME's interface or the default one).
c10::intrusive_ptr<c10d::Backend> connect_gloo(const c10::intrusive_ptr<c10d::Store>& store, const RendezvousInfo& info,
                                               const CommOptions& options, const std::string& who) {
  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    if (is_loopback(info.master_addr)) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("zt/gloo", store),
                                                       info.rank, info.world_size, gloo_options);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("{}: could not connect the Gloo process group ({}:{}) within {:.1f} s: {}", who,
                                info.master_addr, info.master_port, seconds(options.timeout), first_line(e.what())));
  }
}

// The shared-memory path of `info`'s ranks, or null where some rank cannot map the segment (another
// machine) or the paths are Gloo's own (the emulations and native_gloo_* measure and test those).
std::shared_ptr<SharedMemoryTransport> connect_shared_memory(c10d::Store& store, const RendezvousInfo& info,
                                                             const CommOptions& options, const CollectivePaths& paths,
                                                             const std::string& who) {
  if (!options.shared_memory || paths.any() || info.world_size < 2) return nullptr;
  try {
    return SharedMemoryTransport::connect(store, info.rank, info.world_size, options.timeout, who);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("{}: could not set up the shared-memory collectives within {:.1f} s: {}", who,
                                seconds(options.timeout), first_line(e.what())));
  }
}

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(const RendezvousInfo& info, const CommOptions& options, const CollectivePaths& paths)
      : info_(info), options_(options), paths_(paths), who_(fmt::format("rank {}/{}", info.rank, info.world_size)),
        job_rank_(info.rank),
        failure_(std::make_shared<FailureState>()) {
    if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size) {
      throw ConfigError(fmt::format("rendezvous: expected 0 <= rank < world size, found rank {} of {}", info.rank,
                                    info.world_size));
    }
    recorder_ = make_recorder(info);
    if (info.world_size == 1) return;  // nothing to meet; collectives are local copies
    caps_ = kGlooCaps;
    caps_.avg = caps_.avg && !paths.emulate_avg;
    caps_.low_precision_reduce = caps_.low_precision_reduce && !paths.emulate_low_precision;
    caps_.reduce_scatter = caps_.reduce_scatter && !paths.emulate_reduce_scatter;

    store_ = rendezvous(info, options.timeout);
    gloo_ = connect_gloo(store_, info, options, who_);
    shm_ = connect_shared_memory(*store_, info, options, paths, who_);
  }

  // A group of a split: `store` is the group's own prefix of the job's store (null for a group of
  // one), `gloo` the group's process group (null for a group of one).
  struct Group {
    std::string name;  // "node"; a group split from a group: "hpz/node"
    int job_rank = 0;
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::Backend> gloo;
    std::shared_ptr<SharedMemoryTransport> shm;  // null: Gloo alone
    BackendCaps caps;
  };
  ProcessGroupCommunicator(const RendezvousInfo& info, const CommOptions& options, const CollectivePaths& paths,
                           Group group)
      : info_(info), options_(options), paths_(paths),
        who_(fmt::format("rank {}/{} of group '{}' (rank {} of the job)", info.rank, info.world_size, group.name,
                         group.job_rank)),
        group_name_(std::move(group.name)), job_rank_(group.job_rank), caps_(group.caps),
        failure_(std::make_shared<FailureState>()),
        recorder_(std::make_shared<FlightRecorder>(info.rank, info.world_size)),
        store_(std::move(group.store)), gloo_(std::move(group.gloo)), shm_(std::move(group.shm)) {}

  int rank() const override { return info_.rank; }
  int world_size() const override { return info_.world_size; }
  std::uint64_t next_sequence() const override { return next_sequence_; }
  const FlightRecorder& flight_recorder() const { return *recorder_; }

  CollectiveHandle all_reduce(at::Tensor flat, ReduceOp op, std::string_view label) override {
    check_tensor("all_reduce", label, flat, "flat");
    auto state = begin("all_reduce", label, elements_text(flat), flat.nbytes(), flat.nbytes());
    if (info_.world_size == 1) return finish_local(state);  // the reduction of one buffer is itself
    state->keep_alive = {flat};
    if (on_shared_memory(flat) && SharedMemoryTransport::reduces(flat.scalar_type(), op)) {
      issue(*state, [&] { return shm_->all_reduce(flat, op); });
      return CollectiveHandle(state);
    }

    // Emulation: reduce a low-precision buffer in an fp32 temporary, then round once.
    bool widen = is_low_precision(flat) && !caps_.low_precision_reduce;
    at::Tensor buffer = widen ? flat.to(at::kFloat) : flat;
    bool divide = op == ReduceOp::Avg && !caps_.avg;  // Emulation: AVG as SUM then divide.
    c10d::AllreduceOptions o;
    o.reduceOp = c10d_op(op);
    o.timeout = options_.timeout;
    std::vector<at::Tensor> tensors{buffer};
    issue(*state, [&] { return backend_for(flat, *state).allreduce(tensors, o); });
    state->keep_alive = {flat, buffer};
    if (divide || widen) {
      int world = info_.world_size;
      state->finalize = [flat, buffer, divide, widen, world] {
        if (divide) buffer.div_(world);
        if (widen) flat.copy_(buffer);
      };
    }
    return CollectiveHandle(state);
  }

  CollectiveHandle reduce_scatter(at::Tensor input, at::Tensor output, ReduceOp op, std::string_view label,
                                  InputUse input_use = InputUse::Preserve) override {
    check_tensor("reduce_scatter", label, input, "input");
    check_tensor("reduce_scatter", label, output, "output");
    check_pair("reduce_scatter", label, output, input, "input");
    auto state = begin("reduce_scatter", label, elements_text(output) + " per rank", input.nbytes(), output.nbytes());
    if (info_.world_size == 1) {
      output.copy_(input);
      return finish_local(state);
    }
    state->keep_alive = {input, output};
    if (on_shared_memory(input) && SharedMemoryTransport::reduces(input.scalar_type(), op)) {
      // Reads the input without changing it, whatever input_use allows; the output may alias it.
      issue(*state, [&] { return shm_->reduce_scatter(input, output, op); });
      return CollectiveHandle(state);
    }
    int world = info_.world_size;
    int64_t n = output.numel();
    int64_t begin_at = info_.rank * n;
    bool widen = is_low_precision(input) && !caps_.low_precision_reduce;
    bool divide = op == ReduceOp::Avg && !caps_.avg;
    at::Tensor in = widen ? input.to(at::kFloat) : input;
    const bool all_reduce_in_place =
        input_use == InputUse::Scratch && !widen && input.device().is_cpu() && !paths_.native_gloo_reduce_scatter;
    if (!caps_.reduce_scatter || all_reduce_in_place) {
      // All-reduce the whole buffer and keep our block. As an emulation (no reduce-scatter in
      // the backend) it works on a copy so that `input` stays unchanged and costs about twice the
      // traffic of a true reduce-scatter. For a scratch input on CPU it runs in place: no
      // temporary, and Gloo's ring all-reduce beats its reduce-scatter (docs/benchmarks.md).
      at::Tensor whole = all_reduce_in_place || widen ? in : input.clone();
      c10d::AllreduceOptions o;
      o.reduceOp = c10d_op(op);
      o.timeout = options_.timeout;
      std::vector<at::Tensor> tensors{whole};
      issue(*state, [&] { return backend_for(input, *state).allreduce(tensors, o); });
      state->keep_alive = {input, output, whole};
      state->finalize = [output, whole, divide, world, begin_at, n] {
        at::Tensor block = whole.narrow(0, begin_at, n);
        if (divide) block.div_(world);
        if (block.data_ptr() != output.data_ptr()) output.copy_(block);
      };
      return CollectiveHandle(state);
    }
    // In place (output is this rank's block of input) is allowed by the contract; Gloo's
    // reduce-scatter gives no such guarantee, so it then writes a temporary that is copied back.
    const bool aliased = output.is_alias_of(input);
    at::Tensor out = widen || aliased ? at::empty({n}, output.options().dtype(in.scalar_type())) : output;
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(op);
    o.timeout = options_.timeout;
    issue(*state, [&] { return backend_for(input, *state)._reduce_scatter_base(out, in, o); });
    state->keep_alive = {input, output, in, out};
    if (divide || widen || aliased) {
      state->finalize = [output, out, divide, world] {
        if (divide) out.div_(world);
        if (!out.is_same(output)) output.copy_(out);
      };
    }
    return CollectiveHandle(state);
  }

  CollectiveHandle all_gather(at::Tensor input, at::Tensor output, std::string_view label) override {
    check_tensor("all_gather", label, input, "input");
    check_tensor("all_gather", label, output, "output");
    check_pair("all_gather", label, input, output, "output");
    auto state = begin("all_gather", label, elements_text(input) + " per rank", output.nbytes(), input.nbytes());
    if (info_.world_size == 1) {
      output.copy_(input);
      return finish_local(state);
    }
    state->keep_alive = {input, output};
    if (on_shared_memory(input)) {
      issue(*state, [&] { return shm_->all_gather(input, output); });
      return CollectiveHandle(state);
    }
    if (input.device().is_cpu() && !paths_.native_gloo_all_gather) {
      // Gloo's _allgather_base is 1.9-2.7x slower than one broadcast per rank into views of
      // the output for buffers of 16 MiB and more (bench/comm_bench.cpp, docs/benchmarks.md).
      int64_t n = input.numel();
      output.narrow(0, info_.rank * n, n).copy_(input);
      for (int root = 0; root < info_.world_size; ++root) {
        c10d::BroadcastOptions o;
        o.rootRank = root;
        o.rootTensor = 0;
        o.timeout = options_.timeout;
        std::vector<at::Tensor> tensors{output.narrow(0, root * n, n)};
        issue(*state, [&] { return gloo_->broadcast(tensors, o); });
      }
      return CollectiveHandle(state);
    }
    c10d::AllgatherOptions o;
    o.timeout = options_.timeout;
    issue(*state, [&] { return backend_for(input, *state)._allgather_base(output, input, o); });
    return CollectiveHandle(state);
  }

  CollectiveHandle broadcast(at::Tensor tensor, int root, std::string_view label) override {
    check_tensor("broadcast", label, tensor, "tensor");
    if (root < 0 || root >= info_.world_size) {
      throw CommError(fmt::format("{}: broadcast '{}': expected a root rank in 0..{}, found {}", who_, label,
                                  info_.world_size - 1, root));
    }
    auto state = begin("broadcast", label, fmt::format("{} from rank {}", elements_text(tensor), root), tensor.nbytes(),
                       tensor.nbytes());
    if (info_.world_size == 1) return finish_local(state);
    state->keep_alive = {tensor};
    if (on_shared_memory(tensor)) {
      issue(*state, [&] { return shm_->broadcast(tensor, root); });
      return CollectiveHandle(state);
    }
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.rootTensor = 0;
    o.timeout = options_.timeout;
    std::vector<at::Tensor> tensors{tensor};
    issue(*state, [&] { return backend_for(tensor, *state).broadcast(tensors, o); });
    state->keep_alive = {tensor};
    return CollectiveHandle(state);
  }

  NodePlacement placement() const override { return {info_.node_rank, info_.local_rank, info_.local_world_size}; }
  std::shared_ptr<Communicator> split(int color, std::string_view name) override;
  std::shared_ptr<CommsLogger> comms_logger() const override { return options_.comms_logger; }
  void set_comms_logger(std::shared_ptr<CommsLogger> logger) override { options_.comms_logger = std::move(logger); }

  void barrier(std::string_view label) override {
    auto state = begin("barrier", label, "", 0, 0);
    if (info_.world_size == 1) {
      finish_local(state);
      return;
    }
    c10d::BarrierOptions o;
    o.timeout = options_.timeout;
    // Always Gloo: a barrier carries no data, and an NCCL barrier would need a device.
    issue(*state, [&] { return gloo_->barrier(o); });
    CollectiveHandle(state).wait();
  }

 private:
  using StatePtr = std::shared_ptr<CollectiveHandle::State>;

  // Checks the communicator is usable and gives the collective its sequence number.
  // `bytes` is what the flight recorder shows, `message_bytes` what the comms logger counts.
  StatePtr begin(const char* kind, std::string_view label, std::string size_text, std::uint64_t bytes,
                 std::uint64_t message_bytes) {
    auto state = std::make_shared<CollectiveHandle::State>();
    state->kind = kind;
    state->label = std::string(label);
    state->size_text = std::move(size_text);
    state->who = who_;
    state->timeout = options_.timeout;
    state->failure = failure_;
    state->recorder = recorder_;
    if (std::string earlier = failure_->get(); !earlier.empty()) {
      state->sequence = next_sequence_;
      throw CommError(
          fmt::format("{} cannot start {}: the communicator failed earlier: {}", who_, state->describe(), earlier));
    }
    state->sequence = next_sequence_++;
    recorder_->issued(state->sequence, kind, label, bytes);
    if (options_.comms_logger && options_.comms_logger->wants(kind)) {
      state->logger = options_.comms_logger;
      state->message_bytes = message_bytes;
      state->issued_at = Clock::now();
    }
    return state;
  }

  static CollectiveHandle finish_local(const StatePtr& state) {
    state->done = true;
    state->recorder->finished(state->sequence, CollectiveState::Completed);
    state->log_completion();
    return CollectiveHandle(state);
  }

  // Starts the backend operation; a synchronous refusal (unsupported dtype, broken connection)
  // becomes a CommError and, since peers may already be inside the collective, poisons us.
  template <class Start>
  void issue(CollectiveHandle::State& state, Start&& start) {
    try {
      state.works.push_back(start());
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      fail_to_start(state, e);
    }
  }

  [[noreturn]] void fail_to_start(CollectiveHandle::State& state, const std::exception& e) {
    std::string error = fmt::format("{} could not start {}: {}", who_, state.describe(), first_line(e.what()));
    recorder_->finished(state.sequence, CollectiveState::Failed);
    if (failure_->record(error)) dump_flight_recorder(*recorder_, error);
    throw CommError(error);
  }

  bool on_shared_memory(const at::Tensor& t) const { return shm_ != nullptr && t.device().is_cpu(); }

  c10d::Backend& backend_for(const at::Tensor& t, CollectiveHandle::State& state) {
    if (t.device().is_cpu()) return *gloo_;
#ifdef ZT_CUDA
    if (t.is_cuda()) {
      if (!nccl_) {
        // Created at the first CUDA collective, which every rank reaches at the same point.
        auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
        nccl_options->timeout = options_.timeout;
        nccl_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>("zt/nccl", store_), info_.rank, info_.world_size, nccl_options);
      }
      state.stream_ordered = true;
      return *nccl_;
    }
#endif
    throw CommError(
        fmt::format("{}: {}: the tensor is on {}, which has no backend", who_, state.describe(), t.device().str()));
  }

  void check_tensor(const char* kind, std::string_view label, const at::Tensor& t, const char* name) const {
    auto fail = [&](const std::string& what) {
      throw CommError(fmt::format("{}: {} '{}': {}", who_, kind, label, what));
    };
    if (!t.defined()) fail(fmt::format("{} is an undefined tensor", name));
    if (!t.is_contiguous()) fail(fmt::format("{} must be contiguous (a flat buffer), found strides {}", name, c10::str(t.strides())));
    bool supported = t.device().is_cpu();
#ifdef ZT_CUDA
    supported = supported || t.is_cuda();
    const char* devices = "CPU (Gloo) and CUDA (NCCL) tensors";
#else
    const char* devices = "CPU tensors: this build has no CUDA support (configure with -DZT_CUDA=ON)";
#endif
    if (!supported) fail(fmt::format("{} is on {}; expected {}", name, t.device().str(), devices));
  }

  // `part` must hold world_size times fewer elements than `whole`, with the same dtype and device.
  void check_pair(const char* kind, std::string_view label, const at::Tensor& part, const at::Tensor& whole,
                  const char* whole_name) const {
    auto fail = [&](const std::string& what) {
      throw CommError(fmt::format("{}: {} '{}': {}", who_, kind, label, what));
    };
    if (part.scalar_type() != whole.scalar_type() || part.device() != whole.device()) {
      fail(fmt::format("input and output must have the same dtype and device, found {} on {} and {} on {}",
                       dtype_name(part.scalar_type()), part.device().str(), dtype_name(whole.scalar_type()),
                       whole.device().str()));
    }
    if (whole.numel() != part.numel() * info_.world_size) {
      fail(fmt::format("{} must hold world size ({}) x {} = {} elements, found {}", whole_name, info_.world_size,
                       part.numel(), part.numel() * info_.world_size, whole.numel()));
    }
  }

  static std::string elements_text(const at::Tensor& t) {
    return fmt::format("{} {} elements", t.numel(), dtype_name(t.scalar_type()));
  }

  c10d::ReduceOp c10d_op(ReduceOp op) const {
    switch (op) {
      case ReduceOp::Sum: return c10d::ReduceOp::SUM;
      case ReduceOp::Max: return c10d::ReduceOp::MAX;
      case ReduceOp::Avg: return caps_.avg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    }
    return c10d::ReduceOp::SUM;
  }

  RendezvousInfo info_;
  CommOptions options_;
  CollectivePaths paths_;
  std::string who_;         // how messages name this rank
  std::string group_name_;  // empty for the job's own communicator
  int job_rank_ = 0;
  BackendCaps caps_;
  std::shared_ptr<FailureState> failure_;
  std::shared_ptr<FlightRecorder> recorder_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  // CPU collectives when every rank maps one shared-memory segment (docs/comm.md "Shared memory").
  std::shared_ptr<SharedMemoryTransport> shm_;
#ifdef ZT_CUDA
  c10::intrusive_ptr<c10d::Backend> nccl_;
#endif
  std::uint64_t next_sequence_ = 0;
  int splits_ = 0;  // split() calls so far: the same count on every rank, which keeps groups' keys apart
};

std::shared_ptr<Communicator> ProcessGroupCommunicator::split(int color, std::string_view name) {
  if (color < 0)
    throw CommError(fmt::format("{}: split into groups '{}': expected a color >= 0, found {}", who_, name, color));
  const int world = info_.world_size;
  at::Tensor mine = at::full({1}, int64_t(color), at::kLong);
  at::Tensor colors = at::empty({world}, at::kLong);
  all_gather(mine, colors, fmt::format("split.{}", name)).wait();
  std::vector<int> members;
  const int64_t* color_of = colors.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r)
    if (color_of[r] == color) members.push_back(r);
  const int split_number = ++splits_;
  RendezvousInfo group = info_;
  group.rank = int(std::find(members.begin(), members.end(), info_.rank) - members.begin());
  group.world_size = int(members.size());
  group.local_rank = group.rank;
  group.local_world_size = group.world_size;
  group.node_rank = 0;
  group.listen_fd = -1;
  Group g;
  g.name = group_name_.empty() ? std::string(name) : fmt::format("{}/{}", group_name_, name);
  g.job_rank = job_rank_;
  g.caps = caps_;
  if (members.size() > 1) {
    // The group's own keys: NCCL's (made at its first CUDA collective) and, unless the group is
    // every rank (then it shares this communicator's connections), Gloo's.
    g.store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("zt/split{}/{}/{}", split_number, name, color), store_);
    const bool everyone = members.size() == size_t(world);
    const std::string who = fmt::format("rank {} of the job, group '{}'", job_rank_, g.name);
    g.gloo = everyone ? gloo_ : connect_gloo(g.store, group, options_, who);
    g.shm = everyone ? shm_ : connect_shared_memory(*g.store, group, options_, paths_, who);
  }
  return std::make_shared<ProcessGroupCommunicator>(group, options_, paths_, std::move(g));
}

}  // namespace

std::shared_ptr<Communicator> Communicator::split(int color, std::string_view name) {
  (void)color;
  throw Error(fmt::format("rank {}/{}: this communicator cannot split into groups ('{}')", rank(), world_size(), name));
}

void Communicator::set_comms_logger(std::shared_ptr<CommsLogger>) {
  throw Error(fmt::format("rank {}/{}: this communicator cannot record its collectives (comms_logger)", rank(),
                          world_size()));
}

NodeGroups make_node_groups(const std::shared_ptr<Communicator>& world) {
  const NodePlacement where = world->placement();
  if (where.local_world_size >= world->world_size())
    return {world, make_communicator(RendezvousInfo{}, CommOptions{})};
  NodeGroups groups;
  groups.within_node = world->split(where.node_rank, "node");
  groups.across_nodes = world->split(where.local_rank, "across nodes");
  return groups;
}

std::shared_ptr<Communicator> make_communicator(const RendezvousInfo& info, const CommOptions& options) {
  return make_communicator(info, options, CollectivePaths{});
}

std::shared_ptr<Communicator> make_communicator(const RendezvousInfo& info, const CommOptions& options,
                                                const CollectivePaths& paths) {
  // A write to a peer that has died raises SIGPIPE, whose default action ends this rank before
  // the failed collective can say what happened (and makes the launcher blame this rank). With
  // SIGPIPE ignored the write fails with EPIPE and becomes a CommError naming the collective. A
  // handler the program installed itself is left alone (docs/comm.md "Failures").
  if (info.world_size > 1) {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  }
  return std::make_shared<ProcessGroupCommunicator>(info, options, paths);
}

}  // namespace zt
