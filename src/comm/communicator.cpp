// Communicator over c10d process groups: Gloo for CPU tensors, NCCL for CUDA tensors (ZT_CUDA),
// CPU collectives of ranks on one machine through shared memory. Adds what c10d leaves to the
// caller: a sequence number and label on every collective, emulations where a backend lacks a
// primitive, and groups split from the job's ranks. The bounded wait of each collective is in
// collective_handle.cpp, the rendezvous in store_rendezvous.cpp.
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef ZT_CUDA
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1  // the header's contents are guarded by it; the CUDA wheel is built with NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <signal.h>

#include <ATen/ATen.h>
#include <algorithm>
#include <mutex>

#include "comm/collective_paths.h"
#include "comm/flight_recorder.h"
#include "comm/process_group.h"
#include "comm/shared_memory.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/comm/comms_logger.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

using comm_detail::Clock;
using comm_detail::dump_flight_recorder;
using comm_detail::FailureState;
using comm_detail::first_line;
using comm_detail::is_loopback;
using comm_detail::rendezvous;
using comm_detail::seconds;

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
  // Every rank's color and node: the group's ranks keep their places among the nodes.
  at::Tensor mine = at::tensor({int64_t(color), int64_t(info_.node_rank)}, at::kLong);
  at::Tensor gathered = at::empty({2 * world}, at::kLong);
  all_gather(mine, gathered, fmt::format("split.{}", name)).wait();
  std::vector<int> members;
  const int64_t* of = gathered.data_ptr<int64_t>();  // rank r: color of[2r], node of[2r + 1]
  for (int r = 0; r < world; ++r)
    if (of[2 * r] == color) members.push_back(r);
  const int split_number = ++splits_;
  RendezvousInfo group = info_;
  group.rank = int(std::find(members.begin(), members.end(), info_.rank) - members.begin());
  group.world_size = int(members.size());
  // This rank's node among the members' nodes (numbered in the order they first appear), and its
  // place among the members on that node.
  std::vector<int64_t> nodes;
  group.local_rank = group.local_world_size = 0;
  for (int member : members) {
    const int64_t node = of[2 * member + 1];
    if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(node);
    if (node != info_.node_rank) continue;
    if (member < info_.rank) ++group.local_rank;
    ++group.local_world_size;
  }
  group.node_rank = int(std::find(nodes.begin(), nodes.end(), int64_t(info_.node_rank)) - nodes.begin());
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
