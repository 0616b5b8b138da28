// The node groups of a communicator (zerotrain/comm/comm.h NodeGroups), which the engine makes at its
// construction and hands out as Engine::node_groups(). Internal; not installed.
#pragma once
#include <memory>

#include "zerotrain/comm/comm.h"

namespace zt {

// On one node (placement().local_world_size == world_size()) `within_node` is `world` itself and
// `across_nodes` a world of one, and nothing is sent. On several it splits `world` twice (by
// node_rank, then by local_rank): a collective of `world`, at the same point on every rank.
NodeGroups make_node_groups(const std::shared_ptr<Communicator>& world);

}  // namespace zt
