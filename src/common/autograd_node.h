// The handle by which torch's autograd holds a graph node, across the torch versions the Python
// package builds against (cmake/torch-python-range.txt): std::shared_ptr<Node> in torch 2.11,
// c10::intrusive_ptr<Node> by torch 2.15. Code that keeps a node (a gradient accumulator it
// hooks) or makes one (a custom backward node) goes through these two names only.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace zt {

// What torch::autograd::impl::grad_accumulator returns: this torch's owning handle of a Node.
using AutogradNodeHandle = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// A new NodeType (a subclass of torch::autograd::Node) held as this torch holds nodes.
template <class NodeType>
auto make_autograd_node() {
  if constexpr (std::is_same_v<AutogradNodeHandle, std::shared_ptr<torch::autograd::Node>>) {
    // torch's own deleter, which frees a long chain of nodes without deep recursion (found by
    // argument-dependent lookup: the name is gone from the torch versions whose nodes are intrusive).
    return std::shared_ptr<NodeType>(new NodeType(), [](NodeType* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<NodeType>();
  }
}

}  // namespace zt
