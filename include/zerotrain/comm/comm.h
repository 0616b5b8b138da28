// comm — rendezvous from launcher environment variables and a narrow Communicator over c10d
// (docs/comm.md). Collectives work on flat contiguous buffers.
//
// Contract
// - Threads: one Communicator is driven by one thread at a time (collectives must be issued in
//   the same order on every rank; that is what gives each one the same sequence number
//   everywhere). A CollectiveHandle may be waited, or polled, from any thread, also
//   concurrently; its result becomes visible once wait() has returned.
// - Ownership: the handle keeps every tensor passed to the collective (and any temporary it
//   needed) alive until it has completed. The caller must not read or write those tensors
//   between issuing the collective and wait() returning.
// - Failures: wait() and barrier() throw zt::CommError whose message names this rank, the
//   world size, the collective's kind, label and sequence number, its size, and what the rank
//   was waiting for. Nothing waits forever: each collective fails after CommOptions::timeout.
//   After a failure the communicator is unusable: later collectives throw at once.
// - Backends: Gloo for CPU tensors; NCCL for CUDA tensors when built with ZT_CUDA. Where a
//   backend lacks a primitive or a dtype, the communicator emulates it (see docs/comm.md).
// - Flight recorder: a communicator keeps its last 64 collectives (sequence, kind, label, bytes,
//   times, state) and writes them to stderr at its first failure. When ZT_FLIGHT_RECORDER_FILE
//   names a file (zerotrain's launcher sets one per rank) the ring lives in that file, which keeps
//   the last records after the process dies; the launcher then names the rank whose collectives
//   diverged (docs/comm.md "Flight recorder").
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace zt {

class CommsLogger;  // zerotrain/comm/comms_logger.h

// Where this process sits in the job, and where to meet the others.
struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // The node this process runs on, 0-based (GROUP_RANK, SLURM_NODEID; see below).
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single";  // "torchrun", "slurm", "mpi" or "single"
  // Rank 0 only: a socket already listening on master_port that zerotrain's launcher (or a test
  // harness) opened and handed down (ZT_RENDEZVOUS_LISTEN_FD), so no other process can take the
  // port between its choice and the store's start; -1 when rank 0 binds the port itself.
  int listen_fd = -1;
  // torchrun's agent on node 0 already serves the store at master_addr:master_port
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, connects to it as a client.
  bool agent_store = false;
};

// Reads a variable; returns nullptr when unset. Lets tests supply their own environment.
using EnvLookup = std::function<const char*(const char*)>;

// In order of precedence:
//  1. torchrun and zerotrain's launcher: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//     GROUP_RANK (the node; default (RANK - LOCAL_RANK) / LOCAL_WORLD_SIZE),
//     MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500); for rank 0 also
//     ZT_RENDEZVOUS_LISTEN_FD (the launcher's listening socket, see listen_fd);
//     TORCHELASTIC_USE_AGENT_STORE=True (torchrun's agent serves the store, see agent_store).
//  2. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS_PER_NODE or
//     SLURM_TASKS_PER_NODE (e.g. "2(x3),1", indexed by SLURM_NODEID); the master is
//     MASTER_ADDR when set, else the first host of SLURM_STEP_NODELIST / SLURM_NODELIST
//     (simple forms: "a,b", "node[01-04,07]"), else SLURM_LAUNCH_NODE_IPADDR; the port is
//     MASTER_PORT, else 15000 + SLURM_JOB_ID % 20000 (so concurrent jobs rarely collide).
//  3. Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE with MASTER_ADDR /
//     MASTER_PORT; MASTER_ADDR defaults to 127.0.0.1 only when all ranks are on one node; the node
//     is (rank - local rank) / local size (mpirun fills one node after another).
//  4. Otherwise a single process: rank 0 of 1.
// Malformed values throw zt::ConfigError naming the variable, what was expected and found.
RendezvousInfo rendezvous_from_environment();
RendezvousInfo rendezvous_from_environment(const EnvLookup& getenv);

enum class ReduceOp { Sum, Avg, Max };

// Whether a reduce_scatter may use its input as workspace. Scratch lets the CPU path all-reduce
// the input in place and keep its own block, which measured faster than Gloo's reduce-scatter and
// needs no temporary (docs/comm.md); callers whose input is a bucket buffer or a gradient arena
// about to be zeroed pass Scratch.
enum class InputUse { Preserve, Scratch };
const char* to_string(ReduceOp op);

struct CommOptions {
  // How long a rank waits in one collective (or for its peers at rendezvous) before failing.
  std::chrono::milliseconds timeout{300000};
  // CPU collectives among ranks that can all map one shared-memory segment (ranks on one machine)
  // are copied through it by a worker thread instead of going through Gloo over loopback: 2-4x
  // faster at the sizes training moves (docs/comm.md "Shared memory"). Where a rank cannot map it
  // (ranks on several machines, no /dev/shm) every rank uses Gloo. ZT_COMM_SHARED_MEMORY=0 turns it
  // off (comm_options_from_environment).
  bool shared_memory = true;
  // When set, every collective the logger wants is timed from issue to completion and recorded
  // there (comms_logger, zerotrain/comm/comms_logger.h). Unset: no timing at all.
  std::shared_ptr<CommsLogger> comms_logger;
};

// Default options with the timeout from `config_seconds` when given, else from the environment
// variable ZT_COMM_TIMEOUT_SECONDS when set, else 300 s, and shared_memory from
// ZT_COMM_SHARED_MEMORY (1 or 0) when set. Non-positive or non-numeric timeouts and other
// values throw zt::ConfigError.
CommOptions comm_options_from_environment(std::optional<double> config_seconds = std::nullopt);
CommOptions comm_options_from_environment(std::optional<double> config_seconds, const EnvLookup& getenv);

// Where a rank runs among the nodes of its job.
struct NodePlacement {
  int node_rank = 0;
  int local_rank = 0;
  int local_world_size = 1;
};

// An issued collective. Copyable; all copies refer to the same collective.
class CollectiveHandle {
 public:
  struct State;  // defined by the implementation
  CollectiveHandle() = default;  // refers to nothing; wait() returns at once
  explicit CollectiveHandle(std::shared_ptr<State> state);

  // Blocks until the collective has completed and its result is in the output tensor(s).
  // Throws zt::CommError on failure or after the timeout. Waiting again returns at once (or
  // throws the same error again).
  void wait();
  // True when wait() would not block on communication.
  bool is_completed() const;

  const std::string& label() const;
  std::uint64_t sequence() const;
  std::string_view kind() const;  // "all_reduce", "reduce_scatter", ...

 private:
  std::shared_ptr<State> state_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The sequence number the next collective will get (0 for the first one).
  virtual std::uint64_t next_sequence() const = 0;

  // In place over `flat` (contiguous).
  virtual CollectiveHandle all_reduce(at::Tensor flat, ReduceOp op, std::string_view label) = 0;
  // `input` holds world_size * n elements, `output` n; rank r receives the reduction of
  // block r. `output` may be this rank's own block of `input` (in place). With
  // InputUse::Preserve the rest of `input` is left unchanged; with InputUse::Scratch its contents
  // are unspecified afterwards.
  virtual CollectiveHandle reduce_scatter(at::Tensor input, at::Tensor output, ReduceOp op, std::string_view label,
                                          InputUse input_use = InputUse::Preserve) = 0;
  // `input` holds n elements, `output` world_size * n; block r of `output` is rank r's input.
  virtual CollectiveHandle all_gather(at::Tensor input, at::Tensor output, std::string_view label) = 0;
  // In place: every rank receives `root`'s tensor.
  virtual CollectiveHandle broadcast(at::Tensor tensor, int root, std::string_view label) = 0;
  // Blocks until every rank has entered it; throws zt::CommError after the timeout.
  virtual void barrier(std::string_view label) = 0;

  // Where this rank runs; by default every rank on one node.
  virtual NodePlacement placement() const { return {0, rank(), world_size()}; }
  // A communicator over the ranks that pass the same `color` (>= 0), numbered in their order
  // here, whose collectives involve those ranks alone. A collective of this communicator: every
  // rank calls it at the same point, each with its own color. `name` labels the group in
  // messages ("rank 1/2 of group 'node' (rank 3 of the job)"). The new communicator has its own
  // sequence numbers and flight recorder (in memory), the same timeout and options, and places its
  // ranks on their nodes (placement(): the members' nodes numbered in order, a rank's place among
  // the members on its node); a group of one needs no network, a group of every rank shares this
  // communicator's connections. Throws zt::CommError when the group cannot be formed; the
  // default, for a communicator that cannot split, throws zt::Error.
  virtual std::shared_ptr<Communicator> split(int color, std::string_view name);

  // The logger every collective issued from now on is recorded in (comms_logger), shared with the
  // groups split from this communicator afterwards; null: none. The engine attaches one when its
  // configuration enables comms_logger and the communicator has none. The default, for a
  // communicator that cannot record, throws zt::Error.
  virtual std::shared_ptr<CommsLogger> comms_logger() const { return nullptr; }
  virtual void set_comms_logger(std::shared_ptr<CommsLogger> logger);
};

// The job's node structure, for the collectives that follow it (hierarchical reductions, the
// stage-3 secondary partition; docs/comm.md "Node groups"): Engine::node_groups() gives the
// engine's, made at its construction.
struct NodeGroups {
  std::shared_ptr<Communicator> within_node;   // the ranks of this node
  std::shared_ptr<Communicator> across_nodes;  // the ranks of this local rank, one per node
};

// The 2-D grid of tensor and data parallelism (docs/tensor_parallel.md "The 2-D grid"): the world's
// ranks g·T … g·T+T−1 form tensor group g (consecutive ranks, so within one node when T divides
// the ranks per node), and the ranks with the same rank % T form a data-parallel group, over which
// an Engine shards and reduces. T = 1: no tensor group, and the data-parallel group is `world`.
struct ProcessGrid {
  int tensor_size = 1;
  std::shared_ptr<Communicator> tensor;  // null when tensor_size is 1
  std::shared_ptr<Communicator> data;
};
// A collective (two splits) for T > 1. Throws zt::ConfigError, naming `key`, when T < 1, T does
// not divide the world, or the world spans several nodes and T does not divide the ranks of each.
ProcessGrid make_process_grid(const std::shared_ptr<Communicator>& world, int tensor_size,
                              const std::string& key = "tensor_parallel.autotp_size");

// Meets the other ranks (TCP store on rank 0 at master_addr:master_port; a master on the
// loopback address binds only to loopback) and builds the backend(s). A world of one needs no
// network. Throws zt::CommError when the peers do not arrive within the timeout.
std::shared_ptr<Communicator> make_communicator(const RendezvousInfo& info, const CommOptions& options = {});

}  // namespace zt
