// Rendezvous information and communicator options from launcher environment variables.
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {
namespace {

// Strict integer parsing: the whole value must be a base-10 integer in [lo, hi].
long long parse_int(const char* name, const char* value, long long lo, long long hi, const char* expected) {
  std::string s = value;
  const char* begin = s.c_str();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(begin, &end, 10);
  bool ok = !s.empty() && errno == 0 && end == begin + s.size() && v >= lo && v <= hi &&
            s.find_first_of(" \t+") == std::string::npos;
  if (!ok) {
    throw ConfigError(fmt::format("environment variable {}: expected {}, found '{}'", name, expected, s));
  }
  return v;
}

struct Env {
  const EnvLookup& lookup;
  const char* get(const char* name) const {
    const char* v = lookup(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  }
  bool has(const char* name) const { return get(name) != nullptr; }
  const char* require(const char* name, const char* because) const {
    const char* v = get(name);
    if (v == nullptr) {
      throw ConfigError(fmt::format("environment variable {}: expected it to be set ({}), found it unset", name, because));
    }
    return v;
  }
  int count(const char* name) const { return int(parse_int(name, get(name), 1, 1 << 24, "a positive integer")); }
  int index(const char* name) const { return int(parse_int(name, get(name), 0, 1 << 24, "a non-negative integer")); }
  int port(const char* name) const { return int(parse_int(name, get(name), 1, 65535, "a TCP port in 1..65535")); }
};

void check_rank(const char* name, int rank, const char* size_name, int size) {
  if (rank >= size) {
    throw ConfigError(fmt::format("environment variable {}: expected a rank below {}={}, found {}", name, size_name, size, rank));
  }
}

// "2(x3),1" -> {2, 2, 2, 1}; Slurm's compressed tasks-per-node list.
std::vector<int> expand_tasks_per_node_items(const char* name, const std::string& value) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= value.size()) {
    size_t comma = value.find(',', pos);
    std::string item = value.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int repeat = 1;
    size_t paren = item.find("(x");
    if (paren != std::string::npos && !item.empty() && item.back() == ')') {
      std::string rep = item.substr(paren + 2, item.size() - paren - 3);
      repeat = int(parse_int(name, rep.c_str(), 1, 1 << 20, "a list like '2(x3),1'"));
      item = item.substr(0, paren);
    }
    int tasks = int(parse_int(name, item.c_str(), 1, 1 << 24, "a list like '2(x3),1'"));
    out.insert(out.end(), repeat, tasks);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::vector<int> expand_tasks_per_node(const char* name, const std::string& value) {
  try {
    return expand_tasks_per_node_items(name, value);
  } catch (const ConfigError&) {
    // Name the whole value, not the piece that failed to parse.
    throw ConfigError(fmt::format("environment variable {}: expected a list like '2(x3),1', found '{}'", name, value));
  }
}

// First host of a Slurm node list in its simple forms: "a,b", "node[01-04,07]", "node7".
// Returns an empty string for forms we do not parse (the caller falls back or asks for
// MASTER_ADDR).
std::string first_slurm_host(const std::string& list) {
  size_t bracket = list.find('[');
  size_t comma = list.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return list.substr(0, comma);
  }
  size_t close = list.find(']', bracket);
  if (close == std::string::npos) return "";
  std::string prefix = list.substr(0, bracket);
  std::string range = list.substr(bracket + 1, close - bracket - 1);
  std::string first = range.substr(0, range.find_first_of(",-"));
  if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) return "";
  return prefix + first;  // keeps zero padding: node[01-04] -> node01
}

RendezvousInfo from_torchrun(const Env& env) {
  RendezvousInfo info;
  info.source = "torchrun";
  info.world_size = env.count("WORLD_SIZE");
  info.rank = env.index("RANK");
  check_rank("RANK", info.rank, "WORLD_SIZE", info.world_size);
  // Without the local variables we cannot know the node layout; assume one node, which is what
  // a plain multi-process test run is.
  info.local_rank = env.has("LOCAL_RANK") ? env.index("LOCAL_RANK") : info.rank;
  info.local_world_size = env.has("LOCAL_WORLD_SIZE") ? env.count("LOCAL_WORLD_SIZE") : info.world_size;
  if (info.local_world_size > info.world_size) {
    throw ConfigError(fmt::format("environment variable LOCAL_WORLD_SIZE: expected at most WORLD_SIZE={}, found {}",
                                  info.world_size, info.local_world_size));
  }
  check_rank("LOCAL_RANK", info.local_rank, "LOCAL_WORLD_SIZE", info.local_world_size);
  // torchrun and zerotrain's launcher number the nodes in GROUP_RANK; without it, ranks are
  // assumed placed node by node (torchrun's own numbering).
  info.node_rank = env.has("GROUP_RANK") ? env.index("GROUP_RANK") : (info.rank - info.local_rank) / info.local_world_size;
  if (info.node_rank > info.rank)
    throw ConfigError(fmt::format("environment variable GROUP_RANK: expected a node index at most RANK={}, found {}",
                                  info.rank, info.node_rank));
  if (const char* addr = env.get("MASTER_ADDR")) info.master_addr = addr;
  if (env.has("MASTER_PORT")) info.master_port = env.port("MASTER_PORT");
  // torchrun (static and c10d rendezvous alike) hands its workers the store its agent on node 0
  // serves; a rank 0 that tried to serve one of its own on that port would find it taken.
  if (const char* agent = env.get("TORCHELASTIC_USE_AGENT_STORE")) info.agent_store = std::string(agent) == "True";
  if (info.rank == 0 && !info.agent_store && env.has("ZT_RENDEZVOUS_LISTEN_FD"))
    info.listen_fd = int(parse_int("ZT_RENDEZVOUS_LISTEN_FD", env.get("ZT_RENDEZVOUS_LISTEN_FD"), 0, 1 << 20,
                                   "a file descriptor number"));
  return info;
}

RendezvousInfo from_slurm(const Env& env) {
  RendezvousInfo info;
  info.source = "slurm";
  info.world_size = env.count("SLURM_NTASKS");
  info.rank = env.index("SLURM_PROCID");
  check_rank("SLURM_PROCID", info.rank, "SLURM_NTASKS", info.world_size);
  info.local_rank = env.has("SLURM_LOCALID") ? env.index("SLURM_LOCALID") : 0;
  if (env.has("SLURM_NTASKS_PER_NODE") &&
      std::string(env.get("SLURM_NTASKS_PER_NODE")).find_first_not_of("0123456789") == std::string::npos) {
    info.local_world_size = env.count("SLURM_NTASKS_PER_NODE");
  } else if (env.has("SLURM_TASKS_PER_NODE")) {
    auto per_node = expand_tasks_per_node("SLURM_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE"));
    int node = env.has("SLURM_NODEID") ? env.index("SLURM_NODEID") : 0;
    if (node >= int(per_node.size())) {
      throw ConfigError(fmt::format("environment variable SLURM_NODEID: expected a node index below {} (entries in "
                                    "SLURM_TASKS_PER_NODE='{}'), found {}",
                                    per_node.size(), env.get("SLURM_TASKS_PER_NODE"), node));
    }
    info.local_world_size = per_node[node];
  } else {
    info.local_world_size = info.local_rank + 1;
  }
  check_rank("SLURM_LOCALID", info.local_rank, "the tasks per node", info.local_world_size);
  info.node_rank = env.has("SLURM_NODEID") ? env.index("SLURM_NODEID") : 0;

  // Rank 0 (the store's server) runs on the first node of the step, so that is the master.
  // The launch node is only a fallback: srun started from a login node reports the login node.
  if (const char* addr = env.get("MASTER_ADDR")) {
    info.master_addr = addr;
  } else {
    std::string host;
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}) {
      if (env.has(name)) {
        host = first_slurm_host(env.get(name));
        break;
      }
    }
    if (host.empty() && env.has("SLURM_LAUNCH_NODE_IPADDR")) host = env.get("SLURM_LAUNCH_NODE_IPADDR");
    if (host.empty()) {
      throw ConfigError(
          "environment variable MASTER_ADDR: expected it to be set because the Slurm node list is missing or in "
          "a form zerotrain does not parse, found it unset");
    }
    info.master_addr = host;
  }
  if (env.has("MASTER_PORT")) {
    info.master_port = env.port("MASTER_PORT");
  } else if (env.has("SLURM_JOB_ID")) {
    long long job = parse_int("SLURM_JOB_ID", env.get("SLURM_JOB_ID"), 0, (1LL << 62), "a non-negative integer");
    info.master_port = int(15000 + job % 20000);
  }
  return info;
}

RendezvousInfo from_open_mpi(const Env& env) {
  RendezvousInfo info;
  info.source = "mpi";
  info.world_size = env.count("OMPI_COMM_WORLD_SIZE");
  info.rank = env.index("OMPI_COMM_WORLD_RANK");
  check_rank("OMPI_COMM_WORLD_RANK", info.rank, "OMPI_COMM_WORLD_SIZE", info.world_size);
  info.local_rank = env.has("OMPI_COMM_WORLD_LOCAL_RANK") ? env.index("OMPI_COMM_WORLD_LOCAL_RANK") : info.rank;
  info.local_world_size =
      env.has("OMPI_COMM_WORLD_LOCAL_SIZE") ? env.count("OMPI_COMM_WORLD_LOCAL_SIZE") : info.world_size;
  check_rank("OMPI_COMM_WORLD_LOCAL_RANK", info.local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE", info.local_world_size);
  // mpirun's default placement fills one node after another.
  info.node_rank = (info.rank - info.local_rank) / info.local_world_size;
  if (const char* addr = env.get("MASTER_ADDR")) {
    info.master_addr = addr;
  } else if (info.local_world_size != info.world_size) {
    // mpirun does not say where rank 0 runs; only a single-node job can assume loopback.
    env.require("MASTER_ADDR", "Open MPI ranks span several nodes, so the address of rank 0's node is needed");
  }
  if (env.has("MASTER_PORT")) info.master_port = env.port("MASTER_PORT");
  return info;
}

}  // namespace

RendezvousInfo rendezvous_from_environment(const EnvLookup& getenv) {
  Env env{getenv};
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    env.require("RANK", "WORLD_SIZE is set");
    env.require("WORLD_SIZE", "RANK is set");
    return from_torchrun(env);
  }
  if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) return from_slurm(env);
  if (env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE")) {
    env.require("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE is set");
    env.require("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set");
    return from_open_mpi(env);
  }
  RendezvousInfo info;
  if (const char* addr = env.get("MASTER_ADDR")) info.master_addr = addr;
  if (env.has("MASTER_PORT")) info.master_port = env.port("MASTER_PORT");
  return info;
}

RendezvousInfo rendezvous_from_environment() {
  return rendezvous_from_environment([](const char* name) { return std::getenv(name); });
}

CommOptions comm_options_from_environment(std::optional<double> config_seconds, const EnvLookup& getenv) {
  CommOptions options;
  if (const char* value = getenv("ZT_COMM_SHARED_MEMORY"); value != nullptr && *value != '\0') {
    const std::string v = value;
    if (v != "0" && v != "1")
      throw ConfigError(fmt::format(
          "environment variable ZT_COMM_SHARED_MEMORY: expected 1 (ranks on one machine meet in shared memory) or 0 "
          "(Gloo over loopback), found '{}'",
          v));
    options.shared_memory = v == "1";
  }
  double seconds = 0;
  if (config_seconds) {
    seconds = *config_seconds;
    if (!(seconds > 0) || seconds > 1e7) {
      throw ConfigError(fmt::format("comm timeout: expected a positive number of seconds, found {}", seconds));
    }
  } else if (const char* value = getenv("ZT_COMM_TIMEOUT_SECONDS"); value != nullptr && *value != '\0') {
    char* end = nullptr;
    errno = 0;
    seconds = std::strtod(value, &end);
    if (errno != 0 || end == value || *end != '\0' || !(seconds > 0) || seconds > 1e7) {
      throw ConfigError(fmt::format(
          "environment variable ZT_COMM_TIMEOUT_SECONDS: expected a positive number of seconds, found '{}'", value));
    }
  } else {
    return options;
  }
  options.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
  if (options.timeout.count() < 1) options.timeout = std::chrono::milliseconds(1);
  return options;
}

CommOptions comm_options_from_environment(std::optional<double> config_seconds) {
  return comm_options_from_environment(config_seconds, [](const char* name) { return std::getenv(name); });
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

}  // namespace zt
