// What every Communicator has by default (no split, no comms logger) and the node groups built on
// split (comm/node_groups.h, docs/comm.md "Node groups").
#include <fmt/format.h>

#include <memory>
#include <string_view>

#include "comm/node_groups.h"
#include "zerotrain/comm/comm.h"
#include "zerotrain/error.h"

namespace zt {

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

ProcessGrid make_process_grid(const std::shared_ptr<Communicator>& world, int tensor_size, const std::string& key) {
  const int ranks = world->world_size();
  if (tensor_size < 1 || ranks % tensor_size != 0)
    throw ConfigError(key + ": expected a divisor of the world size " + std::to_string(ranks) + ", found " +
                      std::to_string(tensor_size));
  ProcessGrid grid;
  grid.tensor_size = tensor_size;
  if (tensor_size == 1) {
    grid.data = world;
    return grid;
  }
  // A tensor group's collectives run inside every layer: across nodes they would crawl.
  const NodePlacement where = world->placement();
  if (where.local_world_size < ranks && where.local_world_size % tensor_size != 0)
    throw ConfigError(key + ": expected a divisor of the " + std::to_string(where.local_world_size) +
                      " ranks per node, so that each tensor group lies within one node, found " +
                      std::to_string(tensor_size));
  grid.tensor = world->split(world->rank() / tensor_size, "tensor");
  grid.data = world->split(world->rank() % tensor_size, "data");
  return grid;
}

}  // namespace zt
